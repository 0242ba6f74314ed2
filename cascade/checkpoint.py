"""Checkpoints and the workdir's bookkeeping: Orbax per stage, progress.json, the config guard.

Workdir layout:

  lock.json                   the run writing here (cascade.lock: one writer per workdir)
  config.json                 the config this workdir runs (and its hash); config.<hash>.json:
                              one an allowed config change replaced, or one whose run
                              stopped before it took a step (`guard_config`)
  progress.json               completed stages and the evaluation rows so far; the config's hash
                              (a second copy of config.json's) and each stage's data files
                              (`cascade.data.stage_data`: what a resumed stage is checked against),
                              the validation ledger between stage ends (`cascade.ledger`)
  stages/<idx>_<name>/ckpt/   Orbax CheckpointManager: <step>/{state, meta, checksums.json}
  stages/<idx>_<name>/hf/     the stage's final policy as HF safetensors (+ checksums.json)
  stages/<idx>_<name>/corrupt/  damaged steps and exports, moved aside
  superseded/<hash>.<time>/   stage directories an allowed config change made stale
  results.{json,md,png}       the stage x domain matrix (cascade.evaluation)

A checkpoint holds `state` (a pytree: params, optimizer state, step; saved
with `StandardSave`, restored sharded onto the abstract target) and `meta`
(JSON: step, stage index and name, data-iterator state; the PRNG key is
part of the state).
Orbax finalises a step directory atomically (it writes to a temporary
directory and renames), so a run killed while saving leaves the previous
step intact; each step is then sealed (its checksums written,
`cascade.checksums`) as soon as Orbax has finalised it, and only a sealed step
is ever restored. A step that is damaged afterwards (truncated or deleted
files, or bytes changed in place, which its checksums catch) or was never
sealed (a kill between Orbax's finalisation and the seal) is moved aside to
`stages/<...>/corrupt/` with a warning, and the previous step is used
instead. A progress.json that cannot be read is moved aside and rebuilt (the
stages resume from their checkpoints); a config.json that cannot be read is
refused, and one that is missing is replaced only by the config whose hash
progress.json records.

Every path goes through `foundation.paths`, so the workdir may be local or
`gs://...`. Every JSON/text file here is written whole (a local temporary file
renamed, or one object upload), so a reader never sees half a file; Orbax
marks a finished step on an object store with a commit file instead of a
rename. Only process 0 writes the JSON files.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any, Callable, Mapping

import jax
import orbax.checkpoint as ocp
from absl import logging

from cascade import checksums
from cascade import metrics as metrics_lib
from cascade import schema
from foundation import paths


def is_writer() -> bool:
  """Process 0 writes logs, JSON and exports; Orbax saves are collective."""
  return jax.process_index() == 0


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` to `path` whole (`paths.write_text`), on process 0 only."""
  if is_writer():
    paths.write_text(path, text)


def atomic_write_json(path: str, obj: Any) -> None:
  """Writes `obj` as JSON to `path` whole, on process 0 only."""
  if is_writer():
    paths.write_json(path, obj)


def read_json(path: str, default: Any = None) -> Any:
  """The JSON in `path`, or `default` when there is none."""
  return paths.read_json(path, default)


def read_state_json(path: str, default: Any, keys: tuple[str, ...] = (), *, rebuild: bool,
                    then: str = '') -> dict:
  """A run-state JSON object (progress.json, config.json), checked as it is read.

  Args:
    path: the file.
    default: what an absent file reads as.
    keys: fields the object must have.
    rebuild: a damaged file (not JSON, not an object, a field missing) is moved aside to
      `<path>.damaged.<time>` with a one-line warning and reads as `default`; when False it is
      refused instead.
    then: what the warning says happens next.

  Returns:
    The object.

  Raises:
    WorkdirError: the file is damaged and `rebuild` is False (one line naming it).
  """
  if not paths.exists(path):
    return default
  try:
    obj = json.loads(paths.read_text(path))
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
      raise ValueError(f'not a JSON object with {", ".join(keys) or "fields"}')
  except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
    why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    if not rebuild:
      raise WorkdirError(f'{path} is damaged ({why}); restore it from a copy, or start afresh '
                         'in a new --workdir') from None
    dest = f'{path}.damaged.{int(time.time())}'
    print(f'WARNING: {path} is damaged ({why}); moved to {dest}'
          + (f', {then}' if then else ''), flush=True)
    if is_writer():
      paths.copy_file(path, dest)
      paths.remove(path)
    return default
  return obj


