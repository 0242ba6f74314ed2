"""Weights & Biases beside TensorBoard (config.logging.wandb, `cascade.metrics._WandbRun`): every
scalar and text under the same tags and steps, each tag family on its own step axis; and
docs/metrics.md names every tag a run writes.

The default tests drive the metrics writer with a stand-in `wandb` module (no W&B process);
the heavy one runs the toy cascade with the real library in offline mode (WANDB_MODE=offline)
and reads back the run file W&B wrote."""

import glob
import importlib.util
import json
import os
import re
import struct
import sys
import types

import ml_collections
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import metrics
from configs import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tb_events(workdir):
  """(tag, step, value) of every scalar, and (tag, step) of every text, in the event files."""
  metrics._import_tensorboardx()  # pylint: disable=protected-access
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  scalars, texts = set(), set()
  for path in sorted(glob.glob(os.path.join(workdir, 'tb', 'events.out.tfevents.*'))):
    data, pos = open(path, 'rb').read(), 0
    while pos < len(data):                     # TFRecord: length, crc, payload, crc
      (n,) = struct.unpack('<Q', data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in ev.summary.value:
        if v.metadata.plugin_data.plugin_name == 'text':
          texts.add((v.tag.removesuffix('/text_summary'), ev.step))
        elif v.HasField('simple_value'):
          scalars.add((v.tag, ev.step, v.simple_value))
  return scalars, texts


def by_axis(rows):
  """(tag, step, value) of every scalar in W&B history rows, each at its '<first part>/step',
  and (tag, step) of every text (W&B files a logged HTML text as '<tag>/_type', '<tag>/path'
  and so on; the stand-in below keeps the object as the value)."""
  scalars, texts = set(), set()
  step_of = lambda row, tag: row[f'{tag.partition("/")[0]}/step'] if '/' in tag else 0
  for row in rows:
    media = {k[:-len('/_type')] for k in row if k.endswith('/_type')}
    for tag, value in row.items():
      if (tag.startswith('_') or tag.endswith('/step')
          or any(tag.startswith(m + '/') for m in media)):
        continue
      if isinstance(value, (int, float)):
        scalars.add((tag, step_of(row, tag), float(np.float32(value))))   # TensorBoard: float32
      else:
        texts.add((tag, step_of(row, tag)))
    texts |= {(m, step_of(row, m)) for m in media}
  return scalars, texts


class _FakeWandb(types.ModuleType):
  """The part of the `wandb` module a run uses, recording what it is given."""

  def __init__(self):
    super().__init__('wandb')
    self.inits, self.rows, self.defined, self.finished = [], [], [], []

  def Settings(self, **kw):  # pylint: disable=invalid-name
    return kw

  def Html(self, data, inject=True):  # pylint: disable=invalid-name
    return ('html', data, inject)

  def init(self, **kw):
    self.inits.append(kw)
    fake = self
    return types.SimpleNamespace(
        log=lambda row: fake.rows.append(dict(row)),
        define_metric=lambda name, **kw: fake.defined.append((name, kw)),
        finish=lambda exit_code=0: fake.finished.append(exit_code))


@pytest.fixture
def fake_wandb(monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, 'wandb', fake)
  return fake


def _plan(**logging):
  config = tiny.get_config('smoke,root=/nowhere')
  config.logging = ml_collections.ConfigDict(logging)
  return config_lib.validate(config)


def test_wandb_gets_every_scalar_and_text_tensorboard_gets_at_the_same_steps(fake_wandb, tmp_path):
  plan = _plan(wandb='cascade-tests')
  st = {s.name: s for s in plan.stages}
  w = metrics.Writer(str(tmp_path), enabled=True, plan=plan)
  for step in (1, 2):
    w.write(st['sft'], step, {'loss': 1.0 / step, 'accuracy': 0.5})
  w.write_scores('sft', 0, {'math': 12.5, 'code': 0.0}, {'math': 10.0})
  w.write(st['rlhf'], 1, {'reward_mean': 0.25, 'reward_mean/chat': 0.25, 'not_a_number': 'x'})
  w.write_samples(st['rlhf'], 1, [{'prompt': 'p', 'completion': '</pre><script>x</script>',
                                   'reward': 1.0, 'info': {}}])
  w.close()
  assert tb_events(str(tmp_path)) == by_axis(fake_wandb.rows)
  [init] = fake_wandb.inits
  assert init['project'] == 'cascade-tests' and init['resume'] == 'allow'
  assert init['dir'] == str(tmp_path) and init['name'] == tmp_path.name
  assert init['config'] == dict(plan.source) and init['settings']['console'] == 'off'
  # Each tag family has its step axis: the stage's own, the run-wide one, the matrix rows'.
  assert ('run/*', {'step_metric': 'run/step'}) in fake_wandb.defined
  assert ('eval/*', {'step_metric': 'eval/step'}) in fake_wandb.defined
  assert ('sft/step', {'hidden': True}) in fake_wandb.defined
  # Model output in a text is escaped: it cannot end the <pre> or add HTML.
  [sample] = [r['rlhf/samples'] for r in fake_wandb.rows if 'rlhf/samples' in r]
  assert '<script>' not in sample[1] and '&lt;/pre&gt;&lt;script&gt;' in sample[1]
  assert fake_wandb.finished == [0]
  # The same workdir and config is the same W&B run (a rerun resumes it); another workdir is not.
  w = metrics.Writer(str(tmp_path), enabled=True, plan=plan)
  w.close(discard=True)
  other = metrics.Writer(str(tmp_path / 'other'), enabled=True, plan=plan)
  other.close()
  ids = [i['id'] for i in fake_wandb.inits]
  assert ids[0] == ids[1] != ids[2] and fake_wandb.finished == [0, 1, 0]


def test_wandb_is_off_by_default_and_its_project_is_checked(fake_wandb, tmp_path, monkeypatch):
  w = metrics.Writer(str(tmp_path), enabled=True, plan=_plan())
  w.write(_plan().stages[0], 1, {'loss': 1.0})
  w.close()
  assert not fake_wandb.inits and not fake_wandb.rows
  with pytest.raises(config_lib.ConfigError, match=r"^config\.logging\.wandb='a b': must be a "
                                                   r'W&B project name'):
    _plan(wandb='a b')
  with pytest.raises(config_lib.ConfigError, match=r'^config\.logging\.wandbb: unknown field '
                                                   r'\(nearest: wandb\)'):
    _plan(wandbb='x')
  monkeypatch.setitem(sys.modules, 'wandb', None)           # not installed
  with pytest.raises(config_lib.ConfigError, match=r"^config\.logging\.wandb='p': the wandb "
                                                   r'package is not installed'):
    metrics.Writer(str(tmp_path / 'w'), enabled=True, plan=_plan(wandb='p'))


def test_the_wandb_project_is_left_out_of_the_config_hash():
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  assert (checkpoint.config_hash(_plan(wandb='p').source)
          == checkpoint.config_hash(_plan().source))


# ------------------------------------------------------------------ a run, with the real library

def wandb_rows(workdir):
  """The history rows of the W&B run file under `workdir`/wandb (offline mode).

  The file is W&B's transaction log: a 7-byte header, then records in 32 KiB blocks, each
  chunk a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last) and its
  bytes, a block's tail shorter than a header left as padding; every record is a `Record`
  protocol buffer (wandb.proto.wandb_internal_pb2).
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  [path] = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*', 'run-*.wandb'))
  data, pos, parts, rows = open(path, 'rb').read(), 7, b'', []
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:
      pos += 32768 - pos % 32768
      continue
    _, n, kind = struct.unpack('<IHB', data[pos:pos + 7])
    chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
    if not kind:
      break
    parts = chunk if kind in (1, 2) else parts + chunk
    if kind in (1, 4):
      rec = wandb_internal_pb2.Record.FromString(parts)
      if rec.WhichOneof('record_type') == 'history':
        rows.append({i.key or '/'.join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item})
  return rows


def documented(tag: str, stages, domains) -> str:
  """How docs/metrics.md names a tag: '<stage>/<metric>' and 'run/<metric>' by the metric (with
  domains as <domain>), the other families as '<family>/<domain>', texts as themselves."""
  parts = tag.split('/')
  if parts[0] in stages and parts[1:] in (['hparams'], ['samples']):
    return f'<stage>/{parts[1]}'
  if parts[0] in stages or (parts[0] == 'run' and tag != 'run/stage_index'):
    parts = parts[1:]
  return '/'.join('<domain>' if p in domains else p for p in parts)


@pytest.mark.heavy
def test_a_run_logs_the_same_scalars_to_wandb_offline_and_tensorboard(tmp_path, copy_cascade,
                                                                      derived_config, monkeypatch):
  """The toy cascade (SFT, GRPO, evaluations) with config.logging.wandb and WANDB_MODE=offline:
  the W&B run file holds exactly the scalars of the event files, at the same steps, and
  docs/metrics.md names every tag the run wrote."""
  pytest.importorskip('wandb')
  from cascade import runner  # pylint: disable=g-import-not-at-top
  copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=3, rl_steps=2)
  (tmp_path / 'logged.py').write_text(derived_config(
      "  c.logging = dict(wandb='cascade-tests')\n  c.eval.log_samples = 2\n"))
  spec = importlib.util.spec_from_file_location('logged', tmp_path / 'logged.py')
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  work = str(tmp_path / 'run')
  runner.run(mod.get_config(), work)
  tb_scalars, tb_texts = tb_events(work)
  wb_scalars, wb_texts = by_axis(wandb_rows(work))
  assert tb_scalars and tb_scalars == wb_scalars
  assert tb_texts == wb_texts
  tags = {t for t, *_ in tb_scalars} | {t for t, _ in tb_texts}
  assert {'sft/loss', 'copy_rl/reward_mean', 'run/loss', 'eval/copy', 'copy_rl/samples',
          'config'} <= tags
  page = open(os.path.join(REPO, 'docs', 'metrics.md'), encoding='utf-8').read()
  named = set(re.findall(r'`([^`]+)`', page))
  missing = sorted({documented(t, ('sft', 'copy_rl'), ('copy',)) for t in tags} - named)
  assert not missing, f'docs/metrics.md does not name {missing}'
