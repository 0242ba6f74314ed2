"""The programs a plan lowers, from abstract inputs only: the policy's or reward model's params
as sharded ShapeDtypeStructs, the Sampler a run builds (`sampler_for`), and the lowerings of a
stage's train step, its sampler calls and the frozen models' scoring passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from cascade import kinds
from cascade import policies
from cascade.kinds import loop
from launch.plan import results
from models import sharding
from rl import batch as batch_lib
from rl import reward_model
from rl import sampler as sampler_lib


def _with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_params(model_cfg, model_kind: str, mesh, rules):
  """(graphdef, params as sharded ShapeDtypeStructs) of the policy or the reward model."""
  graphdef, params = policies.abstract_model(model_cfg, model_kind)
  return graphdef, _with_shardings(params, sharding.state_shardings(params, mesh, rules))


_SAMPLERS: dict = {}


def sampler_for(model_cfg, mesh, rules, sampler_cfg: dict, frozen: bool = False):
  """(the Sampler the plan lowers, the policy's abstract params as a stage hands them to it:
  the train state's, in the master dtype, in the training layout; `frozen`: a frozen model's
  (a judge's), in the model's own dtype).

  The Sampler turns them into its rollout copy (`rollout_cast`, `rollout_rules`) as a run's
  does, so the plan lowers the weights the run samples with. One Sampler per model, mesh and
  options (it traces its programs once to find the copy's dtypes).
  """
  try:
    key = (model_cfg, mesh, rules, tuple(sorted(sampler_cfg.items())), frozen)
    hash(key)
  except TypeError:
    key = None
  if key is not None and key in _SAMPLERS:
    return _SAMPLERS[key]
  got = _new_sampler(model_cfg, mesh, rules, sampler_cfg, frozen)
  if key is not None:
    if len(_SAMPLERS) > 16:
      _SAMPLERS.clear()
    _SAMPLERS[key] = got
  return got


def _new_sampler(model_cfg, mesh, rules, sampler_cfg: dict, frozen: bool = False):
  graphdef, params = abstract_params(model_cfg, 'policy', mesh, rules)
  master = None if frozen else policies.master_dtype(model_cfg)
  if master is not None:
    dt = jnp.dtype(master)
    params = jax.tree.map(
        lambda a: (jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding)
                   if jnp.issubdtype(a.dtype, jnp.floating) else a), params)
  return sampler_lib.Sampler(graphdef, model_cfg, eos_ids=(0,), pad_id=0, mesh=mesh,
                             rules=rules, **sampler_cfg), params


def sampler_lowering(model_cfg, mesh, rules, sampler_cfg: dict, *, rows: int, prompt_len: int,
                     max_new_tokens: int, top_p: float, top_k: int, num_samples: int = 1,
                     program: str = 'decode', frozen: bool = False,
                     record_routing: bool = False):
  """The sampler for one `Sampler.generate` call of these sizes, on `mesh` (`program`: the
  paged engine's 'decode' or 'prefill' call, see `Sampler.abstract_args`; `record_routing`:
  with its routing-replay buffers).

  Returns:
    (() -> Lowered, description of the shapes).
  """
  sampler, params = sampler_for(model_cfg, mesh, rules, sampler_cfg, frozen=frozen)
  sp = sampler_lib.SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k,
                                  max_new_tokens=max_new_tokens)
  _, _, what = sampler.abstract_args(params, rows, prompt_len, sp, num_samples, program,
                                     record_routing)
  if model_cfg.mamba_layers and sampler_cfg.get('engine', 'one_call') == 'one_call':
    what += '; ' + row_state_note(model_cfg, sampler, rows, prompt_len, max_new_tokens)
  return (lambda: sampler.lower(params, rows, prompt_len, sp, num_samples, program,
                                record_routing)), what


def row_state_note(model_cfg, sampler, rows: int, prompt_len: int, max_new_tokens: int) -> str:
  """What a one-call sampler chunk keeps per device for its rows: the attention sublayers'
  KV cache and the Mamba sublayers' state (which the Sampler charges each row in KV slots,
  `rl.sampler.state_slots`), e.g. 'per device 128 rows x (KV cache 108.00 MiB + Mamba state 46.79 MiB)'.
  """
  mesh, rules = sampler.mesh, sampler.rules
  p, nb, b = sampler.call_shape(rows, prompt_len, max_new_tokens)
  per_device = b // sharding.batch_shards(mesh, rules)
  kv = sampler_lib.kv_token_bytes(model_cfg, mesh, rules) * (p + nb)
  state = sampler_lib.row_state_bytes(model_cfg, mesh, rules)
  return (f'per device {per_device} rows x (KV cache {results.size_text(kv)} + Mamba state '
          f'{results.size_text(state)})')


def sampler_programs(sampler_cfg: dict) -> tuple[tuple[str, str], ...]:
  """(program, report name) of each call the configured sampler compiles."""
  programs = sampler_lib.PROGRAMS[sampler_cfg.get('engine', 'one_call')]
  return tuple((p, 'sampler' if p == 'decode' else f'sampler {p}') for p in programs)


def train_lowering(stage, model_cfg, mesh, rules, microbatches: int | None = None):
  """The stage's train step (as its runner builds it) for its largest batch, on `mesh`.

  Returns:
    (() -> Lowered, description of the batch).
  """
  kind = kinds.get(stage.kind)
  graphdef, params = abstract_params(model_cfg, stage.MODEL, mesh, rules)
  optimizer = kinds.base.make_optimizer(stage)
  state = policies.abstract_state(params, optimizer.tx, mesh, rules,
                                  policies.master_dtype(model_cfg))
  step = loop.build_train_step(kind, stage, graphdef, state, mesh, rules, optimizer,
                               microbatches=microbatches)
  batch, what = kind.abstract_batch(stage, mesh, rules)
  if not model_cfg.scans_layers:
    what += ', layers unrolled'
  packed = None if microbatches else getattr(stage, 'microbatch_rows', None)
  rows = packed or jax.tree.leaves(batch)[0].shape[0] // (microbatches or stage.microbatches)
  shards, split = sharding.batch_shards(mesh, rules), _split(rows, 'batch', mesh, rules)
  if split < shards:
    what += (f'; {rows} rows per microbatch over {shards} batch shards: each row on '
             f'{shards // split} devices')
  return (lambda: step.lower(state, batch)), what


def _split(n: int, name: str, mesh, rules) -> int:
  """How many ways a dimension of `n` along logical axis `name` splits over `mesh`."""
  return sharding.split_ways(n, name, mesh, rules)


def forward_rows(rows: int, mesh, rules) -> int:
  """A frozen pass's rows per call, rounded up to whole batch shards."""
  return -(-rows // sharding.batch_shards(mesh, rules)) * sharding.batch_shards(mesh, rules)


def forward_lowering(model_cfg, model_kind: str, mesh, rules, rows: int, length: int):
  """A frozen model's scoring pass (policy log-probs, or reward-model scores), on `mesh`.

  Returns:
    (() -> Lowered, description of the shapes).
  """
  graphdef, params = abstract_params(model_cfg, model_kind, mesh, rules)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, model_cfg.jnp_param_dtype
                                                       if jnp.issubdtype(a.dtype, jnp.floating)
                                                       else a.dtype, sharding=a.sharding), params)
  rows = forward_rows(rows, mesh, rules)
  row_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch', None), (rows, length), mesh,
                                                        rules))
  mat = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_sh)

  def lower():
    with sharding.use_mesh(mesh):
      if model_kind == 'reward_model':
        return reward_model.score.lower(graphdef, params, mat, mat,
                                        rules=sharding.as_rules(rules))
      logprobs = batch_lib._logprobs_jit  # pylint: disable=protected-access
      return logprobs.lower(graphdef, params, mat, mat, mat, mat, rules=sharding.as_rules(rules))
  return lower, f'{rows} rows x {length} tokens'
