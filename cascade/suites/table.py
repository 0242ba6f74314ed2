"""Suite results as text: a progress line, the evaluation's table, the papers' numbers beside.

  table.summary(result)            # 'avg@4 53.0 ± 2.1, pass@4 70.0'
  table.results_table(results)     # Markdown: suite, metric, value ± s.e., pass@k, n, k, ...
  table.papers_table(results, suites_by_name)   # each reported number, this run's, the gap

A result is `cascade.suites.run.run_suite`'s dict. Values are percent. The
difference to a paper's number carries this run's standard error: the papers
report their numbers without one, so the gap's uncertainty is at least that.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def _ks(result: Mapping, prefix: str) -> list[str]:
  """The result's 'pass@k' (or 'maj@k') keys, by k."""
  return sorted((k for k in result if k.startswith(prefix)), key=lambda k: int(k[len(prefix):]))


def cell(result: Mapping) -> str:
  """'53.0 ± 2.1': the value and its standard error."""
  return f'{result["value"]:.1f} ± {result["stderr"]:.1f}'


def extras(result: Mapping) -> str:
  """'pass@4 70.0, maj@4 61.0' ('' when the result has neither)."""
  return ', '.join(f'{k} {result[k]:.1f}' for k in _ks(result, 'pass@') + _ks(result, 'maj@'))


def summary(result: Mapping) -> str:
  """'avg@4 53.0 ± 2.1, pass@4 70.0': the metric, its value and what else the suite reports."""
  more = extras(result)
  return f'{result["metric"]} {cell(result)}' + (f', {more}' if more else '')


def results_table(results: Mapping[str, Mapping]) -> str:
  """One Markdown row per suite: metric, value ± s.e., pass@k / maj@k, prompts, samples per
  prompt, samples, the share that hit the token budget, the protocol's hash."""
  lines = ['| suite | metric | value ± s.e. | pass@k / maj@k | n | k | samples | truncated | '
           'protocol |', '|---|---|---:|---|---:|---:|---:|---:|---|']
  for name, r in results.items():
    lines.append(f'| {name} | {r["metric"]} | {cell(r)} | {extras(r) or "-"} | {r["n"]} | '
                 f'{r["k"]} | {r["samples"]} | {100 * r.get("truncated", 0.0):.0f}% | '
                 f'{r["protocol"]} |')
  return '\n'.join(lines) + '\n'


def comparisons(results: Mapping[str, Mapping], suites: Mapping[str, object]) -> list[dict]:
  """Each paper's number beside this run's: {'suite', 'recipe', 'stage', 'reported', 'value',
  'diff', 'stderr', 'source'} for every `Reported` of every suite evaluated."""
  out = []
  for name, r in results.items():
    for rep in getattr(suites.get(name), 'reported', ()) or ():
      out.append({'suite': name, 'recipe': rep.recipe, 'stage': rep.stage,
                  'reported': rep.value, 'value': r['value'], 'diff': r['value'] - rep.value,
                  'stderr': r['stderr'], 'source': rep.source})
  return out


def papers_table(results: Mapping[str, Mapping], suites: Mapping[str, object]) -> str:
  """The papers' numbers beside this run's, as Markdown ('' when no suite has any): the
  difference carries this run's standard error (the papers give none)."""
  rows = comparisons(results, suites)
  if not rows:
    return ''
  lines = ['| suite | paper | after stage | reported | this run | difference ± s.e. | source |',
           '|---|---|---|---:|---:|---:|---|']
  for c in rows:
    lines.append(f'| {c["suite"]} | {c["recipe"]} | {c["stage"]} | {c["reported"]:.1f} | '
                 f'{c["value"]:.1f} | {c["diff"]:+.1f} ± {c["stderr"]:.1f} | {c["source"]} |')
  return '\n'.join(lines) + '\n'


# What results.json keeps of a suite's result in the matrix (numbers rounded to 4 places).
MATRIX_KEYS = ('metric', 'value', 'stderr', 'n', 'k', 'samples', 'protocol')


def matrix_cell(result: Mapping) -> dict:
  """results.json's cell of a suite after one stage: value, stderr, k, n, samples, metric, the
  protocol's hash, pass@k and maj@k."""
  keys = list(MATRIX_KEYS) + _ks(result, 'pass@') + _ks(result, 'maj@')
  return {k: round(float(result[k]), 4) if isinstance(result[k], float) else result[k]
          for k in keys if k in result}


def matrix_markdown(stages: Sequence[str], names: Sequence[str],
                    cells: Sequence[Sequence[Mapping | None]]) -> str:
  """The suites after every stage as a Markdown table: 'value ± s.e.' with the change from the
  row before ('-' where a suite was not scored)."""
  lines = ['| stage | ' + ' | '.join(names) + ' |', '|---|' + '---:|' * len(names)]
  prev: Sequence[Mapping | None] | None = None
  for stage, row in zip(stages, cells):
    out = []
    for j, c in enumerate(row):
      if c is None:
        out.append('-')
        continue
      text = cell(c)
      before = prev[j] if prev is not None else None
      if before is not None and before.get('protocol') == c.get('protocol'):
        text += f' ({c["value"] - before["value"]:+.1f})'
      out.append(text)
    lines.append(f'| {stage} | ' + ' | '.join(out) + ' |')
    prev = row
  return '\n'.join(lines) + '\n'


def _thinking(t) -> str:
  return {True: 'on (/think)', False: 'off (/no_think)', None: 'no switch'}[t]


def registry_markdown(suites: Sequence[object]) -> str:
  """docs/evaluation.md's list of suites, from the registry: each suite's benchmark, data,
  protocol and metric, `launch.plan`'s bound on its prompts where it does not measure them
  (`Suite.planned_prompts`: tokens, and records where known), then every number the papers
  report for them."""
  lines = ['| suite | benchmark | data | metric | samples | temperature | top-p | new tokens | '
           'thinking | pass@k | protocol | plan: prompt tokens (records) |',
           '|---|---|---|---|---:|---:|---:|---:|---|---|---|---:|']
  for s in suites:
    p = s.protocol
    data = s.source + (f' (`--download`: {s.hub_dataset})' if s.hub_dataset else '')
    temp = 'greedy' if p.greedy else f'{p.temperature:g}'
    tokens, records = s.planned_prompts()
    lines.append(f'| `{s.name}` | {s.title} | {data} | {s.metric} | {p.samples} | {temp} | '
                 f'{p.top_p:g} | {p.max_new_tokens} | {_thinking(p.thinking)} | '
                 f'{", ".join(map(str, p.pass_ks)) or "-"} | `{s.protocol_hash()}` | '
                 f'{tokens}' + (f' ({records})' if records else '') + ' |')
  text = '\n'.join(lines) + '\n'
  reported = [(s.name, r) for s in suites for r in s.reported]
  if reported:
    text += ('\nThe papers\' numbers (what `cascade.evaluate` prints beside a run\'s):\n\n'
             '| suite | recipe | after stage | value | source |\n|---|---|---|---:|---|\n')
    text += ''.join(f'| `{n}` | {r.recipe} | {r.stage} | {r.value:g} | {r.source} |\n'
                    for n, r in reported)
  return text