# Fields that do not change what a run computes, so a resumed run may differ in them (a program
# loaded from the compilation cache is the program the compiler would have made; where metrics
# are logged besides TensorBoard).
HARMLESS_TOP = ('allow_config_change', 'hardware', 'prepare', 'compilation_cache', 'logging')
# The divergence thresholds only decide whether a run stops: a run that goes on computes what it
# would have computed under any other thresholds (rollbacks, which retrain, are not harmless).
HARMLESS_NESTED = {'ckpt': ('keep', 'checksums'), 'eval': ('log_samples', 'eval_every'),
                   'divergence': ('max_bad_steps', 'min_loss', 'max_loss', 'max_grad_norm',
                                  'max_update_ratio')}


def config_for_hash(config) -> dict:
  """The config (its plain-dict form, `Plan.source`, or a ConfigDict) without the harmless
  fields above."""
  d = schema.as_dict(config)
  d = {k: v for k, v in d.items() if k not in HARMLESS_TOP}
  for section, keys in HARMLESS_NESTED.items():
    if isinstance(d.get(section), dict):
      d[section] = {k: v for k, v in d[section].items() if k not in keys}
      if not d[section]:  # A section of harmless fields only is as if absent.
        del d[section]
  return d


def config_hash(config) -> str:
  """sha256 (16 hex digits) of the config minus the harmless fields."""
  canon = json.dumps(config_for_hash(config), sort_keys=True, default=str)
  return hashlib.sha256(canon.encode()).hexdigest()[:16]


def stage_dir(workdir: str, stage) -> str:
  """`workdir/stages/<idx>_<name>`: a stage's checkpoints and its HF export."""
  return paths.join(workdir, 'stages', f'{stage.index:02d}_{stage.name}')


class WorkdirError(ValueError):
  """The workdir belongs to a run of a different config."""


class CheckpointError(RuntimeError):
  """A checkpoint the run needs cannot be restored and nothing can stand in for it."""


def guard_config(workdir: str, config, allow_change: bool = False) -> str:
  """Refuses to run a workdir that holds a different config's run; records this config.

  A config.json whose run stopped before it took a step (`run_started` finds nothing: a
  failed start, such as a wrong mesh or a missing sandbox) does not hold the workdir: a
  different config takes it over, saying so, and the old record is kept as
  config.<old hash>.json.

  The hash is also kept in progress.json, so a config.json that went missing cannot be
  adopted by another config: when the workdir's run took a step, only the config whose hash
  progress.json records may write config.json again; any other config, or any config when
  progress.json records none, is refused (allow_change too: what to redo cannot be known
  without the old config).

  Args:
    workdir: the run's directory.
    config: the config about to run, as a plain dict (`Plan.source`; a ConfigDict is
      converted).
    allow_change: accept a different config (the old one is kept beside it as
      config.<old hash>.json) and redo what it changes (`_redo_changed`).

  Returns:
    The config hash.

  Raises:
    WorkdirError: the workdir ran a different config and `allow_change` is False, or its
      config.json is missing and progress.json records another config's hash (or none).
  """
  path = paths.join(workdir, 'config.json')
  new = config_hash(config)
  old = read_state_json(path, None, ('hash', 'config'), rebuild=False)
  if old is None:
    _check_missing_config(workdir, path, new)
  elif old.get('hash') != new:
    started = run_started(workdir)
    if not allow_change and started:
      raise WorkdirError(
          f'{workdir} holds a run of a different config (hash {old.get("hash")} vs {new}; '
          f'{started}); use a new --workdir, or pass --config.allow_config_change=True to '
          'continue this run with the new config')
    if is_writer():
      paths.copy_file(path, paths.join(workdir, f'config.{old.get("hash")}.json'))
    if started:
      logging.warning('workdir %s: config changed (%s -> %s); continuing as asked',
                      workdir, old.get('hash'), new)
      _redo_changed(workdir, old['config'], config, old['hash'])
    elif is_writer():
      print(f'{workdir}: its run of config {old.get("hash")} stopped before its first step '
            f'(no step, checkpoint or evaluation); config {new} takes the workdir over (the old '
            f'record is config.{old.get("hash")}.json)', flush=True)
  if old is None or old.get('hash') != new:
    atomic_write_json(path, {'hash': new, 'config': json.loads(json.dumps(
        schema.as_dict(config), default=str))})
  _record_hash(workdir, new)
  return new


