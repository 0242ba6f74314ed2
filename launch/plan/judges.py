"""Judge models: which ones a stage's or the evaluation's verifiers call (`judge_calls`), which
stay loaded while a stage runs (`loaded_judges`), and the programs compiled for them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from cascade import kinds
from launch.plan import compiler
from launch.plan import flops as flops_lib
from launch.plan import programs as programs_lib
from models import sharding
from rl import judge as judge_lib


@dataclasses.dataclass(frozen=True)
class JudgeCall:
  """A judge model one domain's verifier calls (`Verifier.judge_use`), as the plan counts it.

  Attributes:
    source: ('hf', path) or ('stage', name), as `cascade.verifier_set` names it.
    where: the config field naming it.
    domain: the domain it scores.
    model_cfg: the judge's ModelConfig as the run loads it (an HF judge: its config.json;
      a stage's: the policy's, in the model's dtype).
    use: how the verifier calls it (`verifiers.base.JudgeUse`).
    rows: judge rows of one scoring call (the samples scored x rows_per_sample).
  """
  source: tuple
  where: str
  domain: str
  model_cfg: Any
  use: Any
  rows: int


def _judge_model_cfg(plan, source: tuple, where: str):
  """The judge's ModelConfig, read from its config.json (an HF judge) without its weights."""
  import json  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  from foundation import paths  # pylint: disable=g-import-not-at-top
  if source[0] == 'stage':
    return plan.model
  path = paths.join(source[1], 'config.json')
  try:
    return hf.config_from_hf(json.loads(paths.read_text(path)))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{where}={source[1]!r}: launch.plan reads the judge's architecture from "
                     f'{path}: {type(e).__name__}: {e}') from None


def _judge_uses(plan, domains, field: str, group_size, samples: int, model_for):
  """JudgeCalls of `domains`' verifiers (field 'verifier_options' or 'eval_verifier_options')."""
  import verifiers  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  vs = verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=None)
  out = []
  for d in domains:
    dom = plan.domains[d]
    if dom.agentic:
      continue
    name = dom.verifier if field == 'verifier_options' else dom.eval_verifier
    opts = dict(getattr(dom, field))
    source = vs.judge_source(d, field, opts)
    if source is None:
      continue
    use = verifiers.cls(name).judge_use(opts, group_size)
    if use is None:
      continue
    where = f'config.domains.{d}.{field}.{verifiers.cls(name).judge_option}'
    out.append(JudgeCall(source, where, d, model_for(_judge_model_cfg(plan, source, where)),
                         use, samples * use.rows_per_sample))
  return out


def judge_calls(plan, stage, model_for=lambda cfg: cfg) -> list:
  """The judges a sampling stage's training verifiers call, one JudgeCall per domain; every
  sample of the stage's largest round is scored (`sampler_sizes`' rows)."""
  kind = kinds.get(stage.kind)
  if not stage.SAMPLES or kind.sampler_sizes is None:
    return []
  sizes = kind.sampler_sizes(stage)
  return _judge_uses(plan, stage.domains, 'verifier_options', sizes.get('num_samples', 1),
                     sizes['rows'], model_for)


def eval_judge_calls(plan, model_for=lambda cfg: cfg) -> list:
  """The judges the evaluation's verifiers call (each domain's batch of samples at once)."""
  out = []
  settings = dict(plan.eval_settings or {})
  for d in plan.domains:
    ev = settings.get(d, plan.eval)
    n = 1 if ev.greedy else ev.num_samples
    out += _judge_uses(plan, [d], 'eval_verifier_options', n, ev.batch_size * n, model_for)
  return out


def loaded_judges(plan, index: int, model_for=lambda cfg: cfg) -> dict:
  """{source: (ModelConfig, whether it generates)} of the judges resident while stage `index`
  runs (index None: during the last evaluation). The run loads a judge at its first use and
  keeps it (`cascade.verifier_set`): a stage at or before `index` whose training verifier
  calls it, or an evaluation before that stage (one follows every stage; one precedes the
  first with config.initial_eval). A stage's judge is used only after that stage has run."""
  last = len(plan.stages)
  index = last if index is None else index
  out = {}
  first: dict = {}
  for st in plan.stages:
    for jc in judge_calls(plan, st, model_for):
      if st.index <= index:
        first.setdefault(jc.source, []).append(jc)
  evals = eval_judge_calls(plan, model_for)
  for jc in evals:
    after = (plan.stage(jc.source[1]).index if jc.source[0] == 'stage'
             else (-1 if plan.initial_eval else 0))
    if after < index:
      first.setdefault(jc.source, []).append(jc)
  for source, calls in first.items():
    out[source] = (calls[0].model_cfg, any(c.use.score_by == 'generate' for c in calls))
  return out


