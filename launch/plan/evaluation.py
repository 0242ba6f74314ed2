"""The evaluation's programs: the held-out evaluation's largest sampler call and its verifiers'
judges, and each of config.eval.suites' largest sampler call and its grader's local judge model
(`suite_calls`), with the judges loaded by then resident beside them."""

from __future__ import annotations

import dataclasses

from launch.plan import compiler
from launch.plan import flops as flops_lib
from launch.plan import judges as judges_lib
from launch.plan import memory
from launch.plan import programs as programs_lib
from launch.plan import results
from launch.plan import suite_calls as suite_calls_lib


def sampler_programs(label: str, model_cfg, mesh, rules, sampler_cfg: dict, sizes: dict,
                     limit_bytes: int, count_mesh=None, note: str = '', tail: str = '') -> list:
  """Compiles the policy sampler's programs for one call of `sizes` (`programs.sampler_lowering`'s
  size arguments), each named '<label> <program><tail>' (e.g. 'eval sampler', 'suite sampler
  prefill (aime25)'); `note` is added to each one's shapes. FLOPs are XLA's on a twin with the layers unrolled (XLA counts a scan body
  once), or counted from the config for the families XLA cannot count (`flops.counted_flops`)."""
  out = []
  for program, name in programs_lib.sampler_programs(sampler_cfg):
    lower, what = programs_lib.sampler_lowering(model_cfg, mesh, rules, sampler_cfg, **sizes,
                                                program=program)
    what += note
    if model_cfg.flops_from_config:
      flops, how = flops_lib.sampler_flops(model_cfg, mesh, rules, sampler_cfg, **sizes)
      out.append(compiler.compile_program(f'{label} {name}{tail}', what, lower, flops=flops,
                                          flops_from=how, limit_bytes=limit_bytes,
                                          compiler_options=compiler.sampling_options(mesh)))
      continue
    twin = programs_lib.sampler_lowering(dataclasses.replace(model_cfg, scan_layers=False),
                                         mesh if count_mesh is None else count_mesh, rules,
                                         sampler_cfg, **sizes, program=program)[0]
    out.append(compiler.compile_program(f'{label} {name}{tail}', what, lower, twin,
                                        limit_bytes=limit_bytes,
                                        compiler_options=compiler.sampling_options(mesh)))
  return out


def plan_eval(plan, model_cfg, mesh, rules, sampler_cfg: dict, limit_bytes: int,
              count_mesh=None, model_for=lambda cfg: cfg) -> results.StageReport:
  """Compiles the evaluation's largest sampler call (batch_size prompts x num_samples, the
  longest prompt and response any domain's settings allow; an agentic domain's last turn has
  the opening prompt and the whole episode budget as its prompt) and the programs of the
  judges its verifiers call; the judges loaded by then stay beside every program. Then the
  suites' programs (`suite_programs`)."""
  settings = dict(plan.eval_settings or {})
  evs = list(settings.values()) or [plan.eval]
  agentic = lambda d: d in plan.domains and plan.domains[d].agentic
  longest = [e.max_prompt_len + (e.max_new_tokens if agentic(d) else 0)
             for d, e in settings.items()] or [plan.eval.max_prompt_len]
  sizes = dict(rows=max(e.batch_size * (1 if e.greedy else e.num_samples) for e in evs),
               prompt_len=max(longest),
               max_new_tokens=max(e.max_new_tokens for e in evs),
               top_p=min(e.top_p for e in evs), top_k=max(e.top_k for e in evs),
               num_samples=min(1 if e.greedy else e.num_samples for e in evs))
  progs = sampler_programs('eval', model_cfg, mesh, rules, sampler_cfg, sizes, limit_bytes,
                           count_mesh)
  calls = judges_lib.eval_judge_calls(plan, model_for)
  progs += judges_lib.judge_programs(calls, mesh, rules, sampler_cfg, limit_bytes, model_cfg)
  held = {src: sum(memory.judge_bytes(cfg, gen, mesh, rules, sampler_cfg, model_cfg))
          for src, (cfg, gen) in judges_lib.loaded_judges(plan, None, model_for).items()}
  total = sum(held.values())
  passed = {}
  for jc in calls:
    params, copy = memory.judge_bytes(jc.model_cfg, jc.use.score_by == 'generate', mesh, rules,
                                      sampler_cfg, model_cfg)
    passed[jc.domain] = (copy or params) if jc.source in held else 0
  resident = tuple((p.name, total - passed[p.name[p.name.rindex('(') + 1:-1]]
                    if p.name.startswith('judge') else total) for p in progs)
  suite_progs, suite_resident = suite_programs(plan, model_cfg, mesh, rules, sampler_cfg,
                                               limit_bytes, count_mesh, model_for, total)
  return results.StageReport(-1, 'evaluation', 'eval', tuple(progs) + suite_progs,
                             limit_bytes, mesh.size, resident=resident + suite_resident)


