"""Prompts in, scored completions out: chat rendering, group sampling, detokenising, verifying.

Shared by the RL stages and the evaluation. Host side only, apart from the
sampler call. A record's prompt is rendered with the run's chat template
(`foundation.chat.render`, or a checkpoint's own: `foundation.chat_template`, carried by the
tokenizer) in the
mode it was drawn for (thinking: ' /think'; instruct: ' /no_think' and a
pre-filled empty thinking block; None: no switch), encoded, sampled G times,
and each completion is scored by the verifier of its record's domain, so a
batch may mix domains (the blended baseline) with no branch on any domain.

Verifiers receive `Sample(prompt=<the conversation rendered without a mode
switch>, completion=<decoded text, special tokens kept>, metadata=<record
metadata>)`: the mode-free prompt, rendered by the built-in template whatever renders the
policy's prompts, is the text a reward model is trained on.

One reward per rollout, on every host: with several JAX processes each
scores its share of the batch's groups and the shares are exchanged
(`score`), so no host re-scores what another scored, and a verifier timeout
that fires on one host cannot give the hosts different rewards.
"""

from __future__ import annotations

import json
import zlib
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from cascade import distributed
from foundation import chat
from foundation import chat_template
from foundation import step_clock
from rl import sampler as sampler_lib


def prompt_text(record: dict, thinking: bool | None, template=chat_template.BUILTIN) -> str:
  """The generation prompt of a record in a mode, rendered by `template` (the run's:
  `chat_template.of(tokenizer)`)."""
  return template.render(record['messages'], thinking=thinking)


def verifier_prompt(record: dict) -> str:
  """The prompt as verifiers and reward models see it (no mode switch)."""
  return chat.render(record['messages'], thinking=None)


def longest_prompt_len(record: dict, tokenizer, modes: Sequence[bool | None]) -> int:
  """Tokens of the record's prompt in the longest of the modes it may be drawn in."""
  template = chat_template.of(tokenizer)
  return max(len(tokenizer.encode(prompt_text(record, m, template))) for m in modes)


def stage_modes(thinking_fraction: float | Mapping[str, float] | None) -> tuple:
  """The modes a stage draws prompts in (a per-domain mapping: those of any domain)."""
  if thinking_fraction is None:
    return (None,)
  fractions = (tuple(thinking_fraction.values()) if isinstance(thinking_fraction, Mapping)
               else (thinking_fraction,))
  return tuple(m for m, on in ((True, max(fractions) > 0), (False, min(fractions) < 1)) if on)


def draw_modes(n: int, thinking_fraction: float | Mapping[str, float] | None,
               rng: np.random.Generator, domains: Sequence[str] | None = None) -> list:
  """Each of n prompts' mode: thinking with probability `thinking_fraction` (None: no switch).

  A mapping gives each domain its own fraction; `domains` then names each prompt's domain.
  One uniform is drawn per prompt either way, so the stream of draws does not depend on it.
  """
  if thinking_fraction is None:
    return [None] * n
  u = rng.random(n)
  if not isinstance(thinking_fraction, Mapping):
    return [bool(x < thinking_fraction) for x in u]
  if domains is None or len(domains) != n:
    raise ValueError(f'draw_modes: a per-domain thinking_fraction needs the {n} prompts\' '
                     f'domains (got {None if domains is None else len(domains)})')
  unknown = sorted(set(domains) - set(thinking_fraction))
  if unknown:
    raise ValueError(f'draw_modes: no thinking_fraction for domain(s) {unknown} '
                     f'(given: {sorted(thinking_fraction)})')
  return [bool(x < thinking_fraction[d]) for x, d in zip(u, domains)]


class Rollouts(NamedTuple):
  """G completions of each of n prompts; every per-row list has n * G entries (prompt-major).

  Attributes:
    records: the record of each row.
    modes: the thinking mode of each row.
    completions: decoded completion text of each row (stop token kept).
    samples: the sampler's SampleOutput (numpy).
  """
  records: list
  modes: list
  completions: list
  samples: sampler_lib.SampleOutput


