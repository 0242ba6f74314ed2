"""Writes the lowered StableHLO text of the tiny models' programs, one file per program, for
comparing two trees of the code: a refactor that must not change what is traced runs this on
both and diffs the two folders (`diff -r`).

The programs: the SFT train step (two microbatches), the frozen log-probs pass, the one-call
sampler (scanned and unrolled decode, recording routing where the model has experts) and the
paged engine's prefill and decode calls, of `tiny`, `tiny_moe` and `tiny_hybrid`, on 8
simulated CPU devices with meshes of 3, 4 and 5 axes and logical rules that differ from
`models.sharding.DEFAULT_RULES` in every axis (so a site that used the defaults instead of the
rules it was given shows up in the text).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tools.program_texts --out=DIR
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding

from launch.plan import programs
from models import config as config_lib
from models import sharding
from rl import batch as batch_lib
from rl import sft
from rl import train_step as ts

# Every axis of DEFAULT_RULES moved: rows over fsdp before data, weights' embed over tensor, the
# heads and hidden widths over fsdp, the vocabulary whole.
RULES = sharding.override_rules(None, [
    ('batch', ('fsdp', 'data', 'expert')), ('embed', 'tensor'), ('vocab', None),
    ('mlp', 'fsdp'), ('heads', 'fsdp'), ('kv_heads', 'fsdp'), ('moe_mlp', 'fsdp'),
    ('mamba_heads', 'fsdp'), ('experts', ('expert', 'data')), ('cache_length', 'data')])

MESHES = {'tiny': (2, 2, 2), 'tiny_moe': (1, 2, 2, 2), 'tiny_hybrid': (1, 1, 2, 2, 2)}
ROWS, LENGTH = 8, 32


def _train_batch(mesh, rules) -> batch_lib.TrainBatch:
  """A packed SFT batch of ROWS x LENGTH tokens, split over the rows' rule."""
  rng = np.random.default_rng(0)
  seg = np.ones((ROWS, LENGTH), np.int32)
  tokens = rng.integers(3, 200, (ROWS, LENGTH)).astype(np.int32)
  batch = batch_lib.TrainBatch(tokens=tokens, positions=batch_lib.positions_from_segments(seg),
                               segment_ids=seg, targets=np.roll(tokens, -1, 1),
                               loss_mask=np.ones((ROWS, LENGTH), np.float32))
  rows = NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)


def _train_text(cfg, mesh, rules) -> str:
  graphdef, params = programs.abstract_params(cfg, 'policy', mesh, rules)
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=1e-3))
  state = jax.eval_shape(lambda p: ts.init_state(p, opt), params)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       state, ts.state_shardings(state, opt, mesh, rules))
  loss = ts.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
  step = ts.make_train_step(graphdef, loss, None, opt, mesh=mesh, rules=rules, state=state,
                            microbatches=2)
  return step.lower(state, _train_batch(mesh, rules)).as_text()


def _sampler_texts(cfg, mesh, rules):
  """(name, text) of each sampler program."""
  moe = cfg.mixers.count('moe') > 0
  runs = [('one_call', {'engine': 'one_call', 'decode_layers': 'scan'}, ('decode',)),
          ('one_call_unrolled', {'engine': 'one_call', 'decode_layers': 'unrolled'},
           ('decode',)),
          ('paged', {'engine': 'paged', 'page_size': 4, 'chunk_steps': 4,
                     'prefill_prompts': 4, 'decode_layers': 'scan'}, ('prefill', 'decode')),
          ('paged_unrolled', {'engine': 'paged', 'page_size': 4, 'chunk_steps': 4,
                              'prefill_prompts': 4, 'decode_layers': 'unrolled'},
           ('prefill', 'decode'))]
  for name, options, kinds in runs:
    for program in kinds:
      for record in ((False, True) if moe else (False,)):
        lower, _ = programs.sampler_lowering(cfg, mesh, rules, options, rows=ROWS,
                                             prompt_len=12, max_new_tokens=8, top_p=0.9,
                                             top_k=5, num_samples=2, program=program,
                                             record_routing=record)
        yield f'{name}_{program}{"_routing" if record else ""}', lower().as_text()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='folder to write one .txt per program')
  parser.add_argument('--families', default='tiny,tiny_moe,tiny_hybrid')
  args = parser.parse_args(argv)
  if len(jax.devices()) < 8:
    print('needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8', file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  for family in args.families.split(','):
    mesh = sharding.make_mesh(MESHES[family], jax.devices()[:8])
    for variant, kw in (('scan', dict(scan_layers=True, remat='full')),
                        ('loop', dict(scan_layers=False, remat='none'))):
      cfg = getattr(config_lib.ModelConfig, family)(**kw)
      texts = [('train', _train_text(cfg, mesh, RULES)),
               ('logprobs', programs.forward_lowering(cfg, 'policy', mesh, RULES, ROWS,
                                                      LENGTH)[0]().as_text())]
      texts += list(_sampler_texts(cfg, mesh, RULES))
      for name, text in texts:
        with open(os.path.join(args.out, f'{family}_{variant}_{name}.txt'), 'w') as f:
          f.write(text)
      print(family, variant, len(texts), 'programs', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