def _suite_note(top: suite_calls_lib.SuiteCall, names) -> str:
  """What a suite sampler program was planned for, in words (after the sampler's shapes)."""
  return (f"; suites {', '.join(names)}: {top.prompts} prompts x {top.samples} samples, "
          f'prompts of up to {top.prompt_len} tokens ({top.suite}: {top.how}), '
          f'{top.max_new_tokens} new tokens')


def _unplannable(call: suite_calls_lib.SuiteCall, model_cfg, sampler) -> str:
  """Why a suite's call cannot run at all ('' when it can): its longest row past the model's
  positions, or its prompt or budget past the sampler's buckets."""
  room = model_cfg.max_seq_len - call.prompt_len
  if call.max_new_tokens > room:
    fix = (f'config.eval.suite_protocol.{call.suite}.max_new_tokens <= {room}' if room > 0 else
           'the suite does not fit this model')
    return (f'prompts of up to {call.prompt_len} tokens ({call.how}) + {call.max_new_tokens} '
            f"new tokens exceed the model's max_seq_len={model_cfg.max_seq_len}: {fix}")
  try:
    sampler.call_shape(call.rows, call.prompt_len, call.max_new_tokens)
  except ValueError as e:
    return f'{e} (config.sampler)'
  return ''


def suite_programs(plan, model_cfg, mesh, rules, sampler_cfg: dict, limit_bytes: int,
                   count_mesh=None, model_for=lambda cfg: cfg, held_bytes: int = 0
                   ) -> tuple[tuple, tuple]:
  """Compiles config.eval.suites' largest sampler calls (`suite_calls`; suites whose calls
  compile to the same program share one, 'suite sampler (aime24, aime25)') and the programs
  of each suite's local judge model ('judge sampler (arena_hard_v2)'; a served judge has
  none).

  A call that cannot run (its rows past the model's positions or the sampler's buckets) is a
  program report with that error, compiled not at all.

  Beside every program stay the judges the run keeps loaded (`held_bytes`). A suite's local
  judge is loaded when its grading starts and freed when the suite ends: beside that suite's
  sampler are the judge's params (and its rollout copy); beside the judge's program, the
  policy sampler's arguments (the next batch samples while one is graded).

  Returns:
    (ProgramReports, their (name, resident bytes) pairs).
  """
  calls = suite_calls_lib.suite_calls(plan, model_for)
  if not calls:
    return (), ()
  sampler, _ = programs_lib.sampler_for(model_cfg, mesh, rules, sampler_cfg)
  shape = lambda c: sampler.call_shape(c.rows, c.prompt_len, c.max_new_tokens)
  judge_held = {}
  for c in calls:
    if c.judge is not None:
      judge_held[c.suite] = sum(memory.judge_bytes(c.judge.model_cfg, True, mesh, rules,
                                                   sampler_cfg, model_cfg))
  progs, resident, arguments = [], [], {}
  for c in calls:
    why = _unplannable(c, model_cfg, sampler)
    if why:
      progs.append(results.ProgramReport(f'suite sampler ({c.suite})',
                                         _suite_note(c, [c.suite]).lstrip('; '), error=why))
      resident.append((progs[-1].name, held_bytes))
  calls = [c for c in calls if not _unplannable(c, model_cfg, sampler)]
  for top, names in suite_calls_lib.grouped(calls, shape):
    got = sampler_programs('suite', model_cfg, mesh, rules, sampler_cfg, top.sizes(),
                           limit_bytes, count_mesh, _suite_note(top, names),
                           tail=f" ({', '.join(names)})")
    beside = held_bytes + max(judge_held.get(n, 0) for n in names)
    for p in got:
      progs.append(p)
      resident.append((p.name, beside))
      for n in names:
        arguments[n] = max(arguments.get(n, 0), p.argument_bytes)
  for c in calls:
    if c.judge is None or c.suite not in arguments:
      continue
    for p in judges_lib.judge_programs([c.judge], mesh, rules, sampler_cfg, limit_bytes,
                                       model_cfg):
      progs.append(p)
      resident.append((p.name, held_bytes + arguments[c.suite]))
  return tuple(progs), tuple(resident)
