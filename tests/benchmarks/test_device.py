"""benchmarks.device: its byte and FLOP counts against hand counts, and --small end to end."""

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from models import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The CPU backend even on an accelerator host: --small is the CPU check, and a device run of the
# refusal test would write the device page.
CPU_ENV = dict(os.environ, JAX_PLATFORMS='cpu')


@pytest.fixture(scope='module')
def device():
  """The module, imported by the test that uses it (its absl flags: tests/conftest.py)."""
  from benchmarks import device as device_lib  # pylint: disable=g-import-not-at-top
  return device_lib


# ModelConfig.tiny in bf16: vocab 256, embed 64, 2 layers, 4 heads over 2 kv heads of 16, MLP 128,
# q/k norms, tied embeddings.
TINY = config_lib.ModelConfig.tiny(dtype='bfloat16')
# Parameters by hand: the embedding 256 x 64; per layer q 64x64, k and v 64x32, o 64x64, the
# q and k norms (16 each), the MLP 3 x 64 x 128 and two RMSNorms of 64; the final norm.
TINY_PARAMS = 256 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 2 * 16 + 3 * 64 * 128 + 2 * 64) + 64
# A cached token: K and V (2) of 2 kv heads x 16 in 2 attention layers, 2 bytes each (bf16).
TINY_KV_TOKEN = 2 * 2 * 16 * 2 * 2


def test_decode_step_bytes_is_the_bf16_weights_plus_the_attended_kv(device):
  assert TINY_PARAMS == 90_496
  assert device.decode_step_bytes(TINY, rows=4, keys=20) == 2 * 90_496 + 4 * 20 * 256
  assert TINY_KV_TOKEN == 256
  # A float32 model's cache holds 4 bytes per value; the weights still count as bf16 copies.
  f32 = TINY.replace(dtype='float32')
  assert device.decode_step_bytes(f32, rows=1, keys=10) == 2 * 90_496 + 10 * 512


def test_decode_bytes_sums_the_steps_after_the_prefill(device):
  # Prompt 2, 3 new tokens: the prefill gives the first, steps 1 and 2 attend 3 and 4 keys.
  assert device.decode_bytes(TINY, rows=1, prompt=2, new=3) == 2 * (2 * 90_496) + 7 * 256
  assert device.decode_bytes(TINY, rows=5, prompt=2, new=1) == 0


def test_model_flops_leave_the_remat_recompute_out(device):
  rows, length = 2, 256
  tokens, context = rows * length, (length + 1) / 2
  blocks = TINY_PARAMS - 256 * 64 - 64           # the sublayers' parameters
  forward = tokens * (2 * blocks + 2 * 4 * 4 * 16 * context + 2 * 256 * 64)
  for remat in ('none', 'full'):
    got = device.model_flops(TINY.replace(remat=remat), rows, length)
    assert got == pytest.approx(3 * forward, rel=1e-12)


def test_attention_impls_per_backend(device):
  assert device.attention_impls('cpu') == ('blockwise', 'dense')
  assert device.attention_impls('gpu') == ('blockwise', 'dense', 'gpu_flash')
  assert device.attention_impls('tpu') == ('blockwise', 'dense', 'splash')


def test_train_config_runs_bf16_off_the_cpu_and_keeps_tiles_within_the_row(device):
  small = device.shapes(small=True)
  cpu, gpu = (device.train_config(small, 'blockwise', b) for b in ('cpu', 'gpu'))
  assert (cpu.dtype, gpu.dtype) == ('float32', 'bfloat16')
  assert small.train_len % cpu.attention_block_q == 0 and cpu.remat == 'full'
  full = device.shapes(small=False)
  assert full.decode_cfg.num_params() == config_lib.ModelConfig.qwen3_0_6b().num_params()
  assert (full.train_rows, full.train_len) == (8, 4096)
  assert device.train_config(full, 'dense', 'gpu').max_seq_len >= 4096


