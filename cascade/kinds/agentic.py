"""Kind 'agentic': GRPO over multi-turn tool-calling episodes (a group = G episodes of one task).

  dict(name='tool_rl', kind='agentic', domains=['tool_use'], steps=20,
       optimizer=dict(lr=3e-5), prompts_per_step=8, group_size=8,
       max_prompt_len=96, max_response_len=256, max_turn_tokens=64)

Every domain of the stage names an environment (`config.domains.<d>.env`,
see `envs`). A step draws prompts, runs G episodes of each in its domain's
environment (`cascade.episodes`: every live episode's next turn in one
sampler call, tool results appended as observations, until a final answer,
the domain's `max_turns` or the token budget) and takes the GRPO update of
`cascade.kinds.grpo` on them, with every field of that kind (advantage,
clipping, KL to the starting policy, entropy, dynamic filtering, the
curriculum). Only the tokens the policy sampled carry loss; observations are
context. `max_response_len` (and a phase's) is the episode's token budget
after the opening prompt, turns and observations together; `max_turn_tokens`
caps one assistant turn (default: the whole budget).

Metrics beside GRPO's: per-episode means of turns, tool calls, tool errors,
success (reward >= 1), cut episodes and policy tokens (`episodes.metrics`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import numpy as np

from cascade import episodes
from cascade import rollout
from cascade.kinds import base
from cascade.kinds import grpo
from cascade.kinds import rl
from rl import batch as batch_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(grpo.Config):
  AGENTIC: ClassVar[bool] = True

  max_turn_tokens: int = base.field(0, check=(lambda v: base.is_int(v) and v >= 0,
                                              'must be an int >= 0 (0 = the whole budget)'))
  # domain -> (env, env_options, render_tools), filled from config.domains when resolved.
  agents: tuple = base.field((), user=False)

  def check(self, fail):
    if self.stream_filter:
      fail('stream_filter', 'an agentic rollout is a multi-turn episode, not one sampler call '
                            'that can stream its groups; filter in rounds (refill_cap)')
    if self.max_turn_tokens > self.max_response_len:
      fail('max_turn_tokens', f'exceeds max_response_len={self.max_response_len} (the '
                              "episode's whole token budget)")
    super().check(fail)

  def resolve(self, refs, fail):
    out = super().resolve(refs, fail)
    agents = []
    for d in self.domains:
      dom = refs.domains[d]
      if not dom.agentic:
        fail('domains', f'domain {d!r} names no env; an agentic stage runs episodes in each '
                        "domain's environment (config.domains.<d>.env)")
      agents.append((d, dom.env, tuple(sorted(dom.env_options.items())), dom.render_tools))
    return dataclasses.replace(out, agents=tuple(agents))

  @property
  def turn_tokens(self) -> int:
    return self.max_turn_tokens or self.max_response_len

  def record_filter(self, tokenizer):
    import envs  # pylint: disable=g-import-not-at-top
    built = {d: (envs.get(name, **dict(opts)), tools) for d, name, opts, tools in self.agents}

    def keep(record):
      env, tools = built[record['domain']]
      return all(len(tokenizer.encode(episodes.opening_text(env, record, m, tools)))
                 <= self.max_prompt_len
                 for m in rollout.stage_modes(self.mode_fractions))
    return keep, (f'opening prompts (with the tool schemas) longer than '
                  f'max_prompt_len={self.max_prompt_len}')


def sampler_sizes(stage: Config) -> dict:
  """The largest turn call: every episode live, its prompt the opening plus the whole budget."""
  return dict(rows=stage.prompts_per_step * stage.group_size,
              prompt_len=stage.max_prompt_len + stage.longest_response,
              max_new_tokens=stage.turn_tokens, top_p=stage.top_p, top_k=stage.top_k)


def sampler_calls(stage: Config) -> list[dict]:
  """An episode's turns, one call each: turn k's prompt is the opening plus the k turns before
  it (observations, whose lengths the config does not bound, left out), its new tokens a
  turn's, the last what is left of the budget; after the first, a paged KV session holds the
  prompt (`continued`)."""
  budget, turn = stage.longest_response, stage.turn_tokens
  return [dict(rows=stage.prompts_per_step * stage.group_size,
               prompt_len=stage.max_prompt_len + k * turn,
               max_new_tokens=min(turn, budget - k * turn),
               top_p=stage.top_p, top_k=stage.top_k, continued=k > 0)
          for k in range(-(-budget // turn))]


class Draws(rl.Draws):
  """RL draws whose rollouts are episodes in each record's domain environment."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.episode_metrics: list[tuple[int, dict]] = []

  def _rollouts(self, recs, modes, key):
    st, ctx = self.stage, self.ctx
    g = st.group_size
    budget = self.sp.max_new_tokens              # the phase's episode budget
    turn_sp = dataclasses.replace(self.sp, max_new_tokens=min(st.turn_tokens, budget))
    parts, order = [], []
    t0 = time.perf_counter()
    for j, d in enumerate(sorted({r['domain'] for r in recs})):
      idx = [i for i, r in enumerate(recs) if r['domain'] == d]
      agent = ctx.verifiers.train_verifier(d)
      eps = episodes.generate(ctx.sampler, self.params, ctx.tokenizer, agent.env,
                              [recs[i] for i in idx], [modes[i] for i in idx],
                              jax.random.fold_in(key, j), turn_sp, g,
                              max_turns=agent.max_turns, max_tokens=budget,
                              render_tools=agent.render_tools,
                              record_routing=st.records_routing)
      parts.append(eps)
      order += [i * g + k for i in idx for k in range(g)]
      self.episode_metrics.append((len(eps.rewards), episodes.metrics(eps)))
    # Back to prompt-major order: row i * G + k is episode k of recs[i].
    where = np.argsort(np.asarray(order))
    samples = batch_lib.take_rows(batch_lib.concat_rows([p.samples for p in parts]), where)
    cat = lambda field: [x for p in parts for x in getattr(p, field)]
    pick = lambda xs: [xs[w] for w in where]
    env_s = sum(p.env_s for p in parts)
    ro = episodes.Episodes(records=pick(cat('records')), modes=pick(cat('modes')),
                           completions=pick(cat('completions')), samples=samples,
                           rewards=np.concatenate([p.rewards for p in parts])[where],
                           infos=pick(cat('infos')), env_s=env_s)
    # Time in the environments (tools and scoring) counts as scoring, the rest as sampling.
    self.score_s += env_s
    self.sample_s += time.perf_counter() - t0 - env_s
    return ro, ro.rewards.astype(np.float32), ro.infos

  def metrics(self) -> dict:
    out = super().metrics()
    total = sum(n for n, _ in self.episode_metrics)
    for k in self.episode_metrics[0][1]:
      out[f'episode/{k}'] = float(sum(n * m[k] for n, m in self.episode_metrics) / total)
    return out


def run(ctx, stage: Config) -> base.StageResult:
  return grpo.train_stage(ctx, stage, KIND, Draws)


KIND = base.Kind('agentic', Config, run, loss=grpo.loss, abstract_batch=grpo.abstract_batch,
                 sampler_sizes=sampler_sizes, frozen_forwards=grpo.frozen_forwards,
                 sampler_calls=sampler_calls)
