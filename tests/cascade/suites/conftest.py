"""A toy suite the runner tests sample with the stand-in sampler (tests/cascade/conftest.py's
`fakes`): 'Copy N.' prompts, a completion is right when it is N, graded exactly."""

import dataclasses
import pathlib
import types

import pytest

from cascade.suites import base


class ExactGrader(base.Grader):
  """1 when the completion is the record's answer, else 0; the answer itself for maj@k.
  Counts the records it graded and whether it was closed."""

  def __init__(self, log):
    self.log = log

  def grade(self, record, completions):
    self.log.append(record['id'])
    return [base.Graded(score=float(c.strip() == record['metadata']['answer']),
                        answer=c.strip() or None, info={'reason': 'exact match'})
            for c in completions]

  def close(self):
    self.log.append('closed')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySuite(base.Suite):
  """Records made in memory (`records`); `parse` reads them back from a .jsonl."""

  log: list = dataclasses.field(default_factory=list, compare=False)

  def parse(self, path, raw):
    return [{'id': base.field(path, line, row, 'id'), 'messages': row['messages'],
             'metadata': row['metadata']} for line, row in raw]

  def grader(self, **options):
    del options
    return ExactGrader(self.log)


def records(n):
  """n 'Copy i.' records (answer str(i))."""
  return [{'id': f'r{i}', 'messages': [{'role': 'user', 'content': f'Copy {i}.'}],
           'metadata': {'answer': str(i)}} for i in range(n)]


def toy_suite(name='toy_copy', samples=4, reported=()):
  return ToySuite(name=name, title='Toy copy', source='made by the test', files=('*.jsonl',),
                  protocol=base.Protocol(samples=samples, temperature=1.0, top_p=1.0,
                                         max_new_tokens=8, thinking=False,
                                         pass_ks=(1, samples)),
                  metric=f'avg@{samples}', reported=reported)


@pytest.fixture(scope='session')
def toy():
  """The toy suite's maker, its records' maker and its grader class."""
  return types.SimpleNamespace(suite=toy_suite, records=records, ExactGrader=ExactGrader)


@pytest.fixture(scope='session')
def tiny_hf(tmp_path_factory):
  """A tiny HF checkpoint directory: the tiny Qwen3-like model (random weights) with a small
  byte-level BPE tokenizer carrying the chat markers, as `models.hf.save_model` writes it."""
  # pylint: disable=g-import-not-at-top
  import json as json_lib

  import tokenizers

  from foundation import chat
  from models import config as config_lib
  from models import hf
  from foundation import tokenizer as tokenizer_lib
  from models import transformer
  # pylint: enable=g-import-not-at-top
  d = tmp_path_factory.mktemp('tiny_hf')
  corpus = [chat.render([{'role': 'user', 'content': f'What is {a} + {a + 1}?'},
                         {'role': 'assistant', 'content': f'{2 * a + 1}. A GOOD answer.'}],
                        thinking=None) for a in range(60)]
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=list(chat.SPECIAL_TOKENS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  (d / 'tok').mkdir()
  bpe.save(str(d / 'tok' / 'tokenizer.json'))
  (d / 'tok' / 'tokenizer_config.json').write_text(json_lib.dumps({'bos_token': None}))
  tok = tokenizer_lib.load(d / 'tok')
  model = transformer.create(config_lib.ModelConfig.tiny(vocab_size=tok.vocab_size,
                                                         max_seq_len=512))
  hf.save_model(model, d / 'hf', tokenizer=tok)
  return d / 'hf'


@pytest.fixture(scope='session')
def hooked_python(tmp_path_factory):
  """A Python whose start-up runs cascade's lm-eval hook as an install leaves it: a venv (no pip)
  whose site-packages holds cascade-lm-eval.pth (`lm_eval_hook.PTH_LINE`, the line setup.py
  ships) and a path line to this interpreter's site-packages (lm-eval, jax, ...), processed
  after it as `site` sorts them. Run it with PYTHONPATH at the repository, so the hook and the
  backend imported are this tree's."""
  # pylint: disable=g-import-not-at-top
  import subprocess
  import sys
  import sysconfig

  from cascade import lm_eval_hook
  # pylint: enable=g-import-not-at-top
  d = tmp_path_factory.mktemp('hooked_venv')
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(d)], check=True,
                 capture_output=True, timeout=120)
  python = d / 'bin' / 'python'
  site_dir = subprocess.run([str(python), '-c', 'import sysconfig; print(sysconfig.get_paths()'
                             '["purelib"])'], check=True, capture_output=True, text=True,
                            timeout=60).stdout.strip()
  (pathlib.Path(site_dir) / lm_eval_hook.PTH_NAME).write_text(lm_eval_hook.PTH_LINE + '\n')
  (pathlib.Path(site_dir) / 'zz-parent.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
  return python
