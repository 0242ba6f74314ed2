"""Agentic rollouts: multi-turn episodes of the policy acting in an environment through tools.

An episode is one token stream: the opening prompt (the record's
conversation rendered with the environment's tool schemas, in the row's
thinking mode), then the policy's first assistant turn (sampled until
`<|im_end|>`), the environment's observation (its tool results rendered as a
`<tool_response>` user turn and the next generation prompt,
`foundation.chat.render_observation`), the next assistant turn, and so on, until
a turn without a tool call (the final answer, which the environment scores),
`max_turns`, or the episode's token budget.

Every turn of every live episode is sampled in ONE sampler call, whatever
turn each episode is at: an episode's prompt for a turn is its whole stream
so far. With the paged engine the calls share a KV session
(`rl.scheduler.Session`): an episode's cache stays in its pages between turns,
so a turn prefills only the tokens after it (the last sampled token and the
observation), not the whole stream again; the samples are the same. The
stream is never re-tokenized: the tokens the policy sampled and the
observation tokens appended are kept as ids, so a training forward over
the stream sees exactly what the sampler saw, and the sampler's log-prob of
every policy token is what the trainer computes (on-policy across turns).

The result is an `EpisodeSamples` (the sampler's `SampleOutput` fields plus
`policy_mask`): `tokens` hold everything after the opening prompt, `mask`
marks the tokens present, `policy_mask` the ones the policy sampled (the
loss and the log-prob ratio see only those; observation tokens are
context). `rl.batch.from_samples` reads it like a single-turn rollout.

With several JAX processes every host samples the same episodes; process 0
steps the environment (tools run once) and its steps are sent to every host,
so the hosts' streams stay identical.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from cascade import distributed
from cascade import rollout
from foundation import chat
from rl import sampler as sampler_lib


class Agent(NamedTuple):
  """What an agentic domain is scored by: its environment and its episode limits.

  Attributes:
    env: the `envs.Environment`.
    max_turns: assistant turns per episode.
    render_tools: list the tools' schemas in the opening system turn.
    max_turn_tokens: one turn's tokens in evaluation (0: the whole budget).
  """
  env: Any
  max_turns: int
  render_tools: bool = True
  max_turn_tokens: int = 0

  @property
  def isolation(self) -> str:
    """The isolation the environment's tools run under ('n/a' when none run code)."""
    return getattr(self.env, 'isolation', 'n/a')

  def close(self) -> None:
    self.env.close()


class EpisodeSamples(NamedTuple):
  """A batch of episodes in the sampler's layout; row i * G + g is episode g of prompt i.

  Attributes:
    prompt_tokens, prompt_mask: [B, P] the opening prompt, left-padded.
    tokens: [B, N] everything after the opening prompt (policy turns and
      observations); pad after `lengths`.
    mask: [B, N] 1 for every token present.
    logprobs: [B, N] the sampler's log-prob of each policy token (0 elsewhere).
    sampling_logprobs: [B, N] as `SampleOutput`'s (0 on observations).
    lengths: [B] tokens after the opening prompt.
    truncated: [B] the episode was cut by a limit (turns or tokens), not ended
      by a final answer.
    policy_mask: [B, N] 1 on the tokens the policy sampled.
    prompt_routing, routing: recorded routing ([B, P, M, k] of the opening, [B, N, M, k] of
      the rest; `generate(record_routing=True)`), else None.
  """
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  lengths: np.ndarray
  truncated: np.ndarray
  policy_mask: np.ndarray
  prompt_routing: np.ndarray | None = None
  routing: np.ndarray | None = None


class Episodes(NamedTuple):
  """Scored episodes; every per-row list has n * G entries (prompt-major).

  Attributes:
    records, modes: each row's record and thinking mode.
    completions: each row's decoded stream after the opening prompt.
    samples: the `EpisodeSamples`.
    rewards: [rows] float32, the environment's reward.
    infos: [rows] dicts: the environment's info plus turns, tool_calls,
      tool_errors and (cut episodes) 'cut'.
    env_s: seconds spent in the environment (tools and scoring), the rest of
      the call's time being sampling and host work.
    prefill: (prompt tokens prefilled, prompt tokens read from kept pages
      instead) over the episodes' turns; (0, 0) without a KV session.
  """
  records: list
  modes: list
  completions: list
  samples: EpisodeSamples
  rewards: np.ndarray
  infos: list
  env_s: float = 0.0
  prefill: tuple[int, int] = (0, 0)


