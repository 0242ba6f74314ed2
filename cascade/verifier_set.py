"""The run's verifiers: each domain's training and evaluation verifier, built once and cached.

A domain scored by a learned reward model gets a scorer built from the final
checkpoint of the domain's `reward_model_stage`, passed in the option its
verifier class declares (`Verifier.reward_model_option`: 'reward_model''s
`scorer`, the IF verifier's `rm_scorer` adding the RM score in thinking mode);
the training verifier gets it whenever it takes one, the evaluation verifier
only when it cannot score without one (`Verifier.needs_reward_model`; so IF
held-out stays plain IFEval). A verifier holding a
reward model is marked `rollout.COLLECTIVE`: its scorer runs on the run's
mesh, so with several hosts every host scores those rows and process 0's
rewards are kept (`cascade.rollout.score`).

A verifier that takes a judge model (`Verifier.judge_option`: the 'judge'
verifier, swe's semantic judge) names its source in that option as a string:
'stage:<name>', the final policy of an earlier training stage of this run
(the run's architecture and tokenizer), or an HF checkpoint directory (local
or gs://, its own tokenizer). `check_options` checks the source and builds
the verifier around a stand-in with the judge's tokenizer (no weights); the
first verifier that needs it loads the judge once, frozen, on the run's mesh,
and is marked `rollout.COLLECTIVE` like a reward model's. A judge stage that
has not run yet cannot score (training raises, evaluation skips the row).

An agentic domain (one that names an `env`) is scored by its environment: its
"verifier", for training and evaluation alike, is an `episodes.Agent`: one
`envs.Environment` built from the domain's `env_options`, with the domain's
episode limits, which `cascade.episodes` drives.

A verifier's own bug stops the run. Where scoring a sample raised and its
verifier (or environment) raises on the sample's record whatever the answer,
the sample's info carries 'verifier_error' (`verifiers.base`: only fixed probe
answers can set it, never the model's text). `verifier_errors.VerifierErrors` counts those over
a stage's training batches, or over one domain's evaluation, and raises
`VerifierBug` (one line naming the verifier, the domain, the record and the
exception's last frame; `cascade.main` exits 2) at the first one in the first
scored batch, or once they pass MAX_VERIFIER_ERROR_FRACTION of the samples
scored. It is raised before that batch trains, so every checkpoint stays valid
and a rerun after the fix resumes. Before the first step `dry_run` scores the
probe answers on the first records of every domain's evaluation set, so most
such bugs stop the run before anything trains.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from cascade import config as config_lib
from cascade import distributed
from cascade import rollout
from cascade import verifier_errors


STAGE_PREFIX = 'stage:'
# Records of each domain's evaluation set `dry_run` scores the probe answers on.
DRY_RUN_RECORDS = 2
class _StandInJudge:
  """The judge's tokenizer without its weights: builds a verifier to check its options."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def choice_logprobs(self, rows, choice_ids):
    raise RuntimeError('a stand-in judge (VerifierSet.check_options) does not score')

  def generate(self, rows, max_new_tokens):
    raise RuntimeError('a stand-in judge (VerifierSet.check_options) does not score')