def generate(sampler, params, tokenizer, records: Sequence[dict], modes: Sequence,
             rng, sp: sampler_lib.SamplingParams, group_size: int,
             record_routing: bool = False, clock=step_clock.NULL) -> Rollouts:
  """Samples `group_size` completions of every record's prompt.

  Args:
    sampler: an `rl.sampler.Sampler`.
    params: the policy's params.
    tokenizer: a `foundation.tokenizer.Tokenizer`.
    records: canonical prompt records.
    modes: one thinking mode per record (True, False or None).
    rng: PRNG key for this call.
    sp: sampling parameters.
    group_size: G.
    record_routing: the samples also carry each token's experts (a mixture-of-experts
      policy's routing replay; `Sampler.generate`).
    clock: a `foundation.step_clock.StepClock` timing the prompts' tokenization, the sampler
      (`Sampler.generate`'s parts) and the completions' decoding.

  Returns:
    Rollouts with len(records) * G rows.
  """
  with clock.part('tokenize prompts'):
    template = chat_template.of(tokenizer)
    ids = [tokenizer.encode(prompt_text(r, m, template)) for r, m in zip(records, modes)]
  extra = dict(record_routing=True) if record_routing else {}
  if clock is not step_clock.NULL:
    extra['clock'] = clock
  with clock.part('sampler'):
    out = sampler.generate(params, ids, rng, sp, num_samples=group_size, **extra)
  with clock.part('decode completions'):
    return from_samples(tokenizer, records, modes, out, group_size)


def from_samples(tokenizer, records: Sequence[dict], modes: Sequence, out, group_size: int
                 ) -> Rollouts:
  """The Rollouts of sampled rows (`out`: a SampleOutput, G consecutive rows per record)."""
  if out.tokens.shape[0] != len(records) * group_size:
    raise ValueError(f'from_samples: {out.tokens.shape[0]} rows for {len(records)} records x '
                     f'G={group_size}')
  # Ids past the tokenizer's vocabulary (a model's padded embedding rows) decode to nothing.
  completions = [tokenizer.decode([t for t in out.tokens[i, :int(out.lengths[i])].tolist()
                                   if t < tokenizer.vocab_size])
                 for i in range(out.tokens.shape[0])]
  rep = lambda xs: [x for x in xs for _ in range(group_size)]
  return Rollouts(records=rep(records), modes=rep(modes), completions=completions, samples=out)


# A verifier whose `score` runs a device program spanning every host (a reward
# model's forward on a multi-host mesh) carries this attribute, True: such a
# program is a collective, so every host scores all of that domain's rows with
# the same inputs, and process 0's rewards are the ones every host keeps.
COLLECTIVE = 'scores_collectively'


class Hosts(NamedTuple):
  """The processes that share the scoring of a batch.

  Attributes:
    index: this process's index in [0, count).
    count: the number of processes.
    exchange: this host's payload (bytes) -> every host's payload in host
      order; a collective that every host calls once per `score`.
  """
  index: int
  count: int
  exchange: Callable[[bytes], list]


def processes() -> Hosts:
  """The JAX processes of this run (one process: count 1, nothing exchanged)."""
  return Hosts(jax.process_index(), jax.process_count(), distributed.allgather_bytes)


def groups(rollouts: Rollouts) -> list[range]:
  """Spans of consecutive rows drawn from one record (a prompt's G samples), in row order.

  Verifiers may score a group as a whole (the IF verifier normalises its
  reward-model scores within a group), so a share never splits one.
  """
  out, start = [], 0
  recs = rollouts.records
  for i in range(1, len(recs) + 1):
    if i == len(recs) or recs[i] is not recs[start]:
      out.append(range(start, i))
      start = i
  return out


def owners(rollouts: Rollouts, count: int, collective: Sequence[str] = ()) -> np.ndarray:
  """The host whose reward every row takes: [rows] int32.

  Rows of a `collective` domain belong to host 0 (every host scores them, see
  COLLECTIVE). The other rows' groups are split into `count` contiguous
  shares of as equal a number of groups as can be (the first hosts take one
  more when they do not divide).

  Args:
    rollouts: the batch.
    count: number of hosts.
    collective: domains whose verifier is a collective.

  Returns:
    [rows] host index of each row.
  """
  out = np.zeros(len(rollouts.records), np.int32)
  spans = [g for g in groups(rollouts) if rollouts.records[g.start]['domain'] not in collective]
  for host, share in enumerate(np.array_split(np.arange(len(spans)), count)):
    for j in share:
      out[spans[j].start:spans[j].stop] = host
  return out