def opening_text(env, record: dict, thinking: bool | None, render_tools: bool = True) -> str:
  """The opening prompt of an episode of `record`: its conversation, with the tools' schemas."""
  tools = env.tools(record) if render_tools else None
  return chat.render(record['messages'], thinking=thinking, tools=tools or None)


def demonstration(record: dict, tokenizer, thinking: bool | None,
                  tools: Sequence[dict] | None = None) -> tuple[list[int], list[int]]:
  """(tokens, loss mask) of a multi-turn demonstration, built the way `generate` builds episodes.

  The record's `turns` alternate assistant turns and tool results
  (consecutive 'tool' messages form one observation); assistant tokens are
  learned, the opening prompt and observations are context. Assistant turns
  end with `<|im_end|>` as sampled ones do.

  Args:
    record: an SFT record with 'messages' (the opening) and 'turns'.
    tokenizer: the tokenizer.
    thinking: the mode (as a rollout's).
    tools: the tool schemas the opening lists (None: none, as an agentic
      domain with render_tools=False).
  """
  toks = tokenizer.encode(chat.render(record['messages'], thinking=thinking, tools=tools or None))
  mask = [0] * len(toks)
  pending: list[dict] = []
  for turn in record['turns']:
    if turn['role'] == 'tool':
      pending.append(turn)
      continue
    if pending:
      obs = tokenizer.encode(chat.render_observation(pending, thinking=thinking,
                                                     markers=tokenizer.added_tokens))
      toks += obs
      mask += [0] * len(obs)
      pending = []
    text = turn['content']
    if not text.endswith(chat.IM_END):
      text += chat.IM_END
    ids = tokenizer.encode(text)
    toks += ids
    mask += [1] * len(ids)
  return toks, mask


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode([t for t in ids if t < tokenizer.vocab_size])


def _step_on_every_host(env, episodes, actions, hosts) -> list[tuple]:
  """env.step on process 0, its steps sent to every host: [(messages, done, reward, info,
  turns, tool_calls, tool_errors)]."""
  def run():
    steps = env.step(episodes, actions)
    return [(list(s.messages), s.done, s.reward, s.info, e.turns, e.tool_calls, e.tool_errors)
            for s, e in zip(steps, episodes)]
  return _on_host0(run, hosts)


def _finish_on_every_host(env, episodes, reasons, hosts) -> list[tuple]:
  def run():
    steps = env.finish(episodes, reasons)
    return [([], True, s.reward, s.info, e.turns, e.tool_calls, e.tool_errors)
            for s, e in zip(steps, episodes)]
  return _on_host0(run, hosts)


def _on_host0(fn, hosts):
  if hosts.count == 1:
    return fn()
  body, failure = b'', None
  if hosts.index == 0:
    try:
      body = json.dumps({'steps': fn()}, default=rollout._jsonable).encode()  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      failure = e
      body = json.dumps({'error': f'{type(e).__name__}: {e}'}).encode()
  got = json.loads(hosts.exchange(body)[0])
  if 'error' in got:
    raise RuntimeError(f'the environment failed on process 0 (every process stops here): '
                       f'{got["error"]}') from failure
  return [tuple(s) for s in got['steps']]


