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

An agentic domain (one that names an `env`) is scored by its environment: its
"verifier", for training and evaluation alike, is an `episodes.Agent`: one
`envs.Environment` built from the domain's `env_options`, with the domain's
episode limits, which `cascade.episodes` drives.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cascade import config as config_lib
from cascade import rollout


class VerifierSet:
  """domain -> verifier, for training and for evaluation.

  Args:
    plan: the validated plan.
    rm_scorer: (reward_model stage config) -> text scorer (prompts,
      completions) -> [n] rewards; called once per RM stage, when first needed.
    rm_ready: (stage name) -> whether that reward model stage has finished.
  """

  def __init__(self, plan: config_lib.Plan, rm_scorer: Callable[[Any], Callable],
               rm_ready: Callable[[str], bool]):
    import verifiers  # pylint: disable=g-import-not-at-top
    self._mod = verifiers
    self.sample_cls = verifiers.Sample
    self.plan = plan
    self._rm_scorer, self._rm_ready = rm_scorer, rm_ready
    self._cache: dict[tuple, Any] = {}

  def check_options(self) -> None:
    """Builds every verifier once (a stand-in for a reward model) so bad options fail now."""
    stand_in = lambda prompts, answers: np.zeros(len(prompts), np.float32)
    for d in self.plan.domains.values():
      if d.agentic:
        try:
          import envs  # pylint: disable=g-import-not-at-top
          envs.get(d.env, **d.env_options).close()
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
        try:
          v = self._mod.get(name, **opts)
        except (TypeError, ValueError) as e:
          raise config_lib.ConfigError(f'config.domains.{d.name}.{field}: verifier {name!r} '
                                       f'rejects {sorted(opts)}: {e}') from None
        v.close()

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
      v = self._mod.get(name, **opts)
      if takes_rm:
        # Its reward model runs on the run's mesh, a collective: every host scores its rows.
        setattr(v, rollout.COLLECTIVE, True)
      self._cache[key] = v
    return self._cache[key]

  def can_evaluate(self, domain: str) -> bool:
    """Whether the domain's evaluation verifier can score now (its reward model exists)."""
    d = self.plan.domains[domain]
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
