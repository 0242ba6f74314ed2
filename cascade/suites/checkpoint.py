"""Suites on any checkpoint: an HF directory or a run's stage as the policy, the suites' data
read (or fetched), every suite scored, the table and evaluation.{json,md} written.

What `python -m cascade.evaluate` runs (cascade/evaluate.py holds only its flags):

  source = checkpoint.resolve('runs/tiny')                 # a run: its last exported stage
  plan = checkpoint.plan(['tiny_math'], source, overrides={'samples': 8})
  options = checkpoint.grader_options(plan, source, {'tiny_math': {'workers': 2}})
  sets = checkpoint.read_all(plan, 'runs/tiny_world/seed0', max_prompts=50)
  policy = checkpoint.load_policy(source)
  report = checkpoint.evaluate(sets, policy, workdir='runs/tiny/evaluations/swe_rl',
                               grader_options=options)

A checkpoint is either an HF directory (config.json, safetensors, the tokenizer:
`models.hf`, what every stage of a run exports) or a run's workdir, whose
progress.json names each finished stage's export (`--stage`, else the last one);
a run also gives the defaults its config.json holds: config.eval.suites and the
suites' data, protocol overrides, grader options and prompt counts, config.sampler and
config.mesh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import threading
from typing import Any, Callable, Mapping, Sequence

from cascade import config as config_lib
from cascade import schema
from cascade import suites as suites_lib
from cascade.data import shards
from cascade.suites import base
from cascade.suites import run as run_lib
from cascade.suites import table
from foundation import paths

REPORT_JSON, REPORT_MD = 'evaluation.json', 'evaluation.md'


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a policy comes from.

  Attributes:
    hf_dir: the HF directory its weights and tokenizer load from.
    run: the run's workdir ('' for an HF directory given directly).
    stage: the run's stage whose export it is ('' likewise).
    config: the run's config (config.json's), {} without a run.
  """
  hf_dir: str
  run: str = ''
  stage: str = ''
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def describe(self) -> str:
    return f"{self.run}, stage {self.stage!r} ({self.hf_dir})" if self.run else self.hf_dir


def resolve(checkpoint: str, stage: str = '') -> Source:
  """The policy `checkpoint` names: an HF directory, or a run's workdir (its stage `stage`, else
  the last stage that exported a policy).

  Raises:
    cascade.config.ConfigError: nothing loadable there, or no such stage (one line).
  """
  if paths.exists(paths.join(checkpoint, 'progress.json')):
    progress = paths.read_json(paths.join(checkpoint, 'progress.json')) or {}
    done = {n: i for n, i in (progress.get('done') or {}).items() if i.get('hf')}
    if not done:
      raise config_lib.ConfigError(f'--checkpoint={checkpoint}: the run has exported no policy '
                                   'yet (no finished stage that trains one)')
    if stage and stage not in done:
      raise config_lib.ConfigError(f'--stage={stage}: not a finished stage of {checkpoint} '
                                   f'that exported a policy (those are: {", ".join(done)})')
    name = stage or max(done, key=lambda n: done[n].get('index', -1))
    # The export sits in the workdir's stages/<index>_<name>/hf (progress.json names it as the
    # run saw the workdir, maybe by another relative path).
    stage_dir = os.path.basename(os.path.dirname(os.path.normpath(done[name]['hf'])))
    hf_dir = paths.join(checkpoint, 'stages', stage_dir, 'hf')
    cfg = paths.read_json(paths.join(checkpoint, 'config.json')) or {}
    source = Source(hf_dir=hf_dir, run=checkpoint, stage=name, config=cfg.get('config') or {})
  elif stage:
    raise config_lib.ConfigError(f'--stage={stage}: --checkpoint={checkpoint} is not a run\'s '
                                 'workdir (it has no progress.json)')
  else:
    source = Source(hf_dir=checkpoint)
  if not paths.exists(paths.join(source.hf_dir, 'config.json')):
    raise config_lib.ConfigError(f'--checkpoint={checkpoint}: {source.hf_dir} holds no HF '
                                 'checkpoint (no config.json): give an HF directory or a run\'s '
                                 'workdir')
  return source


