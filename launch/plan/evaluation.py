"""The held-out evaluation's programs: its largest sampler call and its verifiers' judges, with
the judges loaded by then resident beside them."""

from __future__ import annotations

import dataclasses

from launch.plan import compiler
from launch.plan import flops as flops_lib
from launch.plan import judges as judges_lib
from launch.plan import memory
from launch.plan import programs as programs_lib
from launch.plan import results


def plan_eval(plan, model_cfg, mesh, rules, sampler_cfg: dict, limit_bytes: int,
              count_mesh=None, model_for=lambda cfg: cfg) -> results.StageReport:
  """Compiles the evaluation's largest sampler call (batch_size prompts x num_samples, the
  longest prompt and response any domain's settings allow; an agentic domain's last turn has
  the opening prompt and the whole episode budget as its prompt) and the programs of the
  judges its verifiers call; the judges loaded by then stay beside every program."""
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
  progs = []
  for program, name in programs_lib.sampler_programs(sampler_cfg):
    lower, what = programs_lib.sampler_lowering(model_cfg, mesh, rules, sampler_cfg, **sizes,
                                                program=program)
    if model_cfg.flops_from_config:     # counted from the config (`flops.counted_flops`)
      flops, how = flops_lib.sampler_flops(model_cfg, mesh, rules, sampler_cfg, **sizes)
      progs.append(compiler.compile_program(f'eval {name}', what, lower, flops=flops,
                                            flops_from=how, limit_bytes=limit_bytes,
                                            compiler_options=compiler.sampling_options(mesh)))
      continue
    # Counted on a twin with the layers unrolled (XLA counts a scan body once).
    twin = programs_lib.sampler_lowering(dataclasses.replace(model_cfg, scan_layers=False),
                                         mesh if count_mesh is None else count_mesh, rules,
                                         sampler_cfg, **sizes, program=program)[0]
    progs.append(compiler.compile_program(f'eval {name}', what, lower, twin,
                                          limit_bytes=limit_bytes,
                                          compiler_options=compiler.sampling_options(mesh)))
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
  return results.StageReport(-1, 'evaluation', 'eval', tuple(progs), limit_bytes, mesh.size,
                             resident=resident)
