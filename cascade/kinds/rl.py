"""What the RL kinds (grpo, mopd) share: their config, the curriculum, rollout draws, batches.

An RL step draws `prompts_per_step` prompts from the stage's loader, samples
`group_size` completions of each with the stage's current phase (length cap,
temperature), scores every row with its own domain's verifier (a batch may
mix domains; with several hosts each row is scored once, on one host, and
the rewards exchanged: `rollout.score`), and, with dynamic filtering, refills
past groups whose G rewards are all equal (at most `refill_cap` extra
rounds), the same rounds on every host. Rows of a
truncated completion carry no loss in a phase that filters overlong rollouts.

Every step logs `config.eval.log_samples` of its train rows (0: none) to
samples.jsonl and TensorBoard text (`metrics.Writer.write_samples`): the first
completion of each of the batch's first prompts (past its last prompt, their
second completions, and so on), a choice that draws no randomness and changes
nothing the step trains on. Each carries the stage, the step (numbered as in
metrics.jsonl), the row, its domain, the record's id (None when it has none),
the thinking mode, the prompt as the model saw it (the chat template rendered
in that mode), the decoded completion, its reward, length in tokens and
truncation, whether its group was kept or is padding (`group_kept`), and the
verifier's info; long text is cut (`metrics.SAMPLE_TEXT_CHARS`).

`updates_per_batch` > 1 splits the step's rollout batch into that many
mini-batches (a fixed permutation per step) and takes one optimizer update on
each, PPO-style; the importance ratio against the sampler's log-probs is what
the clipping then acts on (with `tis_cap` or `mismatch_mask`, against the
trainer's own log-probs under the params that sampled the batch, the
sampler/trainer gap corrected separately, see rl.grpo). The default, 1, is
strictly on-policy.

Routing replay (a mixture-of-experts policy): the sampler's and the trainer's
routers may send a token to different experts (numerics, bf16, batch shape),
an off-policy gap the importance ratio does not see. `routing_replay='on'`
has the sampler record every prompt and completion token's experts in each
'moe' sublayer (`Sampler.generate(record_routing=True)`), carries them in the
train batch (`TrainBatch.routing`) and replays them in the policy's training
forward; 'measure' records them and lets the trainer route on its own. Either
way the step logs `routing_mismatch`, the fraction of sampled tokens whose
recorded experts the trainer's routers would not have picked in at least one
'moe' sublayer (and `routing_mismatch_pairs`, of (token, sublayer) pairs). The
KL reference and MOPD's teachers never replay (they are other models). Both
engines record it (the paged one through preemption, shared prompt prefills
and sessions: `rl.engine`), streamed filtering's groups carry it, and an
agentic episode carries it across its turns (`cascade.episodes.generate`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from cascade import rollout
from cascade import schema
from cascade import verifier_errors as errors_lib
from cascade.kinds import base
from foundation import chat_template
from foundation import step_clock
from models import sharding
from rl import batch as batch_lib
from rl import filtering
from rl import grpo
from rl import sampler as sampler_lib


# routing_replay's modes: nothing recorded; recorded and the mismatch logged; also replayed.
ROUTING_REPLAY = ('off', 'measure', 'on')


def _fraction_ok(v) -> bool:
  return base.is_num(v) and 0 <= v <= 1


def _phases_ok(v) -> bool:
  return isinstance(v, (list, tuple)) and all(hasattr(p, 'keys') or isinstance(p, dict)
                                              for p in v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLStageConfig(base.TrainStageConfig,
                    schema.settings(grpo.GrpoConfig, only=('loss_agg',))):
  """An RL stage: rollouts of prompts x G samples per step, scored by domain verifiers.

  Every RL kind takes `loss_agg` ('token' or 'seq_mean_token_mean'), declared with its default
  and check by `rl.grpo.GrpoConfig`.
  """
  RECORDS: ClassVar[str] = 'prompt'
  SAMPLES: ClassVar[bool] = True
  BY_DOMAIN: ClassVar[bool] = True

  prompts_per_step: int = base.field(check=base.int_at_least(1))
  group_size: int = base.field(check=base.int_at_least(1))
  temperature: float = base.field(1.0, check=base.num_in(0, lo_open=True, what='must be > 0'),
                                  convert=float)
  top_p: float = base.field(1.0, check=base.num_in(0, 1, lo_open=True), convert=float)
  top_k: int = base.field(0, check=(lambda v: base.is_int(v) and v >= 0,
                                    'must be an int >= 0 (0 = off)'))
  max_prompt_len: int = base.field(check=base.int_at_least(1))
  max_response_len: int = base.field(check=base.int_at_least(1))
  phases: tuple = base.field(None, check=(_phases_ok, 'must be a list of dicts'))
  # None (no /think switch), one fraction of prompts drawn in thinking mode, or a fraction per
  # domain of the stage ({'math': 1.0, 'chat': 0.0}: a blended stage whose domains differ).
  # (Kept as sorted (domain, fraction) pairs, so the config stays hashable; `mode_fractions`.)
  thinking_fraction: float | tuple | None = base.field(
      None, check=(lambda v: _fraction_ok(v) or (
          isinstance(base.plain(v), dict) and all(_fraction_ok(x) for x in base.plain(v).values())),
                   'must be None (no /think switch), a fraction in [0, 1], or a mapping '
                   'domain -> fraction'), convert=lambda v: (
                       tuple(sorted((str(k), float(x)) for k, x in base.plain(v).items()))
                       if isinstance(base.plain(v), dict) else float(v)))
  dynamic_filter: bool = base.field(True, check=base.BOOL)
  refill_cap: int = base.field(4, check=base.int_at_least(0))
  stream_filter: bool = base.field(False, check=base.BOOL)
  filter_overlong: bool = base.field(False, check=base.BOOL)
  updates_per_batch: int = base.field(1, check=base.int_at_least(1))
  # Mixture-of-experts policies: 'off'; 'measure' (the sampler records each token's experts,
  # the step logs routing_mismatch); 'on' (also replayed in the policy's training forward).
  routing_replay: str = base.field('off', check=base.one_of(ROUTING_REPLAY,
                                                            'routing_replay mode'))
  # Filled from config.model when validated: (M 'moe' sublayers, k experts per token, dtype) of
  # the recorded routing; () when routing_replay is 'off'.
  routing_layout: tuple = base.field((), user=False)

  def check(self, fail):
    if isinstance(self.thinking_fraction, tuple):
      got, want = set(self.mode_fractions), set(self.domains)
      if got != want:
        fail('thinking_fraction', 'a per-domain mapping must name exactly the stage\'s domains '
             f'{sorted(want)}' + (f'; missing {sorted(want - got)}' if want - got else '')
             + (f'; not in the stage: {sorted(got - want)}' if got - want else ''), base.HIDE)
    if self.stream_filter and not self.dynamic_filter:
      fail('stream_filter', 'needs dynamic_filter=True (it is a way of filtering)')
    rows = self.prompts_per_step * self.group_size
    if rows % self.updates_per_batch:
      fail('updates_per_batch', f'must divide prompts_per_step * group_size = {rows}')
    if (rows // self.updates_per_batch) % self.microbatches:
      fail('microbatches', 'must divide prompts_per_step * group_size'
           + (' / updates_per_batch' if self.updates_per_batch > 1 else ''))
    object.__setattr__(self, 'phases', self._resolve_phases(fail))

  def _resolve_phases(self, fail) -> tuple:
    """The curriculum; without phases, one phase covering the stage."""
    base_ph = dict(max_response_len=self.max_response_len, temperature=self.temperature,
                   filter_overlong=self.filter_overlong)
    if not self.phases:
      return (base.Phase(until_step=self.steps, **base_ph),)
    out, prev = [], 0
    for j, p in enumerate(self.phases):
      p = dict(p)
      for k in p:
        if k not in ('until_step',) + tuple(base_ph):
          fail(f'phases[{j}].{k}', f'unknown field (known: until_step, {", ".join(base_ph)})',
               base.HIDE)
      if 'until_step' not in p:
        fail(f'phases[{j}].until_step', 'missing field', base.HIDE)
      until = p['until_step']
      if not base.is_int(until) or until <= prev:
        fail(f'phases[{j}].until_step', 'phases must end at strictly increasing steps '
                                        f'(previous {prev})', until)
      ph = {**base_ph, **{k: p[k] for k in p if k != 'until_step'}}
      if not base.is_int(ph['max_response_len']) or ph['max_response_len'] < 1:
        fail(f'phases[{j}].max_response_len', 'must be an int >= 1', ph['max_response_len'])
      if ph['max_response_len'] > self.max_response_len:
        fail(f'phases[{j}].max_response_len', 'exceeds the stage\'s '
             f'max_response_len={self.max_response_len}', ph['max_response_len'])
      if not base.is_num(ph['temperature']) or ph['temperature'] <= 0:
        fail(f'phases[{j}].temperature', 'must be > 0', ph['temperature'])
      if not isinstance(ph['filter_overlong'], bool):
        fail(f'phases[{j}].filter_overlong', 'must be a bool', ph['filter_overlong'])
      out.append(base.Phase(until_step=until, max_response_len=ph['max_response_len'],
                            temperature=float(ph['temperature']),
                            filter_overlong=ph['filter_overlong']))
      prev = until
    return tuple(out)

  # Whether the kind runs multi-turn episodes (kind 'agentic'); the others refuse agentic domains.
  AGENTIC: ClassVar[bool] = False

  def resolve(self, refs, fail):
    out = super().resolve(refs, fail)
    if not self.AGENTIC:
      for d in self.domains:
        if refs.domains[d].agentic:
          fail('domains', f'domain {d!r} is agentic (it names env {refs.domains[d].env!r}); '
                          "its rollouts are episodes: train it with kind 'agentic'")
    return out

  def default_datasets(self, refs, fail) -> tuple:
    missing = [d for d in self.domains if not refs.domains[d].train]
    if missing:
      fail('datasets', f'not given, and domain {missing[0]!r} has no train dataset')
    # Domains may share a train set (records that name their domain): read it once.
    return tuple(dict.fromkeys(refs.domains[d].train for d in self.domains))

  @property
  def mode_fractions(self) -> float | dict[str, float] | None:
    """`thinking_fraction` as `rollout.draw_modes` takes it (a per-domain one as a dict)."""
    f = self.thinking_fraction
    return dict(f) if isinstance(f, tuple) else f

  def phase_at(self, step: int) -> base.Phase:
    """The curriculum phase in force at `step` (the last phase past its end)."""
    for p in self.phases:
      if step < p.until_step:
        return p
    return self.phases[-1]

  @property
  def longest_response(self) -> int:
    return max(p.max_response_len for p in self.phases)

  @property
  def decay_steps(self) -> int:
    return self.steps * self.updates_per_batch

  def with_model(self, model, sampler, fail):
    del sampler          # either engine records routing
    if self.routing_replay == 'off':
      return self
    if 'moe' not in model.mixers:
      fail('routing_replay', "needs a mixture-of-experts policy (a model with 'moe' layers); "
           f'config.model is a {model.family} model without experts')
    layout = (model.mixers.count('moe'), model.experts_per_token,
              np.dtype(sampler_lib.routing_dtype(model.num_experts)).name)
    return dataclasses.replace(self, routing_layout=layout)

  @property
  def records_routing(self) -> bool:
    """Whether the stage's rollouts record their routing (`routing_replay` on or measure)."""
    return self.routing_replay != 'off'

  def check_lengths(self, max_seq, fail):
    total = self.max_prompt_len + self.max_response_len
    if max_seq is not None and total > max_seq:
      fail('max_response_len', f'max_prompt_len + max_response_len = {total} exceeds the '
                               f"model's max_seq_len={max_seq}")

  def rows_per_step(self):
    return self.prompts_per_step * self.group_size, 'prompts_per_step * group_size'

  def record_filter(self, tokenizer):
    modes = rollout.stage_modes(self.mode_fractions)
    return ((lambda r: rollout.longest_prompt_len(r, tokenizer, modes) <= self.max_prompt_len),
            f'prompts longer than max_prompt_len={self.max_prompt_len}')


