"""Per-device bytes beside the compiled programs: abstract trees and params, the sampler's
rollout copy, a loaded judge, and what stays resident beside each program of a stage
(`resident`: its co-resident peak is its own total plus that)."""

from __future__ import annotations

import jax
import numpy as np

from cascade import kinds
from cascade import policies
from launch.plan import judges as judges_lib
from launch.plan import programs as programs_lib


def rollout_copy_bytes(sampler, params) -> int:
  """Per-device bytes of the sampler's own copy of the weights while it runs (0: it samples
  with the train state's params as they are)."""
  rolled = sampler.rollout_params(params)
  return 0 if rolled is params else tree_bytes(rolled)


def tree_bytes(tree) -> int:
  """Per-device bytes of a pytree of sharded ShapeDtypeStructs."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * x.dtype.itemsize
  return total


def params_bytes(model_cfg, model_kind, mesh, rules, dtype=None) -> int:
  _, params = programs_lib.abstract_params(model_cfg, model_kind, mesh, rules)
  if dtype is not None:
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding),
                          params)
  return tree_bytes(params)


def resident(stage, model_cfg, mesh, rules, programs, frozen, rm_stages,
             rollout_copy: bool = False, judges=(), loaded=None, sampler_cfg=None,
             copy_bytes: int = 0):
  """Per program: what stays in device memory beside it without being its argument.

  Loaded judges (`loaded`) stay beside every program. A judge's own program runs while the
  stage collects: beside it the whole train state, the policy's rollout copy
  (`copy_bytes`), and with `stream_filter` the policy sampler's arguments (its engine's
  pools: scoring overlaps decoding).
  """
  if stage.MODEL is None:
    return ()
  held = {src: judge_bytes(cfg, gen, mesh, rules, sampler_cfg or {}, model_cfg)
          for src, (cfg, gen) in (loaded or {}).items()}
  judge_total = sum(a + b for a, b in held.values())
  by_name = {}
  for jc in judges:
    params, jcopy = held.get(jc.source) or judge_bytes(
        jc.model_cfg, jc.use.score_by == 'generate', mesh, rules, sampler_cfg or {}, model_cfg)
    passed = jcopy if (jc.use.score_by == 'generate' and jcopy) else params
    by_name[jc.domain] = passed if jc.source in held else 0
  decoding = (max((p.argument_bytes for p in programs if p.name.startswith('sampler')),
                  default=0) if getattr(stage, 'stream_filter', False) else 0)
  optimizer = kinds.base.make_optimizer(stage).tx
  _, params = programs_lib.abstract_params(model_cfg, stage.MODEL, mesh, rules)
  state = tree_bytes(policies.abstract_state(params, optimizer, mesh, rules,
                                             policies.master_dtype(model_cfg)))
  master = policies.master_dtype(model_cfg)
  policy_params = params_bytes(model_cfg, 'policy', mesh, rules, master and np.float32)
  # The policy sampler's arguments hold the params it samples with, already counted: its
  # rollout copy (copy_bytes) or else the train state's own params.
  decoding = max(0, decoding - (copy_bytes or policy_params)) if decoding else 0
  # Frozen copies kept in host memory are on the devices only as their own pass's arguments.
  one_copy = params_bytes(model_cfg, 'policy', mesh, rules)
  frozen_bytes = sum(ff.copies for ff in frozen if not ff.on_host) * one_copy
  on_device = {ff.name: not ff.on_host for ff in frozen}
  rm_bytes = len(rm_stages) * params_bytes(model_cfg, 'reward_model', mesh, rules)
  out = []
  for p in programs:
    if p.name.startswith('judge'):
      domain = p.name[p.name.rindex('(') + 1:-1]
      extra = (state + frozen_bytes + rm_bytes + judge_total - by_name.get(domain, 0) + copy_bytes
               + decoding)
      out.append((p.name, extra))
      continue
    if p.name == 'train step':
      extra = frozen_bytes + rm_bytes
    elif p.name.startswith('sampler'):   # the state, minus the params it is given unless it
                                          # samples with its own copy (cast or resharded)
      extra = (state if rollout_copy else state - policy_params) + frozen_bytes + rm_bytes
    elif p.name.startswith('reward model scoring'):
      extra = state + frozen_bytes + rm_bytes - rm_bytes // max(1, len(rm_stages))
    else:                                         # a frozen forward: its params are arguments
      extra = state + rm_bytes + frozen_bytes - (one_copy if on_device.get(p.name) else 0)
    out.append((p.name, extra + judge_total))
  return tuple(out)


def judge_bytes(judge_cfg, generates: bool, mesh, rules, sampler_cfg: dict,
                policy_cfg=None) -> tuple[int, int]:
  """(per-device bytes of a loaded judge's params, of its rollout copy, made once when it
  generates; 0 when it samples with its params as they are)."""
  params = params_bytes(judge_cfg, 'policy', mesh, rules)
  if not generates:
    return params, 0
  sampler, given = programs_lib.sampler_for(
      judge_cfg, mesh, rules,
      judges_lib.judge_sampler_options(sampler_cfg, judge_cfg, policy_cfg, mesh, rules),
      frozen=True)
  return params, rollout_copy_bytes(sampler, given)
