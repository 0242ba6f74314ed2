"""Checks the accelerator a run would use: what JAX finds, one train step, one sampler call.

  python -m cascade.device_check                     # a ~25M-parameter Qwen3-like shape
  python -m cascade.device_check --preset=tiny --mesh=-1,1,1 --seq=128

It prints the backend, every device (kind, memory where the backend reports
it), the attention implementation `attention='auto'` resolves to for the
check's prefill and training shapes on this platform, then runs on a mesh
over all devices: one GRPO train step (fresh weights, random rollouts) and
one sampler call of the same model, and checks what can be checked without
a reference: finite loss and gradient norm, the step moved the weights, the
sampler's log-probs equal a training forward's on its own samples (the
on-policy property every RL stage relies on). The last line is JSON. Exit
status 1 and one line naming the failed check otherwise.

Run it once on a new machine (a GPU node after `pip install -e .[cuda]`, a
TPU VM after `pip install "jax[tpu]"`) before a long run.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cascade import exits
from cascade import overrides
from models import attention
from models import config as config_lib
from models import sharding
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import sampler as sampler_lib
from rl import train_step as train_lib

_PRESET = flags.DEFINE_string('preset', 'check', "'check' (a ~25M-parameter Qwen3-like "
                              "shape) or a models.config preset ('tiny', 'qwen3_0_6b', ...).")
_MESH = flags.DEFINE_list('mesh', ['1', '-1', '1'], '(data, fsdp, tensor); -1 = the rest.')
_ROWS = flags.DEFINE_integer('rows', 8, 'Rollout rows (prompts x G, G = 2).')
_PROMPT = flags.DEFINE_integer('prompt_len', 32, 'Prompt tokens.')
_SEQ = flags.DEFINE_integer('seq', 256, 'New tokens per sampled row (and the train rows).')

# Log-prob agreement between the sampler and a training forward. float32 on
# CPU agrees to ~1e-5; bf16 matmuls on accelerators to ~1e-2.
_TOLERANCE = {'float32': 1e-3, 'bfloat16': 5e-2}


class CheckError(Exception):
  """A failed check, as one line."""


def model_config(preset: str, max_seq_len: int) -> config_lib.ModelConfig:
  if preset == 'check':
    return config_lib.ModelConfig.tiny(
        vocab_size=8192, embed_dim=512, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=64, mlp_dim=1536, max_seq_len=max_seq_len)
  return config_lib.ModelConfig.preset(preset, max_seq_len=max_seq_len)


def devices_report() -> dict:
  out = []
  for d in jax.devices():
    entry = {'id': d.id, 'kind': d.device_kind, 'platform': d.platform,
             'process': d.process_index}
    try:
      stats = d.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
      stats = {}
    if 'bytes_limit' in stats:
      entry['memory_gib'] = round(stats['bytes_limit'] / 2 ** 30, 1)
    out.append(entry)
  return {'backend': jax.default_backend(), 'jax': jax.__version__,
          'process_count': jax.process_count(), 'devices': out}


def run_check(preset: str, mesh_shape, rows: int, prompt_len: int, seq: int) -> dict:
  """Runs the train step and the sampler call; raises CheckError naming a failed check."""
  cfg = model_config(preset, prompt_len + seq)
  shape = tuple(int(x) for x in mesh_shape)
  # A shape without -1 may use the first devices only (e.g. one chip of many).
  devices = None if -1 in shape else jax.devices()[:int(np.prod(shape))]
  mesh = sharding.make_mesh(shape, devices=devices)
  rules = sharding.DEFAULT_RULES
  shards = sharding.batch_shards(mesh, rules)
  rows = -(-rows // max(shards, 2)) * max(shards, 2)
  report = {'model': preset, 'params': cfg.num_params(), 'dtype': cfg.dtype,
            'mesh': dict(zip(mesh.axis_names, mesh.devices.shape)),
            'attention': {
                'prefill': attention.resolve(cfg.attention, prompt_len, prompt_len + seq,
                                             self_attention=False),
                'train': attention.resolve(cfg.attention, prompt_len + seq, prompt_len + seq,
                                           self_attention=True)}}
  model = sharding.create_sharded(lambda: transformer.create(cfg, seed=0), mesh, rules)
  graphdef, params = nnx.split(model)

  # One sampler call.
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(rows // 2)]
  samp = sampler_lib.Sampler(graphdef, cfg, eos_ids=(), pad_id=0, mesh=mesh, rules=rules,
                             prompt_buckets=(prompt_len,), new_token_buckets=(seq,))
  sp = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=seq)
  t0 = time.perf_counter()
  out = samp.generate(params, prompts, jax.random.key(0), sp, num_samples=2)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = samp.generate(params, prompts, jax.random.key(1), sp, num_samples=2)
  run = time.perf_counter() - t0
  report['sampler'] = {'rows': rows, 'new_tokens': seq, 'compile_and_run_s': round(first, 2),
                       'run_s': round(run, 3), 'tokens_per_s': round(rows * seq / run, 1)}
  if not np.all(out.lengths == seq):
    raise CheckError(f'sampler: rows stopped early without a stop token: {out.lengths}')

  # Training forward on the sampler's own rows: the same log-probs (on-policy).
  rewards = rng.standard_normal(rows).astype(np.float32)
  batch = batch_lib.from_samples(out, grpo.advantages(rewards, 2))
  logp = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch, mesh, rules))
  m = np.asarray(batch.loss_mask) > 0
  gap = float(np.max(np.abs(logp[m] - np.asarray(batch.old_logprobs)[m])))
  report['sampler']['logprob_gap_vs_training_forward'] = gap
  if not gap <= _TOLERANCE.get(cfg.dtype, 5e-2):
    raise CheckError(f'sampler log-probs differ from a training forward by {gap:.3g}')

  # One GRPO train step.
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-3, clip_norm=1.0))
  state = train_lib.init_state(params, opt, seed=0, mesh=mesh, rules=rules)
  before = np.asarray(jax.tree.leaves(state.params)[0]).copy()
  loss = train_lib.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  step = train_lib.make_train_step(graphdef, loss, grpo.GrpoConfig(), opt, mesh=mesh,
                                   rules=rules, state=state)
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  loss, gnorm = float(metrics['loss']), float(metrics['grad_norm'])
  report['train_step'] = {'rows': rows, 'tokens_per_row': prompt_len + seq,
                          'compile_and_run_s': round(time.perf_counter() - t0, 2),
                          'loss': loss, 'grad_norm': gnorm}
  if not (np.isfinite(loss) and np.isfinite(gnorm) and gnorm > 0):
    raise CheckError(f'train step: loss={loss}, grad_norm={gnorm}')
  if np.array_equal(np.asarray(jax.tree.leaves(state.params)[0]), before):
    raise CheckError('train step: the update left the weights unchanged')
  return report


def main(argv):
  del argv
  exits.quiet_library_logs()     # its report and one error line, no JAX backend probing
  report = devices_report()
  print(f"backend {report['backend']} (jax {report['jax']}), {len(report['devices'])} "
        f"device(s) over {report['process_count']} process(es):")
  for d in report['devices']:
    mem = f", {d['memory_gib']} GiB" if 'memory_gib' in d else ''
    print(f"  {d['id']}: {d['kind']} ({d['platform']}{mem})")
  try:
    report.update(run_check(_PRESET.value, _MESH.value, _ROWS.value, _PROMPT.value, _SEQ.value))
  except CheckError as e:
    print(f'device check FAILED: {e}', file=sys.stderr)
    sys.exit(1)
  print(f"attention: prefill {report['attention']['prefill']}, "
        f"training {report['attention']['train']}")
  s, t = report['sampler'], report['train_step']
  print(f"sampler: {s['rows']} rows x {s['new_tokens']} tokens in {s['run_s']} s "
        f"({s['tokens_per_s']} tokens/s), log-probs within "
        f"{s['logprob_gap_vs_training_forward']:.2g} of a training forward")
  print(f"train step: {t['rows']} rows x {t['tokens_per_row']} tokens, loss {t['loss']:.4f}, "
        f"grad norm {t['grad_norm']:.3g} (first call {t['compile_and_run_s']} s)")
  print('device check passed')
  print(json.dumps(report))


if __name__ == '__main__':
  app.run(main, flags_parser=overrides.plain_flags_parser)