def test_sft_batch_targets_are_the_next_tokens(device):
  b = device.sft_batch(2, 8, 50)
  np.testing.assert_array_equal(b.targets[:, :-1], b.tokens[:, 1:])
  np.testing.assert_array_equal(b.loss_mask[:, -1], 0)
  assert b.loss_mask[:, :-1].all() and b.tokens.max() < 50


def _table(page: str, heading: str) -> list[list[str]]:
  """The body rows of the first table under `## heading`, as lists of cells."""
  part = page.split(f'## {heading}\n', 1)[1].split('\n## ', 1)[0]
  rows = [line.strip('|').split('|') for line in part.splitlines() if line.startswith('|')]
  return [[c.strip() for c in r] for r in rows[2:]]


def _number(cell: str) -> float:
  x = float(cell.split()[0])
  assert math.isfinite(x), cell
  return x


@pytest.mark.heavy   # two engines and two train steps compiled: ~25-60 s on two cores
def test_small_run_writes_every_part_with_finite_positive_numbers(tmp_path, device):
  report = tmp_path / 'device.md'
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.device', '--small',
                         f'--report={report}'], cwd=ROOT, env=CPU_ENV, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  page = report.read_text()
  assert page.startswith('# Device benchmark') and 'load average' in page
  machine = {r[0]: _number(r[1]) for r in _table(page, 'Machine')}
  assert set(machine) >= {'bfloat16 matmul peak', 'memory read bandwidth'}
  assert all(v > 0 for v in machine.values())
  decode = {r[0]: [_number(c) for c in r[1:]] for r in _table(page, 'Decode')}
  assert set(decode) == {'one_call', 'paged'}
  for seconds, tok_s, mb_step, gb_s, roofline in decode.values():
    assert min(seconds, tok_s, mb_step, gb_s) > 0 and 0 < roofline <= 1.5
    assert tok_s == pytest.approx(4 * 32 / seconds, rel=0.01)      # 4 rows x 32 new tokens
  # The step's bytes at the mean context (16 + 16 keys), in MB as the page rounds them.
  assert decode['paged'][2] == pytest.approx(
      device.decode_step_bytes(TINY, 4, 32) / 1e6, abs=5e-4)
  train = {r[0]: r[1:] for r in _table(page, 'Train step')}
  assert set(train) == {'blockwise', 'dense'}
  for dtype, *cells in train.values():
    assert dtype == 'float32'                                       # a CPU run (train_config)
    seconds, compile_s, tok_s, tflop, mfu = map(_number, cells)
    assert min(seconds, compile_s, tok_s, tflop) > 0 and 0 < mfu <= 1.5
  gaps = {r[0]: r[1:] for r in _table(page, 'Sampler/trainer log-prob gap (bf16)')}
  assert set(gaps) == {'one_call', 'paged'}
  for tokens, max_abs, mean_abs in gaps.values():
    # Every generated token scored; an exact bf16 match is possible in principle, so >= 0.
    assert int(tokens) == 4 * 32 and 0 <= _number(mean_abs) <= _number(max_abs) < 1


@pytest.mark.heavy   # a subprocess importing jax: a few seconds
def test_a_cpu_run_refuses_to_write_the_device_page(device):
  page = ROOT / device.DEVICE_PAGE
  before = page.read_bytes() if page.exists() else None
  proc = subprocess.run([sys.executable, '-m', 'benchmarks.device', '--small',
                         f'--report={device.DEVICE_PAGE}'], cwd=ROOT, env=CPU_ENV,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and 'holds accelerator numbers' in proc.stderr
  assert (page.read_bytes() if page.exists() else None) == before


def test_imports_beside_another_absl_program():
  """benchmarks.device defines its flags only as the program: imported in one process with
  launch.plan (whose --report it shares a name with), as a test worker does, nothing clashes."""
  proc = subprocess.run(
      [sys.executable, '-c', 'import launch.plan.cli, benchmarks.device; '
       'import benchmarks.device as d; assert d._REPORT is None'],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 0, proc.stderr[-2000:]
