"""The TFDS dataset path end to end, offline: tiny_world/tfds_math.py builds a small GSM8K-shaped
dataset with tensorflow_datasets alone (no TensorFlow, no download), and a config's
`dict(tfds=..., data_dir=..., split=..., format='gsm8k')` reads it through cascade.data, in a
process that never imported the builder (TFDS reads a prepared dataset from its files)."""

import os
import re
import subprocess
import sys

import pytest

from cascade import config as config_lib
from cascade.data import readers
from tiny_world import tfds_math

pytest.importorskip('tensorflow_datasets')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_docstrings_command_builds_it_and_its_spec_reads_it(tmp_path):
  data_dir = tmp_path / 'tfds'
  proc = subprocess.run([sys.executable, '-m', 'tiny_world.tfds_math', f'--data_dir={data_dir}'],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f'tiny_math prepared in {data_dir}/tiny_math/1.0.0' in proc.stdout
  # The docstring's dataset spec, with this data_dir, through the config's validation.
  [spec_text] = re.findall(r'c\.datasets\.math_eval = (dict\(.*?\))', tfds_math.__doc__, re.S)
  spec = eval(spec_text.replace("'/tmp/tfds'", repr(str(data_dir))))  # pylint: disable=eval-used
  ds = config_lib.Dataset.parse('math_eval', spec,
                                {k: v.record_type for k, v in readers.FORMATS.items()})
  assert (ds.tfds, ds.split, ds.data_dir) == ('tiny_math', 'test', str(data_dir))
  # This process never made the builder class (the build ran in its own): TFDS reads the
  # prepared files.
  records = readers.load(ds)
  want = tfds_math.problems('test', 16)
  assert len(records) == 16 and all(r['domain'] == 'math' for r in records)
  got = sorted((r['messages'][0]['content'].split('\n')[0], r['metadata']['answer'])
               for r in records)
  assert got == sorted((p['question'], p['answer'].rsplit('#### ', 1)[1]) for p in want)
  # Each answer is the float64 sum of its question's numbers.
  for question, answer in got:
    a, b, c = map(int, re.findall(r'\d+', question))
    assert int(answer) == a + b - c


def test_the_docstrings_gsm8k_builder_is_found_without_tensorflow(tmp_path):
  # Its first line as written, then the builder the second line prepares (the download itself
  # needs the network, which this host lacks): an ArrayRecord builder, as tfds.data_source reads.
  lines = re.findall(r'(?m)^    (import tensorflow_datasets.*|tfds\.builder\(.*)$', tfds_math.__doc__)
  assert len(lines) == 2
  scope = {}
  exec(lines[0], scope)  # pylint: disable=exec-used
  call = lines[1].replace('data_dir=...', f'data_dir={str(tmp_path)!r}')
  b = eval(call.split(').download_and_prepare()')[0] + ')', scope)  # pylint: disable=eval-used
  assert b.name == 'gsm8k' and b.info.file_format.value == 'array_record'
  assert str(b.data_dir).startswith(str(tmp_path))