def recorded_hash(workdir: str) -> str:
  """The config hash `workdir`'s progress.json records ('' when none, or when it cannot be
  read)."""
  try:
    rec = read_json(paths.join(workdir, 'progress.json'), {})
  except (ValueError, UnicodeDecodeError):
    return ''
  return (rec.get('config') or '') if isinstance(rec, dict) else ''


def _check_missing_config(workdir: str, path: str, new: str) -> None:
  """Refuses config `new` for a workdir whose config.json is missing but whose run took a step,
  unless progress.json records `new` as that run's config (one WorkdirError line)."""
  started = run_started(workdir)
  if not started:
    return
  recorded = recorded_hash(workdir)
  if recorded == new:
    if is_writer():
      print(f'{workdir}: config.json was missing; progress.json records this config ({new}), '
            'so it is written again', flush=True)
    return
  if recorded:
    raise WorkdirError(
        f'{path} is missing, and {workdir} holds a run of config {recorded} (progress.json '
        f'records it), not of this config {new}: run this config in a new --workdir (with '
        f'--fork_from={workdir} to reuse the stages they share once its config.json is back), '
        'or put that run\'s config.json back to resume it')
  raise WorkdirError(
      f'{path} is missing, and {workdir} holds a run ({started}) whose config nothing else '
      f'records, so this config {new} cannot be checked against it: put its config.json back, '
      'or run this config in a new --workdir')


def _record_hash(workdir: str, new: str) -> None:
  """Keeps config.json's hash in progress.json too (created with no stage or row when absent);
  a progress.json that cannot be read is left to `Progress`, which rebuilds it with the hash."""
  path = paths.join(workdir, 'progress.json')
  try:
    rec = read_json(path, {'done': {}, 'rows': []})
  except (ValueError, UnicodeDecodeError):
    return
  if isinstance(rec, dict) and rec.get('config') != new:
    atomic_write_json(path, {'config': new, **{k: v for k, v in rec.items() if k != 'config'}})


def run_started(workdir: str) -> str:
  """What in `workdir` shows that a run there took a step ('' when nothing does).

  A finished stage or an evaluation row in progress.json (or a progress.json that cannot be
  read), any file under stages/ (a checkpoint, even a partial one, an export, a forked stage),
  a logged step in metrics.jsonl, samples, results, or stages an allowed config change
  superseded. What a failed start leaves (config.json, lock.json, an empty metrics log,
  TensorBoard files with no step, the compilation cache) is not.
  """
  progress = paths.join(workdir, 'progress.json')
  if paths.exists(progress):
    try:
      rec = json.loads(paths.read_text(progress))
    except (ValueError, UnicodeDecodeError):
      return 'its progress.json cannot be read'
    if not isinstance(rec, dict) or rec.get('done') or rec.get('rows'):
      return 'its progress.json records finished stages or evaluation rows'
  stages = paths.join(workdir, 'stages')
  if paths.isdir(stages):
    first = next(paths.files_under(stages), None)
    if first is not None:
      return f'it holds {paths.join(stages, first)}'
  log = paths.join(workdir, 'metrics.jsonl')
  if paths.exists(log):
    with paths.open_read(log) as f:
      if f.read(1):
        return 'its metrics.jsonl logs steps'
  for name in ('samples.jsonl', 'results.json', 'superseded'):
    if paths.exists(paths.join(workdir, name)):
      return f'it holds {name}'
  return ''