def fingerprint(hf_dir: str) -> str:
  """A short hash naming the weights: of the export's checksums manifest when it has one (every
  file's sha256), else of config.json and each weight file's name, size and modification time."""
  h = hashlib.sha256()
  manifest = paths.join(hf_dir, 'checksums.json')
  if paths.exists(manifest):
    h.update(paths.read_bytes(manifest))
  else:
    h.update(paths.read_bytes(paths.join(hf_dir, 'config.json')))
    for name in sorted(paths.listdir(hf_dir)):
      if name.endswith('.safetensors'):
        st = paths.path(paths.join(hf_dir, name)).stat()
        h.update(f'{name}:{st.length}:{getattr(st, "mtime", "")}'.encode())
  return h.hexdigest()[:16]


def _run_eval(source: Source) -> dict:
  return dict(schema.plain(source.config.get('eval')) or {})


def plan(names: Sequence[str], source: Source, overrides: Mapping[str, Any] | None = None
         ) -> list[base.Suite]:
  """The suites to run, each with its protocol: the paper's, with the run's
  config.eval.suite_protocol for it (when the checkpoint is a run), then `overrides`.

  Args:
    names: suite names (empty: the run's config.eval.suites).
    source: the checkpoint.
    overrides: protocol fields replaced in every suite (the command line's --samples, ...).

  Raises:
    cascade.config.ConfigError: no suite named, an unknown one, one that is not available (BFCL's
      multi-turn categories: why, in one line), or overrides that do not check out.
  """
  ev = _run_eval(source)
  names = list(names) or list(ev.get('suites') or ())
  if not names:
    raise config_lib.ConfigError('--suites: no suite named (and the checkpoint is not a run whose '
                                 'config.eval.suites names any); known: '
                                 + ', '.join(suites_lib.names()))
  out = []
  for name in names:
    try:
      suite = suites_lib.get(name)
    except ValueError as e:
      if suites_lib.refusal(name):       # a benchmark known not to be one (BFCL multi-turn)
        raise config_lib.ConfigError(f'--suites: {e}') from None
      raise config_lib.ConfigError(f'--suites: {e} (a world\'s or a user\'s own suites exist '
                                   'once --imports names their package)') from None
    run_over = dict(schema.plain((schema.plain(ev.get('suite_protocol')) or {}).get(name)) or {})
    try:
      suite = suite.with_protocol(**{**run_over, **dict(overrides or {})})
    except ValueError as e:
      raise config_lib.ConfigError(f'protocol overrides: {e}') from None
    out.append(suite)
  return out


def grader_options(suites: Sequence[base.Suite], source: Source,
                   given: Mapping[str, Mapping[str, Any]] | None = None
                   ) -> dict[str, dict[str, Any]]:
  """Each suite's grader options: the run's config.eval.suite_options for it (when the
  checkpoint is a run), then `given` (the command line's --suite_option), each suite's checked
  by `Suite.check_grader_options` before anything loads or samples (an ArenaHard suite needs
  its judge named).

  Args:
    suites: the suites to run (`plan`).
    source: the checkpoint.
    given: suite -> {option: value} (they replace the run's, option by option).

  Returns:
    suite name -> its options ({} for a suite without any).

  Raises:
    cascade.config.ConfigError: options for a suite not run, or options a suite rejects
      (one line naming the suite and the option).
  """
  names = [s.name for s in suites]
  run_opts = schema.plain(_run_eval(source).get('suite_options')) or {}
  for name in given or {}:
    if name not in names:
      raise config_lib.ConfigError(f'--suite_option: names suite {name!r}, which is not '
                                   f'evaluated (suites: {", ".join(names)})')
  out = {}
  for suite in suites:
    opts = {**dict(schema.plain(run_opts.get(suite.name)) or {}),
            **dict((given or {}).get(suite.name) or {})}
    try:
      suite.check_grader_options(opts)
    except ValueError as e:
      raise config_lib.ConfigError(f'grader options: {e}') from None
    out[suite.name] = opts
  return out


