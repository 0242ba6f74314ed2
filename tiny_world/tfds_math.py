"""A small math dataset in TFDS's GSM8K shape, built offline: the `tfds` dataset path end to end.

    python -m tiny_world.tfds_math --data_dir=/tmp/tfds

writes `tiny_math` (splits 'train' and 'test', ArrayRecord files, ~1 s) under
`--data_dir` with `tensorflow_datasets` alone: no TensorFlow, no download
(the `tfds build` command needs TensorFlow). A config then reads it like any
prepared TFDS dataset, by name:

    c.datasets.math_eval = dict(tfds='tiny_math', data_dir='/tmp/tfds', split='test',
                                format='gsm8k', domain='math')

Records are GSM8K's fields, `question` and `answer` ending in `#### <n>`
(`cascade.data`'s 'gsm8k' format). A real TFDS dataset such as `gsm8k` is
prepared the same way, with network access for its download (TFDS registers
gsm8k when `tensorflow_datasets.text` is imported):

    import tensorflow_datasets as tfds, tensorflow_datasets.text
    tfds.builder('gsm8k', data_dir=..., file_format='array_record').download_and_prepare()
"""

from __future__ import annotations

import random

from absl import app
from absl import flags

NAME = 'tiny_math'


def problems(split: str, n: int) -> list[dict[str, str]]:
  """`n` two-step problems of `split` (seeded by it): GSM8K's question / '... #### n' answer."""
  rng = random.Random(f'{NAME}/{split}')
  out = []
  for _ in range(n):
    a, b, c = rng.randint(2, 30), rng.randint(1, 20), rng.randint(1, 9)
    out.append({'question': f'Mia has {a} shells, finds {b} more, then gives {c} away. How '
                            'many shells does she have?',
                'answer': f'{a}+{b}={a + b}. {a + b}-{c}={a + b - c}.\n#### {a + b - c}'})
  return out


def builder(data_dir: str, sizes: dict[str, int] | None = None):
  """The TFDS builder of `tiny_math` under `data_dir` (ArrayRecord files, what
  `tfds.data_source` reads); `sizes`: examples per split (default train 64, test 16)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  sizes = dict(sizes or {'train': 64, 'test': 16})

  class TinyMath(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Two-step word problems in GSM8K's fields."""
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {'question': tfds.features.Text(), 'answer': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager           # nothing to download
      return {split: self._generate_examples(split, n) for split, n in sizes.items()}

    def _generate_examples(self, split, n):
      for i, p in enumerate(problems(split, n)):
        yield f'{split}-{i}', p

  TinyMath.name = NAME
  return TinyMath(data_dir=data_dir, file_format='array_record')


def build(data_dir: str, sizes: dict[str, int] | None = None) -> str:
  """Prepares `tiny_math` under `data_dir`; returns the dataset's directory."""
  b = builder(data_dir, sizes)
  b.download_and_prepare()
  return str(b.data_dir)


def main(argv):
  del argv
  print(f'{NAME} prepared in {build(flags.FLAGS.data_dir)}')


if __name__ == '__main__':
  flags.DEFINE_string('data_dir', None, 'Where TFDS datasets are kept.', required=True)
  app.run(main)