def _redo_changed(workdir: str, old: dict, config, old_hash: str) -> None:
  """Forgets what a config change makes stale, so the run redoes it (allow_config_change).

  A change to any section but the stages (model, data, evaluation, seed...)
  affects every stage and the initial row; otherwise the first stage that
  differs (a changed, inserted or removed one) and all after it are affected,
  as each starts from the policy the one before it left. The affected stages'
  progress entries and matrix rows are dropped and their directories
  (checkpoints, export) moved to superseded/<old hash>.<time>/, so each is trained and
  evaluated again from its start; the rows before keep the hash of the config
  they were computed with (results.json "configs").
  """
  canon = lambda c: json.loads(json.dumps(config_for_hash(c), default=str))
  a, b = canon(old), canon(config)
  old_stages, new_stages = a.pop('stages', None) or [], b.pop('stages', None) or []
  first = 0 if a != b else next(
      (i for i, (x, y) in enumerate(zip(old_stages, new_stages)) if x != y),
      min(len(old_stages), len(new_stages)))
  stale = {i: s.get('name') for i, s in enumerate(old_stages) if i >= first}
  # config.guard's repair stages of stale stages are stale too.
  stale.update({(i, 'repair'): repair_name(n) for i, n in list(stale.items())})
  progress = Progress(workdir)
  gone = [n for n in stale.values() if n in progress.done or progress.row(n) is not None]
  init_stale = first == 0 and any(r.get('index') == -1 for r in progress.rows)
  if not gone and not init_stale:
    return
  where = paths.join(workdir, 'superseded', f'{old_hash}.{int(time.time())}')
  print(f'{workdir}: the config change affects stage {first} '
        f'{new_stages[first]["name"] if first < len(new_stages) else "(removed)"!r} and after: '
        f'redoing {", ".join(gone + (["the initial row"] if init_stale else []))}; their old '
        f'checkpoints and exports are in {where}', flush=True)
  for name in gone:
    progress.done.pop(name, None)
  progress.rows = [r for r in progress.rows if r['stage'] not in stale.values()
                   and not (init_stale and r.get('index') == -1)]
  progress.ledger = [e for e in progress.ledger if e['stage'] not in stale.values()]
  if is_writer():
    for i, name in stale.items():
      rel = _stage_rel(workdir, name, i if isinstance(i, int) else i[0])
      d = paths.join(workdir, rel)
      if paths.isdir(d):
        paths.move_tree(d, paths.join(where, rel.split('/')[-1]))
  progress.save()


def repair_name(stage_name: str) -> str:
  """The name of the stage config.guard's action='repair' inserts after `stage_name`."""
  return f'{stage_name}_repair'


def _stage_rel(workdir: str, name: str, index: int) -> str:
  """`stages/<idx>_<name>` of stage `name` in `workdir` (found by name: repair stages shift
  the positions), or the one position `index` gives where there is none."""
  d = paths.join(workdir, 'stages')
  if paths.isdir(d):
    for sub in sorted(paths.listdir(d)):
      idx, _, rest = sub.partition('_')
      if idx.isdigit() and rest == name:
        return paths.join('stages', sub)
  return paths.join('stages', f'{index:02d}_{name}')


def _without_stages(config: dict) -> dict:
  return {k: v for k, v in config_for_hash(config).items() if k != 'stages'}