class VerifierSet:
  """domain -> verifier, for training and for evaluation.

  Args:
    plan: the validated plan.
    rm_scorer: (reward_model stage config) -> text scorer (prompts,
      completions) -> [n] rewards; called once per RM stage, when first needed.
    rm_ready: (stage name) -> whether that stage (a reward model's, a judge's) has finished.
    judge_model: (source: ('stage', name) or ('hf', path)) -> the loaded judge
      (`rl.judge.JudgeModel`, on the run's mesh); called once per source, when first needed.
      None: a config that names a judge is refused.
    judge_tokenizer: (source) -> that judge's tokenizer, for `check_options`.
  """

  def __init__(self, plan: config_lib.Plan, rm_scorer: Callable[[Any], Callable],
               rm_ready: Callable[[str], bool],
               judge_model: Callable[[tuple], Any] | None = None,
               judge_tokenizer: Callable[[tuple], Any] | None = None):
    import verifiers  # pylint: disable=g-import-not-at-top
    self._mod = verifiers
    self.sample_cls = verifiers.Sample
    self.plan = plan
    self._rm_scorer, self._rm_ready = rm_scorer, rm_ready
    self._judge_model, self._judge_tokenizer = judge_model, judge_tokenizer
    self._judges: dict[tuple, Any] = {}
    self._cache: dict[tuple, Any] = {}

  def judge_source(self, domain: str, field: str, opts: dict) -> tuple | None:
    """The judge source a domain's verifier options name: ('stage', name), ('hf', path) or None.

    Raises:
      ConfigError: naming config.domains.<domain>.<field>.<option>: not a string, an unknown
        stage, a stage that trains no policy, or one that does not precede every stage that
        samples the domain.
    """
    d = self.plan.domains[domain]
    name = d.verifier if field == 'verifier_options' else d.eval_verifier
    option = self._mod.cls(name).judge_option
    if not option or opts.get(option) is None:
      return None
    value, where = opts[option], f'config.domains.{domain}.{field}.{option}'
    if not isinstance(value, str) or not value.strip():
      raise config_lib.ConfigError(f'{where}={value!r}: expected a judge source, '
                                   f"'{STAGE_PREFIX}<stage name>' or an HF checkpoint directory")
    if not value.startswith(STAGE_PREFIX):
      return ('hf', value)
    stage_name = value[len(STAGE_PREFIX):]
    stage = next((s for s in self.plan.stages if s.name == stage_name), None)
    if stage is None or stage.MODEL != 'policy' or stage.LEAVES != 'own':
      raise config_lib.ConfigError(f'{where}={value!r}: names no stage that trains a policy '
                                   f'(stages: {[s.name for s in self.plan.stages]})')
    late = [s.name for s in self.plan.stages
            if s.SAMPLES and domain in s.domains and s.index <= stage.index]
    if late and field == 'verifier_options':
      raise config_lib.ConfigError(f'{where}={value!r}: stage {late[0]!r} samples domain '
                                   f'{domain!r} before the judge stage {stage_name!r} has run')
    return ('stage', stage_name)

  def _judge(self, source: tuple):
    if source not in self._judges:
      if self._judge_model is None:
        raise ValueError(f'judge {source}: this VerifierSet loads no judge models')
      self._judges[source] = self._judge_model(source)
    return self._judges[source]

  def check_options(self) -> dict[str, str]:
    """Builds every verifier once (a stand-in for a reward model) so bad options fail now.

    Returns:
      verifier name (an environment's: 'env:<name>') -> the isolation its candidates' code
      will run under ('bwrap', 'none'; 'n/a': it runs none; 'a, b' when its uses differ), for
      the run's start banner.
    """
    stand_in = lambda prompts, answers: np.zeros(len(prompts), np.float32)
    isolation = {}
    for d in self.plan.domains.values():
      if d.agentic:
        try:
          import envs  # pylint: disable=g-import-not-at-top
          env = envs.get(d.env, **d.env_options)
          isolation.setdefault(f'env:{d.env}', set()).add(str(getattr(env, 'isolation', 'n/a')))
          env.close()
        except (TypeError, ValueError) as e:
          raise config_lib.ConfigError(f'config.domains.{d.name}.env_options: environment '
                                       f'{d.env!r} rejects {sorted(d.env_options)}: {e}') from None
        continue
      for field, name, opts in (('verifier_options', d.verifier, d.verifier_options),
                                ('eval_verifier_options', d.eval_verifier,
                                 d.eval_verifier_options)):
        opts = dict(opts)
        cls = self._mod.cls(name)
        option = cls.reward_model_option
        if option and (cls.needs_reward_model or d.reward_model_stage):
          opts[option] = stand_in
        source = self.judge_source(d.name, field, opts)
        if source is not None:
          where = f'config.domains.{d.name}.{field}.{cls.judge_option}'
          if self._judge_tokenizer is None:
            raise config_lib.ConfigError(f'{where}: this run cannot load judge models')
          try:
            opts[cls.judge_option] = _StandInJudge(self._judge_tokenizer(source))
          except (OSError, ValueError) as e:
            raise config_lib.ConfigError(f'{where}={opts[cls.judge_option]!r}: the judge\'s '
                                         f'tokenizer cannot be loaded: {e}') from None
        try:
          v = self._mod.get(name, **opts)
        except (TypeError, ValueError) as e:
          raise config_lib.ConfigError(f'config.domains.{d.name}.{field}: verifier {name!r} '
                                       f'rejects {sorted(opts)}: {e}') from None
        isolation.setdefault(name, set()).add(str(v.isolation))
        v.close()
    return {k: ', '.join(sorted(v)) for k, v in isolation.items()}

  def check_metadata(self, domain: str, metadata: dict, where: str) -> None:
    """Checks one record's metadata for both of its domain's verifiers (errors name `where`)."""
    d = self.plan.domains[domain]
    if d.agentic:
      import envs  # pylint: disable=g-import-not-at-top
      envs.cls(d.env).validate_metadata(metadata, where)
      return
    for name, opts in ((d.verifier, d.verifier_options),
                       (d.eval_verifier, d.eval_verifier_options)):
      self._mod.validate(name, metadata, where, **opts)

  def dry_run(self, records_of: Mapping[str, Sequence[dict]]) -> None:
    """Scores the probe answers (`verifiers.base.PROBE_ANSWERS`) on the first DRY_RUN_RECORDS
    records of each domain with its evaluation verifier and, if a stage samples the domain, its
    training verifier (an agentic domain: a fresh episode of its environment), before the first
    step. A verifier that needs a model not loaded yet (a reward model, a judge) is left to the
    run. The hosts agree.

    Args:
      records_of: domain -> its records (the evaluation sets).

    Raises:
      verifier_errors.VerifierBug: a verifier raised in its own code on one of them, whatever the answer.
    """
    message = ''
    for domain in sorted(self.plan.domains):
      recs = list(records_of.get(domain) or ())[:DRY_RUN_RECORDS]
      if recs:
        message = self._dry_run(domain, recs, self._mod.base.PROBE_ANSWERS)
      if message:
        break
    got = [b.decode() for b in distributed.allgather_bytes(json.dumps(message).encode())]
    message = next((json.loads(m) for m in got if json.loads(m)), '')
    if message:
      raise verifier_errors.VerifierBug(message)

  def _dry_run(self, domain: str, recs: list[dict], probes: Sequence[str]) -> str:
    """`dry_run` of one domain: the message of the first verifier error, or ''."""
    d = self.plan.domains[domain]
    where = 'before the first step (dry run of the probe answers)'
    count = f'on {len(recs)} record(s) x {len(probes)} probe answers'
    if d.agentic:
      env = self.train_verifier(domain).env
      for rec in recs:
        err = env.own_error(rec)
        if err is not None:
          return verifier_errors.bug_message(where, rec, {'verifier': f'env:{d.env}', 'verifier_error': err},
                             count)
      return ''
    trained = any(st.SAMPLES and domain in st.domains for st in self.plan.stages)
    for for_eval, field in ((False, 'verifier_options'), (True, 'eval_verifier_options')):
      if not (for_eval or trained):
        continue                # no stage samples the domain: its training verifier never runs
      name = d.eval_verifier if for_eval else d.verifier
      cls = self._mod.cls(name)
      opts = dict(d.eval_verifier_options if for_eval else d.verifier_options)
      takes_rm = bool(d.reward_model_stage) and bool(cls.reward_model_option) and (
          not for_eval or cls.needs_reward_model)
      if takes_rm or self.judge_source(domain, field, opts) is not None:
        continue
      v = self.eval_verifier(domain) if for_eval else self.train_verifier(domain)
      rows = [(rec, text) for rec in recs for text in probes]
      samples = [self.sample_cls(prompt=rollout.verifier_prompt(rec), completion=text,
                                 metadata=rec['metadata']) for rec, text in rows]
      try:
        results = v.score(samples)
      except Exception as e:  # pylint: disable=broad-except
        return verifier_errors.bug_message(where, recs[0], {'verifier': name,
                                            'verifier_error': self._mod.base.describe(e)}, count)
      for (rec, _), res in zip(rows, results):
        if (res.info or {}).get('verifier_error'):
          return verifier_errors.bug_message(where, rec, dict(res.info, verifier=name), count)
    return ''

  def train_verifier(self, domain: str):
    return self._get(domain, for_eval=False)

  def eval_verifier(self, domain: str):
    return self._get(domain, for_eval=True)

  def _get(self, domain: str, for_eval: bool):
    d = self.plan.domains[domain]
    if d.agentic:
      key = ('env:' + d.env, repr(sorted(d.env_options.items())),
             (d.max_turns, d.max_turn_tokens, d.render_tools))
      if key not in self._cache:
        import envs  # pylint: disable=g-import-not-at-top
        from cascade import episodes  # pylint: disable=g-import-not-at-top
        self._cache[key] = episodes.Agent(envs.get(d.env, **d.env_options), d.max_turns,
                                          d.render_tools, d.max_turn_tokens)
      return self._cache[key]
    name = d.eval_verifier if for_eval else d.verifier
    opts = dict(d.eval_verifier_options if for_eval else d.verifier_options)
    option = self._mod.cls(name).reward_model_option
    takes_rm = bool(d.reward_model_stage) and bool(option) and (
        not for_eval or self._mod.cls(name).needs_reward_model)
    key = (name, repr(sorted(opts.items())), d.reward_model_stage if takes_rm else '')
    if key not in self._cache:
      if takes_rm:
        if not self._rm_ready(d.reward_model_stage):
          raise ValueError(f'domain {domain!r} is scored by reward model stage '
                           f'{d.reward_model_stage!r}, which has not run yet')
        opts[option] = self._rm_scorer(self.plan.stage(d.reward_model_stage))
      source = self.judge_source(domain, 'eval_verifier_options' if for_eval
                                 else 'verifier_options', opts)
      if source is not None:
        if source[0] == 'stage' and not self._rm_ready(source[1]):
          raise ValueError(f'domain {domain!r} is judged by the policy of stage {source[1]!r}, '
                           'which has not run yet')
        opts[self._mod.cls(name).judge_option] = self._judge(source)
      v = self._mod.get(name, **opts)
      if takes_rm or source is not None:
        # Its reward model / judge runs on the run's mesh, a collective: every host scores
        # its rows.
        setattr(v, rollout.COLLECTIVE, True)
      self._cache[key] = v
    return self._cache[key]

  def can_evaluate(self, domain: str) -> bool:
    """Whether the domain's evaluation verifier can score now (its reward model and its judge
    stage, if any, exist)."""
    d = self.plan.domains[domain]
    source = None if d.agentic else self.judge_source(domain, 'eval_verifier_options',
                                                      dict(d.eval_verifier_options))
    if source is not None and source[0] == 'stage' and not self._rm_ready(source[1]):
      print(f'WARNING: domain {domain!r} is evaluated by the judge of stage {source[1]!r}, not '
            'trained yet: no score in this row', flush=True)
      return False
    if (d.agentic or not self._mod.cls(d.eval_verifier).needs_reward_model
        or self._rm_ready(d.reward_model_stage)):
      return True
    print(f'WARNING: domain {domain!r} is evaluated by reward model stage '
          f'{d.reward_model_stage!r}, not trained yet: no score in this row', flush=True)
    return False

  def isolation(self) -> dict[str, str]:
    """verifier name -> the isolation its code runs under, for the verifiers built so far."""
    out = {}
    for (name, _, _), v in sorted(self._cache.items(), key=lambda kv: kv[0][:2]):
      iso = getattr(v, 'isolation', None)
      if iso not in (None, 'n/a'):
        out[name] = str(iso)
    return out

  def close(self) -> None:
    for v in self._cache.values():
      if hasattr(v, 'close'):
        v.close()
