"""The run's data: the held-out and validation sets in memory, each training stage's stream.

Held-out and validation sets are small: they are read whole and checked before
the first step. Training datasets may be any size: they stay on disk as a glob
of shards (`cascade.data.shards`), read by position as batches are drawn. Before the
first step their first `CHECKED_PREFIX` records are read and checked, so a
malformed file (named by file and line) stops the run before anything trains;
a malformed record further in is skipped when drawn, counted and logged.

Each stage draws from a `cascade.data.readers.Stream` over its datasets: records of its
domains, made into the stage's items (`stage.tokenize`) and filtered
(`stage.record_filter`). With a cache directory, that work is done once per
position and kept (`cascade.data.token_cache`): a run or resume that finds it
tokenizes nothing. Prompts too long for the evaluation are dropped with a
warning that counts them; a stage or evaluation set left with no records is an
error.

A stage's data files are pinned when it starts (`StageData.pin`: each shard's path, size and
content digest, `cascade.data.shards.identity`, kept in progress.json): a stage that resumes from a
checkpoint, whose data position counts rows of those files, is refused in one line naming the
shard that is gone, new, or holds other bytes since (a rewrite in place at the same size and
modification time included), rather than resumed on other rows. Checking costs a listing and
a stat per shard where nothing changed (a shard is read again only when its stamp changed,
e.g. on another host; on gs:// never).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Callable

from cascade import config as config_lib
from cascade import rollout
from cascade.data import readers
from cascade.data import shards
from cascade.data import token_cache
from foundation import paths

# Records of each streamed training dataset read and checked before the first step.
CHECKED_PREFIX = 1000
# Seconds of hashing after which `StageData.pin` says how long it took.
SLOW_PIN_S = 10.0


def _make_batch(tokenize_batch, domains, filt, recs: list) -> list:
  """A stage's `make` over many records at once (the same items, None where `make` gives
  None): the records of its domains tokenized in one call (`tokenize_batch`), then filtered."""
  keep = [k for k, rec in enumerate(recs) if domains is None or rec['domain'] in domains]
  out = [None] * len(recs)
  for k, item in zip(keep, tokenize_batch([recs[k] for k in keep])):
    out[k] = item if filt is None or filt[0](item) else None
  return out


def _prompt_key(record: dict) -> str:
  return json.dumps(record['messages'], sort_keys=True, ensure_ascii=True)


def _check_disjoint(domain: str, dom, validation: list, held_out: list) -> None:
  """A validation prompt that is also a held-out prompt would make selection peek at the test."""
  seen = {_prompt_key(r) for r in held_out}
  shared = [r for r in validation if _prompt_key(r) in seen]
  if shared:
    raise readers.DataError(
        f'config.domains.{domain}.validation={dom.validation!r}: {len(shared)} of its '
        f'{len(validation)} prompts are also held-out prompts of {dom.eval!r} (e.g. record '
        f'{shared[0]["id"]!r}); the validation set must be disjoint from it')


def changed(recorded: list, now: list) -> str:
  """'' when the shard identities `now` are those `recorded` (same files, sizes and digests),
  else which shard differs and how (one clause naming it)."""
  have = {r['path']: r for r in now}
  for was in recorded:
    p, cur = was['path'], have.get(was['path'])
    if cur is None:
      return f'{p} (one of its shards, {was["size"]} bytes) is gone'
    if cur['size'] != was['size']:
      return f'{p} holds {cur["size"]} bytes, not the {was["size"]} it held'
    if cur['digest'] != was['digest']:
      return (f'{p} holds other bytes (same size; digest {cur["digest"][:20]}, was '
              f'{was["digest"][:20]})')
  old = {r['path'] for r in recorded}
  new = [r['path'] for r in now if r['path'] not in old]
  return f'{new[0]} is a shard it did not have' if new else ''


def _fit(recs: list, ok: Callable[[dict], bool], what: str, why: str) -> list:
  kept = [r for r in recs if ok(r)]
  if len(kept) < len(recs):
    print(f'WARNING: {what}: dropped {len(recs) - len(kept)} of {len(recs)} records ({why})',
          flush=True)
  if not kept:
    raise ValueError(f'{what}: no records left after dropping {why}')
  return kept


class StageData:
  """The evaluation sets, and each training stage's stream of records.

  Args:
    plan: the validated plan.
    tokenizer: the run's tokenizer (prompt lengths, SFT examples).
    check_metadata: (domain, metadata, where) -> None, raising on records a
      domain's verifiers cannot score.
    cache_dir: where stages' prepared data are kept (local or gs://); None: no
      cache, items are made as they are drawn.
    hosts: the processes sharing the reading (`cascade.data.readers.Stream`); None: one.
  """

  def __init__(self, plan: config_lib.Plan, tokenizer, check_metadata,
               cache_dir: str | None = None, hosts=None):
    self.plan, self.tokenizer = plan, tokenizer
    self._check_metadata = check_metadata
    self.cache_dir, self.hosts = cache_dir, hosts
    # Shard indexes and decompressed copies: local disk (memory-mapped); with several
    # processes, each builds its share of them and publishes it to the shared cache.
    self.index_dir = (paths.join(cache_dir, 'shards')
                      if cache_dir and not paths.is_remote(cache_dir) else None)
    self.shared_index_dir = paths.join(cache_dir, 'shards') if cache_dir else None
    self._records: dict[str, list] = {}      # read whole: evaluation and validation sets
    self._sources: dict[str, object] = {}    # by position: training sets
    self._streams: dict[str, readers.Stream] = {}
    self.eval_sets: dict[str, list] = {}
    self.validation_sets: dict[str, list] = {}

  def load(self) -> None:
    """Reads the evaluation sets, opens and checks the training sets, and makes (or finds)
    each stage's prepared data; errors name file and line."""
    plan = self.plan
    domains = list(plan.domains)
    whole = {n for d in plan.domains.values() for n in (d.eval, d.validation) if n}
    streamed = ({n for s in plan.stages for n in s.datasets}
                | {d.train for d in plan.domains.values() if d.train})
    for name, spec in sorted(plan.datasets.items()):
      if name in whole:
        self._records[name] = readers.load(spec, domains=domains,
                                            check_metadata=self._check_metadata)
      elif name in streamed:
        src = readers.open_dataset(spec, self.index_dir, domains=domains,
                                    check_metadata=self._check_metadata,
                                    shared_dir=self.shared_index_dir, hosts=self.hosts)
        for i in range(min(CHECKED_PREFIX, len(src))):
          src[i]  # pylint: disable=pointless-statement
        self._sources[name] = src
    for d, dom in sorted(plan.domains.items()):
      ev = plan.eval_of(d)
      self.eval_sets[d] = self._prompts(dom.eval, d, ev, ev.num_prompts, 'eval set')
      if dom.validation:
        self.validation_sets[d] = self._prompts(dom.validation, d, ev, ev.validation_prompts,
                                                'validation set')
        _check_disjoint(d, dom, self.validation_sets[d], self.eval_sets[d])
    for st in plan.stages:
      if st.datasets:
        self.stage_records(st)

  def pin(self, stage, recorded: list | None, resuming: bool,
          log: Callable[[str], None] = print) -> list:
    """The identity of `stage`'s data files now (`cascade.data.shards.identity`, shard by shard,
    for progress.json; TFDS datasets are prepared data, not files, and are left out), checked
    against `recorded`, what the stage started with, when it resumes from a checkpoint.

    A shard whose stamp is the recorded one is not read; the processes split the others.

    Args:
      stage: the stage's config.
      recorded: the identities recorded when the stage started (None: none were).
      resuming: the stage resumes from a checkpoint (its data position counts rows of the
        recorded files); a resuming stage with no record is warned about and recorded.
      log: where the warning goes.

    Returns:
      The identities.

    Raises:
      DataError: the stage resumes and a shard is gone, new, or holds other bytes (one line
        naming it); or a shard cannot be read.
    """
    advice = ('put the data back as it was, or rerun the stage from its start in a new '
              '--workdir (--fork_from=<this workdir> copies its finished stages)')
    specs = [self.plan.datasets[name] for name in stage.datasets]
    try:
      files = [f for spec in specs if spec.path for f in shards.expand(spec.path)]
    except readers.DataError as e:
      if resuming and recorded:
        raise readers.DataError(f'{stage.where} resumes from a checkpoint, but {e}: {advice}'
                                 ) from None
      raise
    known = {r['path']: r for r in recorded or []}
    count, index = (1, 0) if self.hosts is None else (self.hosts.count, self.hosts.index)
    mine, error, t0 = {}, None, time.perf_counter()
    try:
      for j in range(index, len(files), count):
        mine[j] = shards.identity(files[j], known.get(files[j]))
    except readers.DataError as e:
      error = str(e)
    secs = time.perf_counter() - t0
    if secs >= SLOW_PIN_S:        # the shards were read: say what the wait was
      log(f'{stage.where}: pinned the identity of its data files in {secs:.0f} s '
          f'({len(mine)} shards{"" if count == 1 else " on this process"}; an unchanged '
          'shard is not read again)')
    if count > 1:      # every process learns every identity, or the first error
      got = [json.loads(b) for b in self.hosts.exchange(
          json.dumps({'ids': mine, 'error': error}).encode())]
      error = next((g['error'] for g in got if g['error']), None)
      mine = {int(j): r for g in got for j, r in g['ids'].items()}
    if error:
      raise readers.DataError(f'{stage.where}: {error}' if resuming and recorded else error)
    now = [mine[j] for j in range(len(files))]
    if resuming and recorded is None:
      log(f'WARNING: {stage.where}: no record of the data files it started with (a workdir '
          'from before they were recorded, or a rebuilt progress.json): it resumes unchecked '
          'against them, and they are recorded now')
    elif resuming:
      why = changed(recorded, now)
      if why:
        raise readers.DataError(f'{stage.where} resumes from a checkpoint, but since it '
                                 f'started {why}: its data position would read other rows; '
                                 f'{advice}')
    return now

  def _source(self, name: str):
    return self._records[name] if name in self._records else self._sources[name]

  def _prompts(self, dataset: str, domain: str, ev, n: int, what: str) -> list:
    """The domain's records of `dataset` that fit `ev.max_prompt_len` in every eval mode, cut to n."""
    modes = tuple(m for e in ev.modes
                  for m in rollout.stage_modes(None if e is None else float(e)))
    recs = [r for r in self._records[dataset] if r['domain'] == domain]
    recs = _fit(recs, lambda r: rollout.longest_prompt_len(r, self.tokenizer, modes)
                <= ev.max_prompt_len, f'{what} of domain {domain!r}',
                f'prompts longer than config.eval.max_prompt_len={ev.max_prompt_len}')
    return recs[:n] if n else recs

  def stage_records(self, stage) -> readers.Stream:
    """The stage's stream: its datasets' records by position, its domains' only (for prompt
    data), made into its items and filtered by the kind; from the prepared cache when there
    is a cache directory (prepared there first if missing)."""
    if stage.name in self._streams:
      return self._streams[stage.name]
    parts = [self._source(ds) for ds in stage.datasets]
    source = parts[0] if len(parts) == 1 else readers.Concat(parts)
    domains = set(stage.domains) if stage.BY_DOMAIN else None
    tokenize = stage.tokenize(self.tokenizer)
    filt = stage.record_filter(self.tokenizer)
    whys = ([filt[1]] if filt else []) + ([f'records of domains other than '
                                           f'{", ".join(sorted(domains))}'] if domains else [])
    why = '; '.join(whys)

    def make(i, rec):
      del i
      if domains is not None and rec['domain'] not in domains:
        return None
      item = rec if tokenize is None else tokenize(rec)
      return item if filt is None or filt[0](item) else None

    tokenize_batch = stage.tokenize_batch(self.tokenizer) if tokenize is not None else None
    if tokenize_batch is not None:
      make.batch = functools.partial(_make_batch, tokenize_batch, domains, filt)

    if self.cache_dir and (tokenize is not None or filt is not None):
      specs = [self.plan.datasets[ds] for ds in stage.datasets]
      stream = token_cache.stream(self.cache_dir, stage, self.tokenizer, specs, source, make,
                                  tokenize is not None, why, self.hosts, self.index_dir)
    else:
      stream = readers.Stream(source, make, why, stage.where, self.hosts)
    self._streams[stage.name] = stream
    return stream