def fork(source: str, workdir: str, config) -> list[str] | None:
  """Copies into a new run the stages it shares with the run in `source` (an ablation's head).

  The shared head is the longest prefix of stages that are identical in both
  configs (same fields, same positions) and complete in `source`, provided
  every other section of the two configs is the same (model, data, domains,
  evaluation, sampler, seed...; the harmless fields aside): then the stages
  would compute what they computed there. Their checkpoints and exports
  (`stages/<idx>_<name>`), their progress entries and matrix rows (and the
  initial policy's row), and their metrics.jsonl records are copied; the run
  then resumes after them, as from its own. Each copied stage's progress
  entry records `forked_from`.

  Args:
    source: the workdir of a finished or partial run.
    workdir: the new run's directory (no completed stage of its own yet).
    config: the new run's config as a plain dict (`Plan.source`; a ConfigDict is converted).

  Returns:
    The names of the copied stages (empty: nothing shared), or None when `workdir` already
    has progress of its own (a rerun of the forked command: it resumes, nothing is copied).

  Raises:
    WorkdirError: `source` holds no run, or its other sections differ (named).
  """
  try:
    theirs = read_state_json(paths.join(source, 'config.json'), None, ('hash', 'config'),
                             rebuild=False)
  except WorkdirError as e:
    raise WorkdirError(f'--fork_from={source}: {e}; nothing was copied') from None
  if not theirs:
    raise WorkdirError(f'--fork_from={source}: no run there (no config.json)')
  mine = json.loads(json.dumps(schema.as_dict(config), default=str))
  a, b = _without_stages(mine), _without_stages(theirs['config'])
  differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  if differ:
    raise WorkdirError(f'--fork_from={source}: its config differs in {", ".join(differ)}; '
                       'only a run with the same sections but the stages can be forked')
  own = Progress(workdir)
  if own.done or own.rows:       # a rerun of the forked command resumes its own progress
    return None
  try:
    src = Progress(source, rebuild=False)
  except WorkdirError as e:
    raise WorkdirError(f'--fork_from={source}: {e}; nothing was copied') from None
  shared = []
  for i, (x, y) in enumerate(zip(mine.get('stages') or [], theirs['config'].get('stages') or [])):
    if x != y or x.get('name') not in src.done:
      break
    shared.append((i, x['name']))
    if repair_name(x['name']) in src.done:   # config.guard's repair of it ran (or was skipped)
      shared.append((i, repair_name(x['name'])))
  # A stage's directory is named by its position in the plan (config.guard's repair stages
  # shift the positions of those after them), so it is found by its name.
  rels = [_stage_rel(source, name, i) for i, name in shared]
  for rel in rels:               # every process checks, so they all refuse together
    _check_forkable(source, rel)
  if not shared or not is_writer():
    return [name for _, name in shared]
  names = {name for _, name in shared}
  log = paths.join(source, 'metrics.jsonl')
  keep = [rec for rec in (metrics_lib.read_records(log) if paths.exists(log) else [])
          if rec.get('stage') in names or rec.get('eval') in names
          or ('eval' in rec and rec.get('row') == -1)]
  try:
    for rel in rels:
      paths.copy_tree(paths.join(source, rel), paths.join(workdir, rel))
    paths.write_text(paths.join(workdir, 'metrics.jsonl'),
                     ''.join(json.dumps(r) + '\n' for r in keep))
  except BaseException:
    # A copy that stops half way (a full disk, a kill) leaves no stage of it behind: the workdir
    # is as it was, and the same command forks again.
    for rel in rels:
      paths.rmtree(paths.join(workdir, rel))
    paths.remove(paths.join(workdir, 'metrics.jsonl'))
    raise
  # Exports named in progress (a stage's 'hf') move with their stage directory.
  retarget = lambda v: (paths.join(workdir, 'stages', v.split('/stages/', 1)[1])
                        if isinstance(v, str) and '/stages/' in v else v)
  for _, name in shared:
    own.done[name] = {**{k: retarget(v) for k, v in src.done[name].items()},
                      'forked_from': source}
  own.rows = [{k: retarget(v) for k, v in r.items()} for r in src.rows
              if r['stage'] in names or r.get('index') == -1]
  own.ledger = [dict(e) for e in src.ledger if e['stage'] in names]
  own.save()                     # last: progress.json naming the stages marks a whole fork
  return [name for _, name in shared]