def judge_sampler_options(sampler_cfg: dict, judge_cfg, policy_cfg, mesh, rules) -> dict:
  """A judge's Sampler options from the run's, as `cascade.policies.judge_model` builds it
  (`rl.judge.run_sampler_options`; policy_cfg None: the run's options count the judge's own
  KV slots)."""
  return judge_lib.run_sampler_options(sampler_cfg, judge_cfg, policy_cfg or judge_cfg, mesh,
                                       rules)


def judge_row_len(judge_cfg, new_tokens: int = 0) -> int:
  """A judge row's longest prompt: `rl.judge.MAX_LEN`, within the judge's positions."""
  return max(1, min(judge_lib.MAX_LEN, judge_cfg.max_seq_len - new_tokens))


def judge_forward_lowering(judge_cfg, mesh, rules):
  """A 'logits' judge's forward (`rl.judge.choice_logprobs_fn`) over one batch of its longest
  rows, on `mesh`.

  Returns:
    (() -> Lowered, description of the shapes, rows).
  """
  graphdef, params = programs_lib.abstract_params(judge_cfg, 'policy', mesh, rules)
  rows = programs_lib.forward_rows(judge_lib.BATCH_SIZE, mesh, rules)
  length = judge_row_len(judge_cfg)
  row_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch', None), (rows, length), mesh,
                                                        rules))
  mat = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_sh)
  ids = jax.ShapeDtypeStruct((2,), jnp.int32)

  def lower():
    with sharding.use_mesh(mesh):
      return judge_lib.choice_logprobs_fn.lower(graphdef, params, mat, mat, ids,
                                                sharding.as_rules(rules))
  return lower, f'{rows} rows x {length} tokens per forward', rows


def judge_programs(calls, mesh, rules, sampler_cfg: dict, limit_bytes: int,
                   policy_cfg=None) -> list:
  """Compiles each judge call's programs: a 'logits' judge's forward; a 'generate' judge's
  sampler for all its rows at its longest prompt (`judge_row_len`)."""
  out = []
  for jc in calls:
    cfg = jc.model_cfg
    if jc.use.score_by == 'logits':
      lower, what, rows = judge_forward_lowering(cfg, mesh, rules)
      calls_n, length = -(-jc.rows // rows), judge_row_len(cfg)
      flops = flops_lib.counted_flops(cfg, 'policy', rows * length, (length + 1) / 2,
                                      head_tokens=rows)
      out.append(compiler.compile_program(f'judge ({jc.domain})', f'{what}, {calls_n} forwards',
                                          lower, flops=flops, flops_from=flops_lib.COUNTED,
                                          limit_bytes=limit_bytes,
                                          compiler_options=compiler.compiler_options(mesh)))
      continue
    opts = judge_sampler_options(sampler_cfg, cfg, policy_cfg, mesh, rules)
    sizes = dict(rows=jc.rows, prompt_len=judge_row_len(cfg, jc.use.max_new_tokens),
                 max_new_tokens=jc.use.max_new_tokens, top_p=1.0, top_k=0, num_samples=1)
    for program, name in programs_lib.sampler_programs(opts):
      lower, what = programs_lib.sampler_lowering(cfg, mesh, rules, opts, **sizes, program=program,
                                                  frozen=True)
      flops, how = flops_lib.sampler_flops(cfg, mesh, rules, opts, **sizes, frozen=True)
      out.append(compiler.compile_program(f'judge {name} ({jc.domain})', what, lower, flops=flops,
                                          flops_from=how, limit_bytes=limit_bytes,
                                          compiler_options=compiler.sampling_options(mesh)))
  return out