def generate(sampler, params, tokenizer, env, records: Sequence[dict], modes: Sequence, rng,
             sp: sampler_lib.SamplingParams, group_size: int, *, max_turns: int,
             max_tokens: int, render_tools: bool = True,
             hosts: rollout.Hosts | None = None, record_routing: bool = False) -> Episodes:
  """Runs `group_size` episodes of every record to their end and scores them.

  Args:
    sampler: an `rl.sampler.Sampler` (its prompt buckets must hold the opening
      prompt plus `max_tokens`).
    params: the policy's params.
    tokenizer: the tokenizer (its eos id is `<|im_end|>`).
    env: an `envs.Environment`.
    records: prompt records of the env's domain.
    modes: one thinking mode per record.
    rng: PRNG key; turn t's call uses fold_in(rng, t).
    sp: sampling parameters; `sp.max_new_tokens` caps one assistant turn.
    group_size: G episodes per record.
    max_turns: assistant turns per episode; an episode still calling tools
      after them is cut.
    max_tokens: tokens after the opening prompt (turns and observations).
    render_tools: list the tools' schemas in the opening's system turn.
    hosts: the JAX processes (default: this run's).
    record_routing: carry every token's experts across the turns (routing replay; a
      mixture-of-experts policy): each token's from the first turn's call that forwarded it
      (the turn that sampled it, or whose prompt first held it; with a KV session, later
      turns attend to that pass's keys and values), so the episode's routing is one stream
      aligned with its tokens (`EpisodeSamples.prompt_routing`, `.routing`).

  Returns:
    `Episodes`.
  """
  hosts = rollout.processes() if hosts is None else hosts
  if max_turns < 1 or max_tokens < 1:
    raise ValueError(f'max_turns={max_turns} and max_tokens={max_tokens} must be >= 1')
  rows = [r for r in records for _ in range(group_size)]
  row_modes = [m for m in modes for _ in range(group_size)]
  n = len(rows)
  episodes = env.reset(rows)
  opening = [tokenizer.encode(opening_text(env, r, m, render_tools))
             for r, m in zip(rows, row_modes)]
  ctx: list[list[int]] = [[] for _ in range(n)]
  policy: list[list[int]] = [[] for _ in range(n)]
  lps: list[list[float]] = [[] for _ in range(n)]
  slps: list[list[float]] = [[] for _ in range(n)]
  rewards = np.zeros(n, np.float32)
  infos: list[dict] = [{} for _ in range(n)]
  cut = np.zeros(n, bool)
  # Recording: each episode's routing so far, aligned with opening + ctx (a list of arrays).
  routes: list[list[np.ndarray]] = [[] for _ in range(n)]
  live = list(range(n))
  turn = 0
  env_s = 0.0
  # The paged engine keeps each episode's pages between turns (keys: row indices).
  session = (sampler.session(max(map(len, opening)) + max_tokens)
             if getattr(sampler, 'engine', None) == 'paged' else None)

  def end(rows_ended, results):
    for i, (_, _, reward, info, turns, calls, errors) in zip(rows_ended, results):
      rewards[i] = reward
      infos[i] = dict(info, turns=turns, tool_calls=calls, tool_errors=errors)

  while live:
    budget = {i: max_tokens - len(ctx[i]) for i in live}
    new = min(sp.max_new_tokens, max(budget.values()))
    turn_sp = sp if new == sp.max_new_tokens else dataclasses.replace(sp, max_new_tokens=new)
    # Each episode's turn stops at its own remaining budget (no tokens sampled past it).
    limits = [max(1, min(new, budget[i])) for i in live]
    out = sampler.generate(params, [opening[i] + ctx[i] for i in live],
                           jax.random.fold_in(rng, turn), turn_sp, row_limits=limits,
                           **(dict(session=session, keys=live) if session else {}),
                           **(dict(record_routing=True) if record_routing else {}))
    turn += 1
    acting, actions, over = [], [], {}
    for j, i in enumerate(live):
      k = int(out.lengths[j])
      toks = out.tokens[j, :k].tolist()
      if k > budget[i] or (out.truncated[j] and k >= budget[i]):
        k, why = min(k, budget[i]), 'token budget'
      elif out.truncated[j]:
        why = 'turn longer than max_new_tokens'
      else:
        why = ''
      if record_routing:
        _carry_routing(routes[i], out, j, len(opening[i]) + len(ctx[i]), k)
      ctx[i] += toks[:k]
      policy[i] += [1] * k
      lps[i] += out.logprobs[j, :k].tolist()
      slps[i] += out.sampling_logprobs[j, :k].tolist()
      if why:
        over[i] = why
      else:
        acting.append(i)
        actions.append(_decode(tokenizer, toks[:k]))
    live = []
    if acting:
      t0 = time.perf_counter()
      steps = _step_on_every_host(env, [episodes[i] for i in acting], actions, hosts)
      env_s += time.perf_counter() - t0
      done = [(i, s) for i, s in zip(acting, steps) if s[1]]
      end([i for i, _ in done], [s for _, s in done])
      for i, s in zip(acting, steps):
        if s[1]:
          continue
        # An observation is appended only when the policy will act on it.
        obs = tokenizer.encode(chat.render_observation(s[0], thinking=row_modes[i],
                                                       markers=tokenizer.added_tokens))
        if len(ctx[i]) + len(obs) >= max_tokens:
          over[i] = 'token budget'
        elif turn >= max_turns:
          over[i] = 'turn limit'
        else:
          ctx[i] += obs
          policy[i] += [0] * len(obs)
          lps[i] += [0.0] * len(obs)
          slps[i] += [0.0] * len(obs)
          live.append(i)
    if over:
      ended = sorted(over)
      t0 = time.perf_counter()
      end(ended, _finish_on_every_host(env, [episodes[i] for i in ended],
                                       [over[i] for i in ended], hosts))
      env_s += time.perf_counter() - t0
      cut[ended] = True

  prefill = (0, 0)
  if session is not None:
    prefill = (session.prefilled_tokens, session.reused_tokens)
    session.close()
  return Episodes(records=rows, modes=row_modes,
                  completions=[_decode(tokenizer, c) for c in ctx],
                  samples=_pack(opening, ctx, policy, lps, slps, cut, max_tokens,
                                sampler.pad_id, routes if record_routing else None),
                  rewards=rewards, infos=infos, env_s=env_s, prefill=prefill)