def default_data_dir(source: Source) -> str:
  """Where the suites' data is unless --data_dir says: the run's config.eval.suite_data, else
  data/suites (under the current directory)."""
  return _run_eval(source).get('suite_data') or os.path.join('data', 'suites')


def default_prompts(source: Source) -> int:
  """Prompts per suite unless --max_prompts says: the run's config.eval.suite_prompts, else all."""
  return int(_run_eval(source).get('suite_prompts') or 0)


def hub_reachable(timeout_s: float = 5.0) -> str:
  """'' when the Hugging Face Hub answers from here, else why not (HF_HUB_OFFLINE set, or no
  connection within `timeout_s`: a name lookup may hang, so it runs in a thread)."""
  if os.environ.get('HF_HUB_OFFLINE', '').lower() in ('1', 'true', 'yes', 'on'):
    return 'HF_HUB_OFFLINE is set'
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  host = constants.ENDPOINT.split('://', 1)[-1].split('/', 1)[0]
  result: list[str] = []

  def probe():
    try:
      socket.create_connection((host, 443), timeout=timeout_s).close()
      result.append('')
    except OSError as e:
      result.append(f'{host}:443 does not answer ({e.strerror or e})')
  t = threading.Thread(target=probe, daemon=True)
  t.start()
  t.join(timeout_s + 1)
  return result[0] if result else f'{host}:443 did not answer within {timeout_s:g} s'


def download(suite: base.Suite, root: str, say: Callable[[str], None]) -> bool:
  """Fetches `suite`'s files from its Hugging Face dataset into its directory under `root`
  (`huggingface_hub.snapshot_download`), saying in one line what it did or why it could not.

  Returns:
    Whether the files were fetched.
  """
  if not suite.hub_dataset:
    say(f'--download: suite {suite.name!r} names no Hugging Face dataset ({suite.source}); '
        f'place its files under {suite.directory(root)}')
    return False
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
  except ImportError:
    say(f'--download: huggingface_hub is not installed (pip install -e ".[evals]"); place '
        f'{suite.name}\'s files ({suite.hub_dataset}) under {suite.directory(root)}')
    return False
  why = hub_reachable()
  if why:
    say(f'--download: the Hugging Face Hub cannot be reached from this machine ({why}); place '
        f'{suite.name}\'s files ({suite.hub_dataset}) under {suite.directory(root)}')
    return False
  where = suite.directory(root)
  huggingface_hub.snapshot_download(repo_id=suite.hub_dataset, repo_type='dataset',
                                    allow_patterns=list(suite.hub_files or suite.files),
                                    local_dir=where)
  say(f'--download: {suite.name}: {suite.hub_dataset} -> {where}')
  return True


def has_files(suite: base.Suite, root: str) -> bool:
  """Whether any of the suite's files are in its directory under `root`."""
  where = paths.path(suite.directory(root))
  return any(True for pattern in suite.files for _ in where.glob(pattern))