def sampler_sizes(stage: RLStageConfig) -> dict:
  """The stage's largest sampler call (all prompts x G rows, the longest phase)."""
  return dict(rows=stage.prompts_per_step * stage.group_size, prompt_len=stage.max_prompt_len,
              max_new_tokens=stage.longest_response, top_p=stage.top_p, top_k=stage.top_k,
              num_samples=stage.group_size)


def abstract_batch(stage: RLStageConfig, mesh, rules, **extra_rows):
  """The RL train batch of one update as ShapeDtypeStructs split over 'batch' (and their
  tokens over 'sequence' on a mesh with a sequence axis).

  Args:
    stage: the stage.
    mesh, rules: the target mesh and its logical rules.
    **extra_rows: name -> 'row' ([B]) or 'token' ([B, L]) extra float32/int32 fields.

  Returns:
    (TrainBatch, description).
  """
  b = stage.prompts_per_step * stage.group_size // stage.updates_per_batch
  length = stage.max_prompt_len + stage.longest_response
  pack = getattr(stage, 'pack_tokens', 0)
  rows = b
  if pack:
    # The largest packed update (`rl.batch.pack`): every sequence at its longest, as many to a
    # row as fit, the row count bucketed as pack buckets it; per-row fields become per-token.
    width = batch_lib.packed_width(pack, length)
    multiple = math.lcm(stage.microbatch_rows, sharding.batch_shards(mesh, rules))
    rows, length = batch_lib.packed_rows(-(-b // (width // length)), multiple), width
  # Each leaf as the train step lays it out: rows over 'batch', tokens over 'sequence' where
  # the mesh has that axis (`sharding.batch_leaf_sharding`).
  sds = lambda shape, dt: jax.ShapeDtypeStruct(
      shape, jnp.dtype(dt), sharding=sharding.batch_leaf_sharding(shape, mesh, rules))
  mat = lambda dt: sds((rows, length), dt)
  vec = mat if pack else (lambda dt: sds((rows,), dt))
  fields = dict(tokens=mat(jnp.int32), positions=mat(jnp.int32), segment_ids=mat(jnp.int32),
                targets=mat(jnp.int32), loss_mask=mat(jnp.float32),
                old_logprobs=mat(jnp.float32), advantages=vec(jnp.float32),
                truncated=vec(jnp.bool_))
  for name, (shape, dt) in extra_rows.items():
    fields[name] = mat(dt) if shape == 'token' else vec(dt)
  if stage.routing_layout:
    m, k, dt = stage.routing_layout
    fields['routing'] = sds((rows, length, m, k), dt)
  upd = f', {stage.updates_per_batch} updates per rollout batch' if stage.updates_per_batch > 1 else ''
  what = (f'{stage.prompts_per_step} prompts x {stage.group_size} = '
          f'{stage.prompts_per_step * stage.group_size} rows x '
          f'{stage.max_prompt_len + stage.longest_response} tokens (longest phase){upd}, ')
  what += (f'packed into at most {rows} rows x {length} tokens, {rows // stage.microbatch_rows} '
           f'microbatch(es) of {stage.microbatch_rows} rows' if pack
           else f'{stage.microbatches} microbatch(es)')
  return batch_lib.TrainBatch(**fields), what


def _pad_prompts(samples: sampler_lib.SampleOutput, width: int) -> sampler_lib.SampleOutput:
  """Left-pads the prompt columns to `width`, so the train batch has one shape per phase."""
  p = samples.prompt_tokens.shape[1]
  if p > width:
    raise ValueError(f'prompt of {p} tokens exceeds max_prompt_len={width}')
  pad = lambda x: np.pad(np.asarray(x),
                         ((0, 0), (width - p, 0)) + ((0, 0),) * (np.ndim(x) - 2))
  routed = ({} if getattr(samples, 'prompt_routing', None) is None
            else dict(prompt_routing=pad(samples.prompt_routing)))
  return samples._replace(prompt_tokens=pad(samples.prompt_tokens),
                          prompt_mask=pad(samples.prompt_mask), **routed)


# Samples of one step that may fail in the sandbox itself before the stage stops.
MAX_SANDBOX_ERROR_FRACTION = 0.1


class Draws:
  """Sampling rounds of one RL step: each draws prompts, samples G each and scores them.

  `verifier_errors`: the stage's count of samples whose verifier raised in its own code
  (`cascade.verifier_errors.VerifierErrors`, made once per stage so it spans its steps; default: this
  step's own).
  """

  # With `stream_filter` on one host, score on a thread while decoding goes on (False: between
  # decode calls, as with several hosts).
  SCORE_THREAD = True

  def __init__(self, ctx, stage: RLStageConfig, loader, step: int, rng, params,
               verifier_errors: errors_lib.VerifierErrors | None = None):
    self.ctx, self.stage, self.loader = ctx, stage, loader
    self.verifier_errors = verifier_errors or errors_lib.VerifierErrors(stage.where)
    self._own_errors0 = self.verifier_errors.errors
    self.rng, self.params = rng, params
    phase = stage.phase_at(step)
    self.sp = sampler_lib.SamplingParams(temperature=phase.temperature, top_p=stage.top_p,
                                         top_k=stage.top_k,
                                         max_new_tokens=phase.max_response_len)
    self.modes_rng = np.random.default_rng([ctx.plan.seed, *stage.seeds_from, step])
    self.rewards, self.lengths, self.truncated, self.domains = [], [], [], []
    self.sandbox_errors = self.scored = 0
    # Every row drawn this step, in draw order: (record, mode, completion, verifier info).
    self.drawn: list[tuple] = []
    self.step = step
    self.sample_s = self.score_s = 0.0
    self._slots0 = self._counters()

  def __call__(self, n: int):
    st = self.stage
    recs = self.loader.next()
    assert len(recs) == n, (len(recs), n)
    modes = rollout.draw_modes(n, st.mode_fractions, self.modes_rng,
                               [r['domain'] for r in recs])
    key = jax.random.fold_in(self.rng, len(self.rewards))
    ro, rewards, infos = self._rollouts(recs, modes, key)
    return self._record(ro, rewards, infos), rewards

  def _record(self, ro, rewards, infos) -> dict:
    """Books scored rollouts (rewards, lengths, `drawn`, the sandbox-error stop) and returns
    their train rows: {'samples', 'domain'}."""
    st = self.stage
    self.verifier_errors.count(ro.records, infos, f'{st.where}: step {self.step + 1}')
    self.sandbox_errors += sum(1 for i in infos if i.get('sandbox_error'))
    self.scored += len(infos)
    if self.sandbox_errors > MAX_SANDBOX_ERROR_FRACTION * self.scored:
      raise base.StageError(
          f'{st.where}: step {self.step}: {self.sandbox_errors} of {self.scored} samples failed '
          'in the sandbox itself (sandbox_error), not in their code; stopping rather than '
          'training on their zero rewards (check the sandbox: bubblewrap, cgroups, disk)')
    self.rewards.append(rewards)
    self.lengths.append(ro.samples.lengths)
    self.truncated.append(ro.samples.truncated)
    self.domains += [r['domain'] for r in ro.records]
    self.drawn += list(zip(ro.records, ro.modes, ro.completions, infos))
    index = self.ctx.domain_index
    domain_idx = np.array([index[r['domain']] for r in ro.records], np.int32)
    return {'samples': _pad_prompts(ro.samples, st.max_prompt_len), 'domain': domain_idx}

  def _rollouts(self, recs, modes, key):
    """Samples G completions of each record and scores them: (rollouts, rewards, infos).

    Subclasses (agentic episodes) replace this; the rollouts need `records`,
    `modes`, `completions` and `samples` (a SampleOutput-like batch).
    """
    clock = getattr(self.ctx, 'clock', None) or step_clock.NULL
    t0 = time.perf_counter()
    ro = rollout.generate(self.ctx.sampler, self.params, self.ctx.tokenizer, recs, modes, key,
                          self.sp, self.stage.group_size,
                          record_routing=self.stage.records_routing, clock=clock)
    t1 = time.perf_counter()
    with clock.part('score'):
      rewards, infos = rollout.score(ro, self.ctx.verifiers.train_verifier, self.ctx.sample_cls)
    self.sample_s += t1 - t0
    self.score_s += time.perf_counter() - t1
    return ro, rewards, infos

  def _indexed(self, n: int):
    """A round as `__call__`, each row also carrying its index in `self.drawn` ('drawn_row')."""
    start = len(self.drawn)
    rows, rewards = self(n)
    return dict(rows, drawn_row=np.arange(start, len(self.drawn))), rewards

  def collect(self):
    """Draws one batch of groups (refilling past all-equal groups when the stage filters).

    Logs a few of its rows (`log_samples`) before returning.

    Returns:
      (rows, rewards, valid, fill metrics).
    """
    # The sampler's rollout copy of the weights (rl.sampler's `rollout_cast` and
    # `rollout_rules`), made once for every round of the step and dropped before the update.
    raw, prepare = self.params, getattr(self.ctx.sampler, 'prepare', None)
    if prepare is not None:
      self.params = prepare(raw)
    try:
      return self._collect()
    finally:
      self.params = raw

  def _collect(self):
    st = self.stage
    if st.dynamic_filter:
      if st.stream_filter:
        f, fill = self._stream_fill()
      else:
        f = filtering.fill_groups(self._indexed, st.prompts_per_step, st.group_size,
                                  max_rounds=1 + st.refill_cap)
        fill = {}
      rows, rewards, valid = dict(f.rows), f.rewards, f.valid
      fill.update(prompts_drawn=f.prompts_drawn, rounds=f.rounds, groups_kept=f.groups_kept)
    else:
      rows, rewards = self._indexed(st.prompts_per_step)
      valid, fill = np.ones(rewards.shape, bool), {}
    drawn_row = rows.pop('drawn_row')
    with (getattr(self.ctx, 'clock', None) or step_clock.NULL).part('sample log'):
      self.log_samples(rows, rewards, valid, drawn_row)
    return rows, rewards, valid, fill

  def _stream_fill(self):
    """Dynamic filtering by oversampling (`stream_filter`): (a `filtering.Filled`, metrics).

    One streaming sampler call (`Sampler.stream`, engine='paged') is fed a
    loader batch of prompts whenever its queue runs dry and the groups still
    running are not expected to fill the batch (at most 1 + `refill_cap`
    batches, the cap of the rounds it replaces). Each group is scored as soon
    as its G rows end, on a scoring thread while decoding goes on (in the
    main thread between decode calls when several hosts exchange rewards, so
    every host scores in the same order), and the call stops, cancelling the
    rows still running, once the first `prompts_per_step` groups with signal
    in feed order are known. The batch does not depend on timing: it is what
    `filtering.fill_groups` keeps from one round of every fed prompt, and each row
    is the row a single `generate` of them would give for this step's key.
    """
    st, ctx = self.stage, self.ctx
    if getattr(ctx.sampler, 'engine', None) != 'paged':
      raise base.StageError(f"{st.where}: stream_filter needs config.sampler.engine='paged' "
                            f'(got {getattr(ctx.sampler, "engine", None)!r})')
    g = st.group_size
    fill = filtering.StreamFill(st.prompts_per_step, g, st.prompts_per_step, 1 + st.refill_cap)
    recs, modes = [], []
    hosts = rollout.processes()

    def next_prompts():
      new = self.loader.next()
      recs.extend(new)
      modes.extend(rollout.draw_modes(len(new), st.mode_fractions, self.modes_rng,
                                      [r['domain'] for r in new]))
      return [ctx.tokenizer.encode(rollout.prompt_text(r, m, chat_template.of(ctx.tokenizer)))
              for r, m in zip(new, modes[-len(new):])]

    def score(groups, samples):
      ro = rollout.from_samples(ctx.tokenizer, [recs[i] for i in groups],
                                [modes[i] for i in groups], samples, g)
      return ro, rollout.score(ro, ctx.verifiers.train_verifier, ctx.sample_cls, hosts)

    def book(groups, scored):
      ro, (rewards, infos) = scored
      start = len(self.drawn)
      rows = self._record(ro, rewards, infos)
      rows['drawn_row'] = np.arange(start, len(self.drawn))
      return rows, rewards

    t0 = time.perf_counter()
    got = filtering.stream_fill(ctx.sampler, self.params, jax.random.fold_in(self.rng, 0),
                                self.sp, fill, next_prompts, score, book,
                                max_prompt_len=st.max_prompt_len, rows=st.prompts_per_step * g,
                                thread=hosts.count == 1 and self.SCORE_THREAD,
                                record_routing=st.records_routing)
    self.sample_s += time.perf_counter() - t0 - got.wait_s
    self.score_s += got.score_s
    return fill.result(), {'rows_cancelled': float(got.rows_cancelled),
                           'rows_unscored': float(got.rows_unscored),
                           'score_wait_s': got.wait_s}

  def log_samples(self, rows, rewards, valid, drawn_row) -> None:
    """Writes `config.eval.log_samples` of the step's train rows through the run's metrics writer
    (none: a context without one, or a process other than the writer)."""
    writer = getattr(self.ctx, 'writer', None)
    if writer is None or not writer.enabled:
      return
    count = self.ctx.plan.eval.log_samples
    if not count:
      return
    writer.write_samples(self.stage, self.step + 1,
                         self.samples(rows, rewards, valid, drawn_row, count))

  def samples(self, rows, rewards, valid, drawn_row, count: int) -> list[dict]:
    """The logged rows of a collected batch: `sample_rows(rows, G, count)`, one dict each.

    Args:
      rows, rewards, valid: as `collect` returns them.
      drawn_row: [rows] each row's index in `self.drawn`.
      count: how many.

    Returns:
      One dict per row: row, domain, id, thinking, reward, length, truncated,
      group_kept, prompt, completion, info (raw: the writer cleans and cuts them).
    """
    out = []
    s = rows['samples']
    for i in sample_rows(len(rewards), self.stage.group_size, count):
      rec, mode, completion, info = self.drawn[int(drawn_row[i])]
      out.append({'row': int(i), 'domain': rec['domain'], 'id': rec.get('id') or None,
                  'thinking': mode, 'reward': float(rewards[i]), 'length': int(s.lengths[i]),
                  'truncated': bool(s.truncated[i]), 'group_kept': bool(valid[i]),
                  'prompt': rollout.prompt_text(rec, mode, chat_template.of(self.ctx.tokenizer)),
                  'completion': completion,
                  'info': info})
    return out

  def _counters(self) -> tuple[int, int]:
    s = self.ctx.sampler
    return int(getattr(s, 'decode_slots', 0)), int(getattr(s, 'generated_tokens', 0))

  def accounting(self) -> dict:
    """The step's sampling cost: decode slots paid for vs tokens generated (a finished row's
    slot idles until its chunk's longest row ends), and the scoring time."""
    slots, made = (a - b for a, b in zip(self._counters(), self._slots0))
    if not slots:
      return {}
    waste = 1.0 - made / slots
    return {'decode_slots': float(slots), 'generated_tokens': float(made),
            'decode_waste': waste,
            # Sampling time spent on idle slots (an estimate: time in proportion to slots).
            'sample_idle_s': self.sample_s * waste}

  def metrics(self) -> dict:
    r = np.concatenate(self.rewards)
    out = {'reward_mean': float(np.mean(r)), 'reward_std': float(np.std(r)),
           'response_len': float(np.mean(np.concatenate(self.lengths))),
           'truncated_frac': float(np.mean(np.concatenate(self.truncated))),
           'sample_s': self.sample_s, 'score_s': self.score_s,
           'temperature': self.sp.temperature, 'max_response_len': self.sp.max_new_tokens,
           'sandbox_errors': float(self.sandbox_errors),
           'verifier_errors': float(self.verifier_errors.errors - self._own_errors0),
           **self.accounting()}
    doms = np.array(self.domains)
    if len(set(self.domains)) > 1:
      for d in sorted(set(self.domains)):
        out[f'reward_mean/{d}'] = float(np.mean(r[doms == d]))
    return out


def update_accounting(batches) -> dict:
  """The update's padding: token slots of the train batch(es) (rows x width) that hold no
  token. `batches`: one TrainBatch or the step's list of them."""
  if hasattr(batches, 'segment_ids'):              # one batch (a NamedTuple, so test first)
    batches = [batches]
  real = sum(float(np.sum(np.asarray(b.segment_ids) > 0)) for b in batches)
  slots = sum(float(np.asarray(b.segment_ids).size) for b in batches)
  return {'update_tokens': real, 'update_slots': slots,
          'update_waste': 1.0 - real / max(slots, 1.0)}


def sample_rows(rows: int, group_size: int, count: int) -> list[int]:
  """Which of a batch's prompt-major rows are logged: rows 0, G, 2G, ... (the first completion of
  each prompt), then 1, G + 1, ... (the second ones) and so on, `count` of them at most."""
  prompts = rows // group_size
  return [(k % prompts) * group_size + k // prompts for k in range(min(count, rows))]


def loss_valid(stage: RLStageConfig, step: int, rows, valid) -> np.ndarray:
  """Rows that carry loss: the filled groups, minus truncated rows in an overlong-filter phase."""
  if stage.phase_at(step).filter_overlong:
    valid = valid & ~np.asarray(rows['samples'].truncated, bool)
  return valid


def split_updates(stage: RLStageConfig, step: int, seed: int, batch) -> list:
  """The step's rollout batch as `updates_per_batch` mini-batches (one: the batch itself)."""
  k = stage.updates_per_batch
  if k == 1:
    return [batch]
  b = batch.tokens.shape[0]
  perm = np.random.default_rng([seed, *stage.seeds_from, step, 7]).permutation(b)
  return [batch_lib.take_rows(batch, np.sort(perm[i::k])) for i in range(k)]