def _carry_routing(route: list, out, j: int, prompt_len: int, k: int) -> None:
  """Appends to an episode's routing (`route`, arrays aligned with its stream) what turn
  call `out`'s row j adds: the routing of its prompt's tokens the episode has none for yet
  (the observation), then its first k sampled tokens'."""
  have = sum(x.shape[0] for x in route)
  head = np.asarray(out.prompt_routing[j])
  head = head[head.shape[0] - prompt_len:]          # the row's prompt (left-padded)
  route.append(head[have:])
  route.append(np.asarray(out.routing[j, :k]))


def _routing_of(opening, routes, p: int, width: int) -> dict:
  """EpisodeSamples' prompt_routing [n, p, M, k] and routing [n, width, M, k] from each
  episode's routing stream (opening first)."""
  whole = [np.concatenate(r) for r in routes]
  tail, dt = whole[0].shape[1:], whole[0].dtype
  prompt = np.zeros((len(whole), p) + tail, dt)
  rest = np.zeros((len(whole), width) + tail, dt)
  for i, w in enumerate(whole):
    o = len(opening[i])
    prompt[i, p - o:] = w[:o]
    rest[i, :w.shape[0] - o] = w[o:]
  return dict(prompt_routing=prompt, routing=rest)


def _pack(opening, ctx, policy, lps, slps, cut, width: int, pad_id: int,
          routes=None) -> EpisodeSamples:
  n = len(ctx)
  p = max(len(o) for o in opening)
  prompt = np.full((n, p), pad_id, np.int32)
  pmask = np.zeros((n, p), np.int32)
  tokens = np.full((n, width), pad_id, np.int32)
  mask = np.zeros((n, width), np.int32)
  pol = np.zeros((n, width), np.int32)
  lp = np.zeros((n, width), np.float32)
  slp = np.zeros((n, width), np.float32)
  for i in range(n):
    o, c = opening[i], ctx[i]
    prompt[i, p - len(o):] = o
    pmask[i, p - len(o):] = 1
    tokens[i, :len(c)] = c
    mask[i, :len(c)] = 1
    pol[i, :len(c)] = policy[i]
    lp[i, :len(c)] = lps[i]
    slp[i, :len(c)] = slps[i]
  routed = {} if routes is None else _routing_of(opening, routes, p, width)
  return EpisodeSamples(prompt_tokens=prompt, prompt_mask=pmask, tokens=tokens, mask=mask,
                        logprobs=lp, sampling_logprobs=slp,
                        lengths=np.array([len(c) for c in ctx], np.int32),
                        truncated=np.asarray(cut, bool), policy_mask=pol, **routed)


def metrics(eps: Episodes) -> dict[str, float]:
  """Per-episode means a user watches: turns, tool calls and errors, success, cut episodes."""
  get = lambda k: np.array([float(i.get(k, 0)) for i in eps.infos])
  toks = np.asarray(eps.samples.policy_mask).sum(1)
  return {'turns': float(np.mean(get('turns'))), 'tool_calls': float(np.mean(get('tool_calls'))),
          'tool_errors': float(np.mean(get('tool_errors'))),
          'success': float(np.mean(eps.rewards >= 1.0)),
          'cut_frac': float(np.mean(eps.samples.truncated)),
          'policy_tokens': float(np.mean(toks)),
          'episode_len': float(np.mean(eps.samples.lengths)),
          # The share of the turns' prompt tokens read from kept pages, not prefilled.
          'kv_reuse': float(eps.prefill[1] / max(1, sum(eps.prefill)))}