def read(suite: base.Suite, root: str, max_prompts: int = 0) -> list[dict]:
  """The suite's records under `root` (the first `max_prompts`; 0 = all).

  Raises:
    cascade.data.readers.DataError: its data is missing or malformed (one line naming suite and
      file).
  """
  try:
    recs = suite.read(suite.directory(root))
  except (base.DataMissing, base.BadRecord) as e:
    raise shards.DataError(str(e)) from None
  return recs[:max_prompts] if max_prompts else recs


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A checkpoint loaded on this machine's devices (`load`).

  Attributes:
    policy: what samples (its sampler, the sampler's rollout copy of the params, the tokenizer).
    graphdef: the model's nnx GraphDef.
    params: its params as loaded (a forward pass's: `nnx.merge(graphdef, params)`).
    cfg: its `models.config.ModelConfig`.
    mesh: the device mesh (None: one device).
    rules: the mesh's logical rules.
    sampler_options: the policy sampler's `rl.sampler.Sampler` options.
  """
  policy: run_lib.Policy
  graphdef: Any
  params: Any
  cfg: Any
  mesh: Any
  rules: Any
  sampler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def load_judge(self, path: str):
    """A judge model (an HF directory) on this policy's mesh, its sampler options turned into
    a judge's (`rl.judge.run_sampler_options`), as a run loads one."""
    from rl import judge as judge_lib  # pylint: disable=g-import-not-at-top
    return judge_lib.JudgeModel.from_hf(path, mesh=self.mesh, rules=self.rules,
                                        sampler_options=dict(self.sampler_options),
                                        policy_cfg=self.cfg)


def load_policy(source: Source, mesh_shape: Sequence[int] | None = None,
                sampler_options: Mapping[str, Any] | None = None) -> run_lib.Policy:
  """The checkpoint's policy on this machine's devices, ready to sample (`load`'s policy)."""
  return load(source, mesh_shape, sampler_options).policy


def load(source: Source, mesh_shape: Sequence[int] | None = None,
         sampler_options: Mapping[str, Any] | None = None) -> Loaded:
  """The checkpoint on this machine's devices: its policy ready to sample, and its model.

  Args:
    source: the checkpoint (`resolve`).
    mesh_shape: the device mesh (None: a run's config.mesh, else one device, no mesh).
    sampler_options: `rl.sampler.Sampler` options, checked as config.sampler is (None: a run's
      config.sampler, else the paged engine with the Sampler's defaults).

  Raises:
    cascade.config.ConfigError: the sampler options or the mesh do not check out.
  """
  # pylint: disable=g-import-not-at-top  (the model's libraries, only where a policy loads)
  from flax import nnx
  from models import hf
  from models import sharding
  from foundation import tokenizer as tokenizer_lib
  from rl import sampler as sampler_lib
  # pylint: enable=g-import-not-at-top
  raw_mesh = dict(schema.plain(source.config.get('mesh')) or {})
  if mesh_shape is not None:
    raw_mesh = {'shape': list(mesh_shape)}
  mesh_cfg = schema.from_mapping(config_lib.Mesh, raw_mesh, 'config.mesh', sep='.')
  if sampler_options is None:
    sampler_options = schema.plain(source.config.get('sampler')) or {'engine': 'paged'}
  options = schema.from_mapping(config_lib.Sampler, dict(sampler_options), 'config.sampler',
                                sep='.').options()
  rules = mesh_cfg.logical_rules()
  mesh = (None if mesh_cfg.shape is None
          else sharding.make_mesh(mesh_cfg.shape, slices=mesh_cfg.slices))
  model = hf.load_model(source.hf_dir, mesh=mesh, rules=rules)
  graphdef, params = nnx.split(model)
  tok = policy_tokenizer(source, tokenizer_lib.load(source.hf_dir))
  if tok.eos_id is None:
    raise config_lib.ConfigError(f'{source.hf_dir}: its tokenizer has no end-of-sequence token')
  sampler = sampler_lib.Sampler(graphdef, model.cfg, eos_ids=[tok.eos_id], pad_id=tok.pad_id,
                                mesh=mesh, rules=rules, **options)
  policy = run_lib.Policy(sampler, sampler.prepare(params), tok,
                          identity=f'hf {fingerprint(source.hf_dir)}')
  return Loaded(policy=policy, graphdef=graphdef, params=params, cfg=model.cfg, mesh=mesh,
                rules=rules, sampler_options=options)


def for_tokenizer(suites: Sequence[base.Suite], source: Source) -> list[base.Suite]:
  """The suites, those whose records depend on the policy's tokenizer (RULER's lengths) given
  the checkpoint's (loaded only for them, before the model)."""
  if not any(s.NEEDS_TOKENIZER for s in suites):
    return list(suites)
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tok = policy_tokenizer(source, tokenizer_lib.load(source.hf_dir))
  return [s.for_tokenizer(tok) for s in suites]


def policy_tokenizer(source: Source, tok):
  """`tok` carrying the chat template the run rendered its prompts with: a run with
  config.tokenizer.chat_template='checkpoint' exported that template, so its export is
  prompted with it (`foundation.chat_template`); otherwise the built-in one."""
  from foundation import chat_template  # pylint: disable=g-import-not-at-top
  raw = dict(schema.plain(source.config.get('tokenizer')) or {})
  if raw.get('chat_template') != 'checkpoint':
    return tok
  try:
    return chat_template.attach(tok, chat_template.read(source.hf_dir))
  except ValueError as e:
    raise config_lib.ConfigError(f'{source.describe()}: {e}') from None


def evaluate(sets: Sequence[tuple[base.Suite, Sequence[dict]]], policy: run_lib.Policy,
             workdir: str, *, seed: int = 0, batch_size: int = 64,
             grader_options: Mapping[str, Mapping[str, Any]] | None = None,
             stop: Callable[[], str | None] | None = None,
             say: Callable[[str], None] = print,
             load_judge: Callable[[str], Any] | None = None) -> dict[str, dict]:
  """Every suite scored on `policy` (`load_policy`) by `run.run_suite`, its
  graded batches kept under `workdir/<suite>/`: a rerun resumes each suite where it stopped.
  `grader_options`: suite -> its grader's options (`grader_options`); `load_judge`: loads a
  suite's local judge (an HF directory) on the policy's devices (`Loaded.load_judge`).

  Returns:
    suite name -> its result.

  Raises:
    run.Stopped: `stop` answered (what was graded is kept).
  """
  out = {}
  for i, (suite, recs) in enumerate(sets, 1):
    res = run_lib.run_suite(suite, recs, policy, workdir, seed=seed, batch_size=batch_size,
                            grader_options=run_lib.with_judge_loader(
                                suite, (grader_options or {}).get(suite.name), load_judge),
                            stop=stop, say=say)
    out[suite.name] = res
    say(f'suite {i}/{len(sets)} {suite.name}: {table.summary(res)} ({res["n"]} prompts, '
        f'{res["samples"]} samples, {res["seconds"]:.1f} s)')
  return out


def report(results: Mapping[str, Mapping], suites: Sequence[base.Suite], source: Source,
           data_dir: str, seed: int) -> dict:
  """evaluation.json's object: the checkpoint, every suite's result, the papers' numbers beside."""
  by_name = {s.name: s for s in suites}
  return {'checkpoint': source.hf_dir, 'run': source.run, 'stage': source.stage,
          'data_dir': data_dir, 'seed': seed, 'suites': dict(results),
          'papers': table.comparisons(results, by_name)}


def markdown(rep: Mapping, suites: Sequence[base.Suite]) -> str:
  """evaluation.md: the results table, then the papers' numbers beside (when any suite has)."""
  src = rep['checkpoint'] if not rep['run'] else f"{rep['run']}, stage {rep['stage']}"
  text = f'Suites on {src} (seed {rep["seed"]}; values in percent):\n\n'
  text += table.results_table(rep['suites'])
  papers = table.papers_table(rep['suites'], {s.name: s for s in suites})
  if papers:
    text += ('\nThe papers\' numbers beside (the difference carries this run\'s standard '
             'error; the papers give none):\n\n' + papers)
  return text


def write(workdir: str, rep: Mapping, suites: Sequence[base.Suite]) -> tuple[str, str]:
  """Writes evaluation.json and evaluation.md under `workdir` (whole files); their paths."""
  js, md = paths.join(workdir, REPORT_JSON), paths.join(workdir, REPORT_MD)
  paths.write_text(js, json.dumps(rep, indent=1) + '\n')
  paths.write_text(md, markdown(rep, suites))
  return js, md