def _check_forkable(source: str, rel: str) -> None:
  """Refuses to fork a stage whose directory is missing or whose checkpoints or export differ
  from their checksums (one line naming the file; nothing has been copied yet)."""
  d = paths.join(source, rel)
  if not paths.isdir(d):
    raise WorkdirError(f'--fork_from={source}: {d} is missing; nothing was copied')
  ckpt = paths.join(d, 'ckpt')
  for sub in [paths.join(ckpt, s) for s in paths.listdir(ckpt) if s.isdigit()] + [
      paths.join(d, 'hf')]:
    why = checksums.verify(sub)
    if why:
      raise WorkdirError(f'--fork_from={source}: {sub} is damaged (checksum mismatch: {why}); '
                         'nothing was copied')


class Progress:
  """progress.json: which stages are complete, and the evaluation rows so far.

  Attributes:
    done: stage name -> {'index', 'kind', 'final_step', 'hf'} for completed stages.
    rows: evaluation rows in order, each {'stage', 'index', 'domains', 'scores':
      {domain: score}, 'details': {...}}; index -1 is the starting policy.
    config: the hash of the workdir's config (config.json's second copy; '' if unrecorded).
    data: stage name -> the identity of its data files when it started
      (`cascade.data.stage_data.StageData.pin`).
    isolation: verifier -> every isolation its code ran under in this workdir, noted as it
      runs (`record_isolation`), so a resumed run's results still say it.
    ledger: the validation ledger's entries between stage ends (`cascade.ledger`: in-stage
      validation and the guards' probes; the stage ends are the rows).
  """

  def __init__(self, workdir: str, rebuild: bool = True,
               before_save: Callable[[], None] | None = None, config_hash: str = ''):
    """Reads `workdir`'s progress.json.

    Args:
      workdir: the run's directory.
      rebuild: what to do with a progress.json that cannot be read: True (a run's own) moves
        it aside to progress.json.damaged.<time> with a warning and starts empty, so every
        stage is redone from its own checkpoints (a finished one resumes at its last step, its
        export is reused and only its evaluation reruns); False refuses (WorkdirError).
      before_save: runs before every write (the workdir lock's check).
      config_hash: the hash of the config this run computes with, stamped on the rows it adds
        (row 'config'; results.json "configs").
    """
    self.path = paths.join(workdir, 'progress.json')
    self._before_save = before_save
    self._config_hash = config_hash
    data = read_state_json(self.path, {}, ('done', 'rows'), rebuild=rebuild,
                           then='rebuilding it from the stages\' checkpoints')
    self.done: dict[str, dict] = dict(data.get('done') or {})
    self.rows: list[dict] = list(data.get('rows') or [])
    # config.json's hash, kept here as its second copy (`guard_config`).
    self.config: str = config_hash or data.get('config') or ''
    # stage name -> the identity of the data files it started with (`cascade.data.stage_data`).
    self.data: dict[str, list] = dict(data.get('data') or {})
    self.isolation: dict[str, list] = dict(data.get('isolation') or {})
    self.ledger: list[dict] = [dict(e) for e in data.get('ledger') or []]

  def row(self, stage_name: str) -> dict | None:
    return next((r for r in self.rows if r['stage'] == stage_name), None)

  def add_row(self, row: Mapping) -> dict:
    """Appends `row` (stamped with the config hash) and saves; returns the row as stored."""
    if self.row(row['stage']) is not None:
      raise ValueError(f'progress: stage {row["stage"]!r} already has an evaluation row')
    self.rows.append({**row, 'config': self._config_hash} if self._config_hash else dict(row))
    self.save()
    return self.rows[-1]

  def mark_done(self, stage_name: str, info: Mapping) -> None:
    self.done[stage_name] = dict(info)
    self.save()

  def record_data(self, stage_name: str, files: list) -> None:
    """Keeps the identity of a stage's data files (saved when it changed)."""
    if self.data.get(stage_name) != files:
      self.data[stage_name] = files
      self.save()

  def record_isolation(self, isolation: Mapping[str, str]) -> bool:
    """Adds verifier -> isolation ('a, b' for several) to `isolation`; whether it changed (the
    caller saves)."""
    changed = False
    for name, iso in isolation.items():
      have = set(self.isolation.get(name, ()))
      new = have | {x.strip() for x in str(iso).split(',') if x.strip()}
      if new != have:
        self.isolation[name], changed = sorted(new), True
    return changed

  def save(self) -> None:
    if self._before_save is not None:
      self._before_save()
    rec = {'config': self.config} if self.config else {}
    rec.update(done=self.done, rows=self.rows)
    if self.data:
      rec['data'] = self.data
    if self.isolation:
      rec['isolation'] = self.isolation
    if self.ledger:
      rec['ledger'] = self.ledger
    atomic_write_json(self.path, rec)


