"""Where a stage's TrainState comes from: its starting policy (copied), and the optimizer state
it carries over (`reset_optimizer=False`) or starts fresh (the default); where it goes: the
stage's HF export, servable with the run's tokenizer."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cascade import policies as policies_lib
from cascade.kinds import base
from models import hf
from models import transformer
from rl import train_step as train_lib


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _equal(a, b):
  la, lb = _leaves(a), _leaves(b)
  return len(la) == len(lb) and all(x.shape == y.shape and (x == y).all() for x, y in zip(la, lb))


def _finish_sft(plan, workdir):
  """Writes the SFT stage's final checkpoint: its own params and a non-trivial Adam state."""
  st = plan.stages[0]
  pol = policies_lib.Policies(plan, str(workdir), None, plan.rules)
  opt = base.make_optimizer(st).tx
  params = nnx.split(transformer.create(plan.model, 11))[1]
  state = train_lib.init_state(params, opt, seed=5)
  opt_state = jax.tree.map(lambda x: x + (7 if jnp.issubdtype(x.dtype, jnp.integer) else 0.25),
                           state.opt_state)
  state = state._replace(opt_state=opt_state)
  ckpts = pol.checkpoints(st)
  ckpts.save(st.steps, state, {'step': st.steps})
  pol.close()
  return state


@pytest.fixture
def plan(fakes):
  return fakes.toy_config([
      fakes.SFT_STAGE,
      fakes.rl_stage('keep', ['a'], reset_optimizer=False),
      fakes.rl_stage('fresh', ['a'], init_from='sft'),
      fakes.rl_stage('other_opt', ['a'], init_from='sft', reset_optimizer=False,
                     optimizer=dict(lr=1e-3, clip_norm=0.0))])


def _initial(plan, workdir, name, seed=9):
  pol = policies_lib.Policies(plan, str(workdir), None, plan.rules)   # a fresh process
  st = plan.stage(name)
  opt = base.make_optimizer(st).tx
  return pol, opt, pol.initial_state(st, opt, seed)


def test_reset_optimizer_false_carries_the_previous_stages_optimizer_state(plan, tmp_path):
  sft = _finish_sft(plan, tmp_path)
  _, _, state = _initial(plan, tmp_path, 'keep')
  assert _equal(state.params, sft.params)              # starts from the SFT policy
  assert _equal(state.opt_state, sft.opt_state)        # and its Adam moments and count
  assert int(state.step) == 0 and int(state.skipped) == 0
  np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(jax.random.PRNGKey(9)))


def test_reset_optimizer_default_starts_a_fresh_optimizer(plan, tmp_path):
  sft = _finish_sft(plan, tmp_path)
  _, opt, state = _initial(plan, tmp_path, 'fresh')
  assert _equal(state.params, sft.params)
  assert _equal(state.opt_state, opt.init(state.params))
  assert not _equal(state.opt_state, sft.opt_state)
  assert not any(x.any() for x in _leaves(state.opt_state))      # zero moments and counts


def test_a_carried_optimizer_state_must_fit(plan, tmp_path):
  _finish_sft(plan, tmp_path)
  with pytest.raises(ValueError, match="reset_optimizer=False, but the optimizer state of "
                                       "stage 'sft' does not fit"):
    _initial(plan, tmp_path, 'other_opt')


def test_reset_optimizer_false_from_the_initial_policy_warns_and_starts_fresh(fakes, tmp_path,
                                                                              caplog):
  plan = fakes.toy_config([fakes.rl_stage('first', ['a'], reset_optimizer=False)])
  with caplog.at_level(logging.WARNING):
    pol, opt, state = _initial(plan, tmp_path, 'first')
  assert 'has no optimizer state; starting a fresh one' in caplog.text
  assert _equal(state.opt_state, opt.init(state.params))
  assert _equal(state.params, nnx.split(transformer.create(plan.model, plan.seed))[1])
  # The policy kept in memory is copied, not handed to the (donating) train step.
  kept = pol.params_of(('initial',))
  assert all(x is not y for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(kept)))


def test_a_stage_export_is_servable_with_the_runs_tokenizer(copy_cascade, tmp_path):
  """export_hf writes the run's tokenizer and chat template beside the weights: transformers'
  AutoTokenizer gives the prompt ids the run samples from, and the export loads back."""
  transformers = pytest.importorskip('transformers')
  import importlib.util  # pylint: disable=g-import-not-at-top

  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  path = copy_cascade(tmp_path, train=4, eval_=2, sft=8)
  spec = importlib.util.spec_from_file_location('export_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  plan = config_lib.validate(module.get_config())
  pol = policies_lib.Policies(plan, str(tmp_path / 'run'), None, plan.rules)
  params = nnx.split(transformer.create(plan.model, 3))[1]
  out = pol.export_hf(plan.stages[0], params)
  auto = transformers.AutoTokenizer.from_pretrained(out)
  tok = tokenizer_lib.load(plan.tokenizer_path)
  record = {'messages': [{'role': 'user', 'content': 'Copy 7.'}]}
  for mode in (True, False, None):
    kw = {} if mode is None else {'thinking': mode}
    ids = auto.apply_chat_template(record['messages'], add_generation_prompt=True, **kw)
    ids = ids['input_ids'] if hasattr(ids, 'keys') else ids
    assert list(ids) == tok.encode(rollout.prompt_text(record, mode))
  back = nnx.split(hf.load_model(out))[1]
  assert _equal(back, params)
