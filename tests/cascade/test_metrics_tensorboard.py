"""TensorBoard a run writes (cascade.metrics.Writer with the run's plan): every metric also on a
run-wide step axis ('run/<metric>', the steps of earlier stages added, 'run/stage_index'), the
config and each stage's resolved config as text, and the update's model FLOP utilisation
('mfu') where config.hardware.peak_tflops is set, checked against Kaplan's 6N rule."""

import glob
import json
import struct

import jax
import numpy as np
import ml_collections
import pytest

from cascade import config as config_lib
from cascade import metrics
from configs import tiny


def _events(tmp_path):
  """(step, tag, value) of every scalar and (step, tag, text) of every text in the event files."""
  metrics._import_tensorboardx()  # pylint: disable=protected-access
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  scalars, texts = [], []
  for path in sorted(glob.glob(str(tmp_path / 'tb' / 'events.out.tfevents.*'))):
    data = open(path, 'rb').read()
    pos = 0
    while pos < len(data):                     # TFRecord: length, crc, payload, crc
      (n,) = struct.unpack('<Q', data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in ev.summary.value:
        if v.metadata.plugin_data.plugin_name == 'text':
          texts.append((ev.step, v.tag.removesuffix('/text_summary'),
                        v.tensor.string_val[0].decode('utf-8')))
        elif v.HasField('simple_value'):
          scalars.append((ev.step, v.tag, v.simple_value))
  return scalars, texts


@pytest.fixture(scope='module')
def plan():
  config = tiny.get_config('smoke,root=/nowhere')
  config.hardware = ml_collections.ConfigDict({'peak_tflops': 2.0})
  return config_lib.validate(config)


def test_steps_are_run_wide_and_stages_keep_their_own(plan, tmp_path):
  w = metrics.Writer(str(tmp_path), enabled=True, plan=plan)
  st = {s.name: s for s in plan.stages}
  sft, rlhf = st['sft'], st['rlhf']
  for step in (1, 2):
    w.write(sft, step, {'loss': 1.0 / step})
  w.write(rlhf, 1, {'loss': 0.25, 'reward_mean': 0.5})
  w.close()
  scalars, _ = _events(tmp_path)
  before = sum(s.steps for s in plan.stages[:rlhf.index] if hasattr(s, 'steps'))
  assert before == sft.steps + st['rm'].steps > sft.steps        # sft and rm come first
  got = {(tag, step): v for step, tag, v in scalars}
  assert got[('sft/loss', 2)] == 0.5 and got[('rlhf/loss', 1)] == 0.25   # stage steps as before
  assert got[('run/loss', 1)] == 1.0 and got[('run/loss', 2)] == 0.5
  assert got[('run/loss', before + 1)] == 0.25 and got[('run/reward_mean', before + 1)] == 0.5
  assert got[('run/stage_index', before + 1)] == rlhf.index and got[('run/stage_index', 2)] == 0
  assert w.run_step(rlhf, 1) == before + 1


def test_config_and_each_stages_resolved_config_are_text(plan, tmp_path):
  w = metrics.Writer(str(tmp_path), enabled=True, plan=plan)
  math_rl = next(s for s in plan.stages if s.name == 'math_rl')
  w.write(math_rl, 1, {'loss': 1.0})
  w.write(math_rl, 2, {'loss': 1.0})          # described once
  w.close()
  _, texts = _events(tmp_path)
  by_tag = {}
  for _, tag, text in texts:
    by_tag.setdefault(tag, []).append(json.loads('\n'.join(l[4:] for l in text.splitlines())))
  assert by_tag['config'] == [json.loads(json.dumps(plan.source, default=str))]
  [hp] = by_tag['math_rl/hparams']
  # Resolved: the fields the config left out are there with their defaults.
  assert hp['name'] == 'math_rl' and hp['group_size'] == math_rl.group_size
  assert hp['optimizer']['lr'] == math_rl.optimizer.lr and hp['optimizer']['name'] == 'adamw'


def test_mfu_is_the_updates_6n_flops_over_the_peak(plan, tmp_path):
  cfg = plan.model
  assert cfg.remat == 'none' and cfg.kv_stacked
  emb = cfg.vocab_size * cfg.embed_dim
  non_embedding = cfg.num_params() - emb * (1 if cfg.tie_embeddings else 2) - cfg.embed_dim
  six_n = 6 * non_embedding + 6 * emb          # forward + backward, the output head included
  peak = 2.0e12 * jax.device_count()
  w = metrics.Writer(str(tmp_path), enabled=True, plan=plan)
  sft = plan.stages[0]
  w.write(sft, 1, {'tokens_per_s': 1.0e6, 'loss': 1.0})
  w.write(sft, 2, {'loss': 1.0})               # no throughput: no mfu
  w.close()
  scalars, _ = _events(tmp_path)
  mfu = {step: v for step, tag, v in scalars if tag == 'sft/mfu'}
  assert list(mfu) == [1]
  assert mfu[1] == pytest.approx(1.0e6 * six_n / peak, rel=1e-6)   # float32 in the event file
  assert 0 < mfu[1] < 1
  lines = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert lines[0]['mfu'] == pytest.approx(1.0e6 * six_n / peak, rel=1e-12)
  assert 'mfu' not in lines[1]


def test_without_a_peak_or_a_plan_there_is_no_mfu(tmp_path):
  w = metrics.Writer(str(tmp_path), enabled=True)
  stage = type('S', (), {'name': 's', 'index': 3, 'kind': 'sft'})()
  w.write(stage, 4, {'tokens_per_s': 10.0})
  w.close()
  scalars, _ = _events(tmp_path)
  assert {tag for _, tag, _ in scalars} == {'s/tokens_per_s', 'run/tokens_per_s',
                                             'run/stage_index'}
  assert all(step == 4 for step, _, _ in scalars)       # no plan: no earlier stages to add


def test_event_records_are_framed_with_tensorboardxs_masked_crc32c():
  """The table form of TFRecord's masked CRC-32C equals tensorboardX's byte loop at every length
  up to the table's and past it (the byte loop itself), and the CRC-32C check value."""
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  limit = metrics.CRC_TABLE_BYTES
  for n in (0, 1, 2, 3, 8, 255, 1000, limit - 1, limit, limit + 1, 3 * limit):
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    assert metrics.masked_crc32c(data) == record_writer.masked_crc32c(data), n
  masked = metrics.masked_crc32c(b'123456789')
  rotated = (masked - 0xA282EAD8) & 0xFFFFFFFF                    # undo the mask's rotation
  assert ((rotated << 15) | (rotated >> 17)) & 0xFFFFFFFF == 0xE3069283   # CRC-32C's check value