def score(rollouts: Rollouts, verifier_of: Callable[[str], object], sample_cls,
          hosts: Hosts | None = None) -> tuple[np.ndarray, list[dict]]:
  """Scores every row once, with its own domain's verifier, every host getting the same rewards.

  With several hosts each scores its share of the groups (`owners`) and the
  shares are exchanged, so every host trains on one reward per rollout and
  takes the same dynamic-filter decisions, even where a verifier's timeout
  fires on one host and not on another. A host whose scoring raises still
  joins the exchange, and then every host raises the same error (never a
  host waiting forever in the next collective).

  Args:
    rollouts: from `generate` (identical on every host).
    verifier_of: domain name -> verifier (has `score(samples) -> [Result]`);
      called for every domain of the batch on every host, in sorted order.
    sample_cls: `verifiers.Sample`.
    hosts: who shares the scoring (default: the JAX processes of this run).

  Returns:
    (rewards [rows] float32, infos [rows] dicts); identical on every host.

  Raises:
    RuntimeError: a verifier returned a wrong number of results, or (several
      hosts) scoring failed on some host, or the hosts' rollouts differ.
  """
  hosts = processes() if hosts is None else hosts
  n = len(rollouts.records)
  by_domain: dict[str, list[int]] = {}
  for i, rec in enumerate(rollouts.records):
    by_domain.setdefault(rec['domain'], []).append(i)
  verifiers = {d: verifier_of(d) for d in sorted(by_domain)}
  if hosts.count == 1:
    return _score_rows(rollouts, by_domain, verifiers, sample_cls, np.ones(n, bool))
  collective = [d for d, v in verifiers.items() if getattr(v, COLLECTIVE, False)]
  owner = owners(rollouts, hosts.count, collective)
  mine = np.flatnonzero(owner == hosts.index)
  scored = (owner == hosts.index) | np.isin([r['domain'] for r in rollouts.records], collective)
  head = {'fingerprint': _fingerprint(rollouts), 'rows': int(mine.size)}
  failure = None
  try:
    rewards, infos = _score_rows(rollouts, by_domain, verifiers, sample_cls, scored)
    body = json.dumps(dict(head, rewards=rewards[mine].tolist(), infos=[infos[i] for i in mine]),
                      default=_jsonable)
  except Exception as e:  # pylint: disable=broad-except
    failure = e
    body = json.dumps(dict(head, error=f'{type(e).__name__}: {e}'))
  got = [json.loads(b) for b in hosts.exchange(body.encode())]
  for h, p in enumerate(got):
    if 'error' in p:
      raise RuntimeError(f'scoring failed on process {h} of {hosts.count} (every process stops '
                         f'here, none trains on partial rewards): {p["error"]}') from failure
  for h, p in enumerate(got):
    if p['fingerprint'] != head['fingerprint'] or p['rows'] != int(np.sum(owner == h)):
      raise RuntimeError(f'process {h} scored other rollouts than process {hosts.index}: the '
                         'hosts sampled different completions (see rl.sampler)')
  rewards = np.zeros(n, np.float32)
  infos = [{} for _ in range(n)]
  for h, p in enumerate(got):
    rows = np.flatnonzero(owner == h)
    rewards[rows] = p['rewards']
    for i, info in zip(rows, p['infos']):
      infos[i] = info
  return rewards, infos


def _score_rows(rollouts: Rollouts, by_domain: dict, verifiers: dict, sample_cls,
                wanted: np.ndarray) -> tuple[np.ndarray, list[dict]]:
  """Scores the `wanted` rows, one batched call per domain (sorted); the rest stay 0 / {}."""
  n = len(rollouts.records)
  rewards = np.zeros(n, np.float32)
  infos: list[dict] = [{} for _ in range(n)]
  for domain in sorted(by_domain):
    rows = [i for i in by_domain[domain] if wanted[i]]
    if not rows:
      continue
    samples = [sample_cls(prompt=verifier_prompt(rollouts.records[i]),
                          completion=rollouts.completions[i],
                          metadata=rollouts.records[i]['metadata']) for i in rows]
    results = verifiers[domain].score(samples)
    if len(results) != len(rows):
      raise RuntimeError(f'verifier of domain {domain!r} returned {len(results)} results for '
                         f'{len(rows)} samples')
    for i, res in zip(rows, results):
      rewards[i] = float(res.reward)
      infos[i] = dict(res.info or {})
  return rewards, infos


def _fingerprint(rollouts: Rollouts) -> int:
  """A checksum of the batch's domains and completions, equal on hosts that sampled alike."""
  text = json.dumps([[r['domain'], c] for r, c in zip(rollouts.records, rollouts.completions)])
  return zlib.crc32(text.encode())


def _jsonable(x):
  """Info values JSON does not take: numpy scalars and arrays as numbers and lists, else text."""
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  if isinstance(x, (set, frozenset)):
    return sorted(x, key=repr)
  return repr(x)