class StageCheckpoints:
  """An Orbax CheckpointManager for one stage, with fallback past damaged steps.

  Steps are saved when the caller asks (every N steps and at the stage's end);
  the newest `keep` are kept, and since nothing is saved after the stage's
  end, its final checkpoint is always among them. `before_save` (e.g. the
  metrics writer's flush) runs before each save, so what a resume will not
  redo has been logged for good.

  With `checksums`, a step is usable only once sealed (`cascade.checksums`). A
  step is sealed as soon as Orbax has finalised it (a background thread waits
  for the finalisation, then process 0 seals; `wait` joins it), and only then
  counts among the `keep` newest, so an older step is deleted only once a newer
  one is sealed. A restore uses sealed steps only, each checked against its
  seal first: a step whose bytes changed, or one without a seal (a run killed
  between Orbax's finalisation and the seal: nothing can vouch for its bytes),
  is moved aside with one warning and the previous step is used; with none left
  the stage starts again from its first step.

  `pinned()` names steps the rotation keeps besides the newest `keep` (the validation
  ledger's: a domain's best checkpoint, `cascade.ledger.Ledger.pinned`).
  """

  def __init__(self, directory: str, keep: int = 2, async_save: bool = True,
               before_save: Callable[[], None] | None = None, checksums: bool = True,
               pinned: Callable[[], set[int]] | None = None):
    self.directory = str(paths.absolute(directory))   # local: absolute; gs://: as given
    self._keep = keep
    self._pinned = pinned
    self._async = async_save
    self._before_save = before_save
    self._checksums = checksums
    self._sealer: threading.Thread | None = None   # finishes the save in flight
    self._failed: BaseException | None = None      # what stopped it
    self._saved = False                            # a save of this object awaits `wait`
    self._mngr = self._open()

  def _open(self):
    # Retention is ours (`wait`): Orbax would delete the oldest step when the newest is
    # finalised, before it is sealed, leaving a kill in between with no usable step.
    opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                        enable_async_checkpointing=self._async,
                                        cleanup_tmp_directories=True)
    return ocp.CheckpointManager(paths.path(self.directory), options=opts,
                                 item_names=('state', 'meta'))

  def steps(self) -> list[int]:
    """Every step on disk, sealed or not."""
    return sorted(self._mngr.all_steps())

  def sealed_steps(self) -> list[int]:
    """The steps a restore may use: the sealed ones (every step when checksums are off)."""
    return [s for s in self.steps()
            if not self._checksums or checksums.sealed(paths.join(self.directory, str(s)))]

  def save(self, step: int, state, meta: Mapping) -> None:
    """Saves `state` (pytree) and `meta` (JSON) as `step` (asynchronously when enabled); the
    step is sealed as soon as Orbax has finalised it."""
    if self._before_save is not None:
      self._before_save()
    self.wait()          # Orbax would wait for the previous save here anyway
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(dict(meta))),
                    force=True)
    self._saved = True
    if self._async:
      self._sealer = threading.Thread(target=self._finish, args=(step,), daemon=True,
                                      name=f'seal {self.directory}/{step}')
      self._sealer.start()
    else:
      self._finish(step)
      self.wait()

  def _finish(self, step: int) -> None:
    """Waits for Orbax to finalise `step`, then seals it (process 0)."""
    try:
      self._mngr.wait_until_finished()
      if self._checksums and is_writer() and step in self._mngr.all_steps():
        checksums.seal(paths.join(self.directory, str(step)))
    except BaseException as e:  # pylint: disable=broad-except  (raised by `wait`)
      self._failed = e

  def wait(self) -> None:
    """Waits for the save in flight and its seal, then deletes the steps beyond the newest
    `keep` (once a newer one is sealed) but the pinned ones. Raises what stopped the save or
    the seal."""
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None
    if self._failed is not None:
      failed, self._failed = self._failed, None
      raise failed
    self._mngr.wait_until_finished()
    if self._saved:
      self._saved = False
      pinned = self._pinned() if self._pinned is not None else set()
      for s in self.steps()[:-self._keep]:
        if s not in pinned:
          self._mngr.delete(s)

  def restore(self, abstract_state, step: int | None = None):
    """Restores `step` (default: the newest restorable one), falling back past damage.

    Args:
      abstract_state: a pytree of `jax.ShapeDtypeStruct` (with shardings) of
        the same structure as the saved state.
      step: a specific step (no fallback), or None.

    Returns:
      (step, state, meta), or None when no step is restorable.
    """
    self.wait()
    if step is not None:
      return step, *self._restore(step, abstract_state)
    for s in reversed(self.steps()):
      try:
        return s, *self._restore(s, abstract_state)
      except Exception as e:  # pylint: disable=broad-except
        self._quarantine(s, e)
    return None

  def _restore(self, step, abstract_state):
    if self._checksums:
      checksums.check(paths.join(self.directory, str(step)), required=True)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    meta = dict(out.meta)
    if meta.get('step') != step:
      raise ValueError(f'meta says step {meta.get("step")}, directory says {step}')
    return out.state, meta

  def _quarantine(self, step: int, err: Exception) -> None:
    """Moves a damaged or unsealed step out of Orbax's sight so the run can redo it."""
    dest = paths.join(paths.parent(self.directory), 'corrupt', f'{step}.{int(time.time())}')
    earlier = [s for s in self.steps() if s < step]
    then = ('falling back to the previous checkpoint' if earlier else
            'no earlier checkpoint is left: the stage starts again from its first step')
    if isinstance(err, checksums.Unsealed):
      print(f'WARNING: checkpoint {self.directory}/{step} is not usable ({err}); moved to '
            f'{dest}, {then}', flush=True)
    else:
      why = str(err) if isinstance(err, checksums.Mismatch) else type(err).__name__
      print(f'WARNING: checkpoint {self.directory}/{step} is damaged ({why}); {then}',
            flush=True)
    if is_writer():
      paths.move_tree(paths.join(self.directory, str(step)), dest)
    self._mngr.close()
    self._mngr = self._open()

  def close(self) -> None:
    self.wait()
    self._mngr.close()

  def rotate(self) -> None:
    """Applies the rotation now (the newest `keep` and the pinned steps stay): a finished
    stage's checkpoint that was pinned as a domain's best and is no longer goes."""
    self._saved = True
    self.wait()

  def delete(self, step: int) -> None:
    """Deletes `step` (a guard's stop saves the kept policy as the stage's last step)."""
    self.wait()
    if step in self.steps():
      self._mngr.delete(step)

  def discard_after(self, step: int) -> None:
    """Deletes the steps after `step` (a rolled-back stage redoes them and saves them anew)."""
    self.wait()
    for s in self.steps():
      if s > step:
        self._mngr.delete(s)
