"""Routing replay on the mixture-of-experts families: the samplers (the one-call one, and the paged
engine through shared prefills, preemption and streams) record each prompt and generated token's
experts, the batch carries them aligned with its tokens, the training forward replays them, and
the 'routing_mismatch' metrics count where the trainer's own routers differ (the share of sampled
tokens off in any moe sublayer, and of (token, sublayer) pairs).

Both tiny families run: tiny_moe (Qwen3-MoE-like: softmax router) in the default tier, and
tiny_hybrid (Nemotron-H-like: sigmoid router with a score-correction bias, group-limited; Mamba
layers make its compilations several times longer) in the heavy one. Everything is float32, so
the sampler's forward and the training forward pick the same experts exactly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import config as config_lib
from models import hybrid
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import sampler
from rl import train_step as train_lib

PROMPTS = [[5, 6, 7, 8, 9], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
EOS = (11, 93, 213)      # ids these weights sample often: some rows stop, some run to the cap
CONFIGS = {'hybrid': config_lib.ModelConfig.tiny_hybrid(),
           'moe': config_lib.ModelConfig.tiny_moe()}
SP = sampler.SamplingParams(max_new_tokens=12, temperature=0.8)


def _perturbed(name, params):
  """The trainer's routers nudged so their own choice differs on some tokens: the hybrid's
  score-correction bias (it steers the choice only, so the replayed weights are unchanged), the
  softmax router's weights (its replayed weights move a little too)."""
  rng = np.random.default_rng(0)
  key, scale = ('router_bias', 0.1) if name == 'hybrid' else ('router', 0.005)

  def nudge(path, x):
    if f"['{key}']" in jax.tree_util.keystr(path):
      return x + jnp.asarray(rng.normal(size=x.shape) * scale, x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(nudge, params)


@pytest.fixture(scope='module', params=[pytest.param('hybrid', marks=pytest.mark.heavy), 'moe'])
def rollout(request):
  """(name, cfg, graphdef, params, SampleOutput recorded with routing, its TrainBatch)."""
  cfg = CONFIGS[request.param]
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  # Matrices scaled up: peaked distributions, so stop tokens and distinct experts occur. A
  # leaf's own rank, not counting the leading 'layers' axis of a stack (models/hybrid.py), so
  # the same parameters are scaled whatever the layout.
  def scale(v):
    stacked = tuple(v.get_metadata().get('logical_axes') or ())[:1] == ('layers',)
    return v.replace(v.get_value() * 3) if v.get_value().ndim - stacked >= 2 else v
  params = jax.tree.map(scale, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,))
  out = samp.generate(params, PROMPTS, jax.random.key(1), SP, num_samples=2, record_routing=True)
  batch = batch_lib.from_samples(out, np.zeros(out.tokens.shape[0], np.float32))
  return request.param, cfg, graphdef, params, out, batch


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, params, batch, replay):
  """The policy's training forward as the losses run it: (log-probs of the targets, MoEStats)."""
  model = nnx.merge(graphdef, params)
  model.collect_moe_stats = True
  logprobs = batch_lib.policy_stats(model, batch, replay=replay)['logprobs']
  return logprobs, hybrid.moe_stats(model)


def _own_experts(graphdef, params, batch) -> np.ndarray:
  """[B, L, M, k] the experts the trainer's routers pick on their own (no routing given)."""
  _, stats = _forward(graphdef, params, batch._replace(routing=None), True)
  return np.moveaxis(np.asarray(stats.indices), 0, 2)


def _differs(a, b) -> np.ndarray:
  return (np.sort(a.astype(np.int64), -1) != np.sort(b.astype(np.int64), -1)).any(-1)


def test_recorded_routing_is_the_training_forwards_own_choice(rollout):
  """Every real token's recorded experts (prompt tokens, generated tokens, each row's last token
  included) are the ones the training forward's routers pick on the same row; padding is 0."""
  _, cfg, graphdef, params, out, batch = rollout
  m, k = cfg.mixers.count('moe'), cfg.experts_per_token
  rows, p = out.prompt_tokens.shape
  assert out.prompt_routing.shape == (rows, p, m, k) and out.prompt_routing.dtype == np.uint8
  assert out.routing.shape == out.tokens.shape + (m, k) and out.routing.dtype == np.uint8
  assert batch.routing.shape == batch.tokens.shape + (m, k)
  # Rows of different lengths: some stopped early (their last token's experts come from a
  # later step), some ran to the limit (from the forward after the loop).
  assert len(set(out.lengths.tolist())) > 1 and out.truncated.any() and not out.truncated.all()
  real = batch.segment_ids > 0
  own = _own_experts(graphdef, params, batch)
  np.testing.assert_array_equal(_differs(own, batch.routing)[real], False)
  assert not batch.routing[~real].any()
  # Top-k ids are distinct, so an unrecorded (zero) entry could not pass as a choice.
  assert (np.sort(batch.routing[real], -1)[..., 1:] != np.sort(batch.routing[real], -1)[..., :-1]
          ).all()


def test_recording_does_not_change_the_samples(rollout):
  name, cfg, graphdef, params, out, _ = rollout
  if name != 'moe':
    pytest.skip('one family suffices: the recording only reads what the forward computes')
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,))
  plain = samp.generate(params, PROMPTS, jax.random.key(1), SP, num_samples=2)
  assert plain.routing is None and plain.prompt_routing is None
  np.testing.assert_array_equal(plain.tokens, out.tokens)
  np.testing.assert_array_equal(plain.logprobs, out.logprobs)


def test_replay_gives_the_samplers_logprobs_under_a_perturbed_router(rollout):
  """The trainer's routers nudged: on their own they pick other experts for some tokens and the
  log-probs move off the sampler's; replaying the recorded experts brings them back (exactly
  for the hybrid's bias, which only steers the choice; nearly for the softmax router, whose
  replayed weights move with it), and the mismatch the forward counts is the real one."""
  name, cfg, graphdef, params, out, batch = rollout
  loss = batch.loss_mask > 0
  real = batch.segment_ids > 0
  m = cfg.mixers.count('moe')
  lp, stats = _forward(graphdef, params, batch, True)
  np.testing.assert_allclose(np.asarray(lp)[loss], batch.old_logprobs[loss], atol=1e-4)
  assert float(stats.mismatched) == 0 and float(stats.compared) == real.sum() * m

  nudged = _perturbed(name, params)
  own = _own_experts(graphdef, nudged, batch)
  flips = _differs(own, batch.routing) & real[..., None]
  assert flips.any()
  own_lp, measured = _forward(graphdef, nudged, batch, False)       # routes on its own
  assert float(measured.mismatched) == flips.sum()
  own_gap = np.abs(np.asarray(own_lp) - batch.old_logprobs)[loss].max()
  assert own_gap > 1e-2
  replayed_lp, replayed = _forward(graphdef, nudged, batch, True)
  replay_gap = np.abs(np.asarray(replayed_lp) - batch.old_logprobs)[loss].max()
  if name == 'hybrid':
    assert replay_gap < 1e-4
  else:
    assert replay_gap < own_gap / 10
  # Replayed, the later sublayers see the sampler's stream: the count is taken on it.
  assert float(replayed.mismatched) > 0 and float(replayed.compared) == real.sum() * m


def _sampled_np(loss_mask) -> np.ndarray:
  """[B, L] the input columns holding a learned (sampled) token, in numpy: loss_mask column t
  learns tokens[:, t + 1]."""
  sampled = np.zeros(loss_mask.shape, bool)
  sampled[:, 1:] = np.asarray(loss_mask)[:, :-1] > 0
  return sampled


def _mismatch_reference(differs, batch) -> tuple[float, float]:
  """float64 numpy (sampled-token share, pair share) from [B, L, M] differing (token, sublayer)
  pairs: a sampled token counts once however many sublayers differ; pairs over real tokens."""
  real = np.asarray(batch.segment_ids) > 0
  differs = np.asarray(differs, bool) & real[..., None]
  sampled = _sampled_np(batch.loss_mask)
  tokens = (differs.any(-1) & sampled).sum(dtype=np.float64) / sampled.sum(dtype=np.float64)
  pairs = differs.sum(dtype=np.float64) / (real.sum(dtype=np.float64) * differs.shape[-1])
  return tokens, pairs


def test_routing_mismatch_counts_a_sampled_token_once_whatever_its_sublayers(rollout):
  """A hand-built recorded routing, the trainer routing on its own (measured): a sampled token
  off in two sublayers and one off in one count once each in the sampled-token share and three
  times in the pair share; an off prompt token only in the pair share; an off padding entry in
  neither. The forward's per-token flags are exactly those tokens, and both shares match the
  numpy reference (and their counts worked by hand)."""
  name, cfg, graphdef, params, _, batch = rollout
  m, e = cfg.mixers.count('moe'), cfg.num_experts
  real = np.asarray(batch.segment_ids) > 0
  sampled = _sampled_np(batch.loss_mask)
  assert m >= 2 and sampled.any() and (real & ~sampled).any() and (~real).any()
  two, one = list(zip(*np.nonzero(sampled)))[:2]
  prompt = list(zip(*np.nonzero(real & ~sampled)))[0]
  pad = list(zip(*np.nonzero(~real)))[0]
  routing = np.array(batch.routing)
  off = np.zeros(routing.shape[:3], bool)
  for (r, t), layers in [(two, (0, m - 1)), (one, (m - 1,)), (prompt, (0,)), (pad, (0, 1))]:
    for layer in layers:
      # Another expert set: each id moved by one (mod E) is a different set of K distinct ids
      # unless the set is every expert, which K < E rules out.
      routing[r, t, layer] = (routing[r, t, layer].astype(np.int64) + 1) % e
      off[r, t, layer] = True
  assert cfg.experts_per_token < e
  built = batch._replace(routing=routing.astype(batch.routing.dtype))
  _, stats = _forward(graphdef, params, built, False)
  want_flags = off.any(-1) & real
  np.testing.assert_array_equal(np.asarray(stats.token_differs), want_flags)
  assert float(stats.mismatched) == 4 and float(stats.compared) == real.sum() * m
  tokens, pairs = _mismatch_reference(off, built)
  assert (tokens, pairs) == pytest.approx((2 / sampled.sum(), 4 / (real.sum() * m)), rel=1e-12)
  mismatched, flags = float(stats.mismatched), np.asarray(stats.token_differs)
  assert (flags & sampled).sum() / sampled.sum() == pytest.approx(tokens, rel=1e-12)
  assert mismatched / float(stats.compared) == pytest.approx(pairs, rel=1e-6)


@pytest.mark.parametrize('replay', [True, pytest.param(False, marks=pytest.mark.heavy)],
                         ids=['replayed', 'measured'])
def test_train_step_logs_the_mismatch_fraction_over_microbatches(rollout, replay):
  """'routing_mismatch' is the batch's fraction of sampled tokens whose recorded experts the
  trainer's routers would not pick in some moe sublayer, 'routing_mismatch_pairs' its fraction
  of compared (real token, moe sublayer) pairs, each summed over the microbatches before
  dividing: 0 unperturbed; perturbed, the whole batch's forward's (replayed), or where the
  trainer's own choice differs (measured, against the float64 numpy reference)."""
  name, cfg, graphdef, params, _, batch = rollout
  opt = optax.sgd(0.0)
  real = batch.segment_ids > 0
  nudged = _perturbed(name, params)
  if replay:
    _, stats = _forward(graphdef, nudged, batch, True)
    sampled = _sampled_np(batch.loss_mask)
    want = ((np.asarray(stats.token_differs) & sampled).sum() / sampled.sum(),
            float(stats.mismatched) / float(stats.compared))
  else:
    want = _mismatch_reference(
        _differs(_own_experts(graphdef, nudged, batch), batch.routing), batch)
  assert 0 < want[0] < 1 and 0 < want[1] < 1 and want[0] != want[1]
  loss = train_lib.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  step = train_lib.make_train_step(graphdef, loss, grpo.GrpoConfig(replay_routing=replay),
                                   opt, microbatches=2, donate=False)
  keys = ('routing_mismatch', 'routing_mismatch_pairs')
  _, m = step(train_lib.init_state(params, opt), batch)
  assert [float(m[k]) for k in keys] == [0.0, 0.0]
  assert not {'routing_mismatched', 'routing_compared', 'routing_mismatched_tokens',
              'routing_sampled_tokens'} & set(m)
  _, m = step(train_lib.init_state(nudged, opt), batch)
  assert [float(m[k]) for k in keys] == pytest.approx(list(want), rel=1e-6)
  # Without recorded routing there is nothing to compare: no metric.
  _, m = step(train_lib.init_state(params, opt), batch._replace(routing=None))
  assert not set(keys) & set(m)


# ------------------------------------------------------------------ the paged engine

# Prompts longer than a page, G = 2 (each prompt prefilled once, its pages shared), and a pool
# too small for every row at once (rows preempted and recomputed).
PAGED = dict(engine='paged', slots=4, page_size=4, chunk_steps=5, prefill_prompts=2, pages=9)


def _scaled(cfg):
  """(graphdef, params) of `rollout`'s peaked policy."""
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))

  def scale(v):
    stacked = tuple(v.get_metadata().get('logical_axes') or ())[:1] == ('layers',)
    return v.replace(v.get_value() * 3) if v.get_value().ndim - stacked >= 2 else v
  return graphdef, jax.tree.map(scale, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _check_replays(graphdef, params, out):
  """The trainer's own routing of every real token is the recorded one, and the replayed
  training forward gives the sampler's log-probs."""
  batch = batch_lib.from_samples(out, np.zeros(out.tokens.shape[0], np.float32))
  real = batch.segment_ids > 0
  np.testing.assert_array_equal(
      _differs(_own_experts(graphdef, params, batch), batch.routing)[real], False)
  assert not batch.routing[~real].any()
  lp, stats = _forward(graphdef, params, batch, True)
  loss = batch.loss_mask > 0
  np.testing.assert_allclose(np.asarray(lp)[loss], batch.old_logprobs[loss], atol=1e-4)
  assert float(stats.mismatched) == 0


@pytest.mark.heavy
@pytest.mark.parametrize('name', ['moe', 'hybrid'])
def test_the_paged_engine_records_the_routing_the_trainer_replays(name):
  """Through shared prompt prefills and preemption (the hybrid's Mamba states too), the paged
  engine's recorded routing is the training forward's own, the one-call sampler's, and the
  samples are those of a call without recording."""
  cfg = CONFIGS[name]
  graphdef, params = _scaled(cfg)
  kw = dict(eos_ids=EOS, pad_id=0, prompt_buckets=(16,), new_token_buckets=(16,),
            batch_buckets=(8,))
  paged = sampler.Sampler(graphdef, cfg, **kw, **PAGED)
  out = paged.generate(params, PROMPTS, jax.random.key(1), SP, num_samples=2,
                       record_routing=True)
  [eng] = paged._rollout.engines.values()    # pylint: disable=protected-access
  assert eng.preemptions > 0 and paged.pages_in_use == 0
  assert len(set(out.lengths.tolist())) > 1 and out.truncated.any()
  _check_replays(graphdef, params, out)
  plain = paged.generate(params, PROMPTS, jax.random.key(1), SP, num_samples=2)
  assert plain.routing is None
  np.testing.assert_array_equal(plain.tokens, out.tokens)
  one = sampler.Sampler(graphdef, cfg, **kw).generate(params, PROMPTS, jax.random.key(1), SP,
                                                     num_samples=2, record_routing=True)
  np.testing.assert_array_equal(one.tokens, out.tokens)
  np.testing.assert_array_equal(_differs(one.routing, out.routing), False)
  np.testing.assert_array_equal(_differs(one.prompt_routing, out.prompt_routing), False)


class _Feed:
  """A stream source: two feeds of prompts, every finished group kept."""

  def __init__(self):
    self.feeds, self.got = [PROMPTS[:2], PROMPTS[2:]], {}

  def more(self):
    return self.feeds.pop(0) if self.feeds else None

  def finished(self, groups, samples):
    for j, grp in enumerate(groups):
      self.got[grp] = batch_lib.take_rows(samples, np.arange(2 * j, 2 * j + 2))

  def stop(self):
    return False


@pytest.mark.heavy
def test_streamed_groups_carry_their_routing():
  cfg = CONFIGS['moe']
  graphdef, params = _scaled(cfg)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), **PAGED)
  feed = _Feed()
  assert samp.stream(params, jax.random.key(1), SP, 2, feed, max_prompt_len=16, rows=8,
                     record_routing=True) == 4
  out = batch_lib.concat_rows([feed.got[i] for i in range(4)])
  assert out.routing is not None and out.prompt_routing.shape[1] == 16
  _check_replays(graphdef, params, out)


def _abstract(cfg):
  return nnx.split(nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0))))


def test_recording_needs_experts():
  dense = config_lib.ModelConfig.tiny(vocab_size=64, embed_dim=16, num_layers=1, num_heads=2,
                                      num_kv_heads=1, head_dim=8, mlp_dim=16)
  graphdef, params = _abstract(dense)         # refused before any compilation
  samp = sampler.Sampler(graphdef, dense, eos_ids=(1,), prompt_buckets=(8,),
                         new_token_buckets=(4,))
  sp = sampler.SamplingParams(max_new_tokens=2)
  with pytest.raises(ValueError, match="has no 'moe' sublayers"):
    samp.generate(params, [[2, 3]], 0, sp, record_routing=True)
  paged = sampler.Sampler(graphdef, dense, eos_ids=(1,), prompt_buckets=(8,),
                          new_token_buckets=(4,), engine='paged')
  with pytest.raises(ValueError, match="has no 'moe' sublayers"):
    paged.stream(params, 0, sp, 1, _Feed(), max_prompt_len=8, rows=1, record_routing=True)


# ------------------------------------------------------------------ the batch carries it

def _samples(prompt_lens, comp_lens, p, n, m=2, k=2, seed=0):
  """A SampleOutput-like batch whose routing ids encode (row, column) so moves are visible."""
  b = len(prompt_lens)
  rng = np.random.default_rng(seed)
  pm = np.zeros((b, p), np.int32)
  cm = np.zeros((b, n), np.int32)
  for i, (a, c) in enumerate(zip(prompt_lens, comp_lens)):
    pm[i, p - a:] = 1
    cm[i, :c] = 1
  pt = rng.integers(2, 50, (b, p)).astype(np.int32) * pm
  ct = rng.integers(2, 50, (b, n)).astype(np.int32) * cm
  code = lambda w, off: ((np.arange(b)[:, None] * 10 + off + np.arange(w)[None]) % 256)
  pr = np.broadcast_to(code(p, 0)[..., None, None], (b, p, m, k)).astype(np.uint8)
  cr = np.broadcast_to(code(n, p)[..., None, None], (b, n, m, k)).astype(np.uint8)
  z = np.zeros((b, n), np.float32)
  return sampler.SampleOutput(prompt_tokens=pt, prompt_mask=pm, tokens=ct, mask=cm,
                              logprobs=z, sampling_logprobs=z,
                              lengths=cm.sum(1).astype(np.int32), truncated=np.zeros(b, bool),
                              prompt_routing=pr * pm[..., None, None],
                              routing=cr * cm[..., None, None])


def test_batch_routing_follows_the_input_tokens_through_packing_and_concatenation():
  s = _samples([3, 1, 2], [2, 4, 1], p=4, n=4)
  batch = batch_lib.from_samples(s, np.ones(3, np.float32))
  # Column t of routing is tokens[:, t]'s (input-aligned, unlike the target fields).
  np.testing.assert_array_equal(batch.routing,
                                np.concatenate([s.prompt_routing, s.routing], 1))
  packed = batch_lib.pack(batch, 16)
  for r in range(3):
    tok = batch.tokens[r][batch.segment_ids[r] > 0]
    rou = batch.routing[r][batch.segment_ids[r] > 0]
    hits = [(i, j) for i in range(packed.tokens.shape[0])
            for j in range(packed.tokens.shape[1] - tok.size + 1)
            if (packed.tokens[i, j:j + tok.size] == tok).all()
            and (packed.segment_ids[i, j:j + tok.size] > 0).all()]
    assert hits
    i, j = hits[0]
    np.testing.assert_array_equal(packed.routing[i, j:j + tok.size], rou)
  assert not packed.routing[packed.segment_ids == 0].any()
  # Rounds of different widths: prompts left-padded, completions right-padded, routing alike.
  t = _samples([5], [6], p=5, n=6, seed=1)
  both = batch_lib.concat_rows([s, t])
  assert both.prompt_routing.shape == (4, 5, 2, 2) and both.routing.shape == (4, 6, 2, 2)
  np.testing.assert_array_equal(both.prompt_routing[:3, 1:], s.prompt_routing)
  np.testing.assert_array_equal(both.routing[:3, :4], s.routing)
  np.testing.assert_array_equal(both.routing[3], t.routing[0])
  assert not both.prompt_routing[:3, 0].any() and not both.routing[:3, 4:].any()
  picked = batch_lib.take_rows(both, np.array([3, 0]))
  np.testing.assert_array_equal(picked.routing[0], t.routing[0])
  # Unrecorded samples keep None through the same paths.
  plain = batch_lib.take_rows(batch_lib.concat_rows([s._replace(prompt_routing=None,
                                                                routing=None)] * 2), [0])
  assert plain.routing is None and batch_lib.from_samples(plain, [0.0]).routing is None
  with pytest.raises(ValueError, match='set in some chunks and not others'):
    batch_lib.concat_rows([s, t._replace(prompt_routing=None, routing=None)])


@pytest.mark.parametrize('engine', ['one_call', 'paged'])
def test_the_planned_sampler_program_carries_the_recording_buffers(engine):
  """`launch.plan` lowers an RL stage's sampler with `record_routing` when the stage records
  it (`launch/plan/programs.py` sampler_lowering): its outputs then hold the routing, in the
  compact dtype (the paged decode call's per step and its tokens fed)."""
  cfg = CONFIGS['moe']
  graphdef, params = _abstract(cfg)
  kw = dict(engine='paged', slots=2, page_size=4, chunk_steps=3) if engine == 'paged' else {}
  samp = sampler.Sampler(graphdef, cfg, eos_ids=(1,), prompt_buckets=(8,),
                         new_token_buckets=(4,), **kw)
  sp = sampler.SamplingParams(max_new_tokens=4)
  _, _, what = samp.abstract_args(params, 2, 8, sp, record_routing=True)
  assert what.endswith('recording routing')
  got = samp.lower(params, 2, 8, sp, record_routing=True).out_info
  shapes = lambda xs: [(tuple(x.shape), str(x.dtype)) for x in xs]
  if engine == 'paged':      # [slots, chunk + 1 (a tail), M, k] and the tokens each row fed
    assert len(samp.lower(params, 2, 8, sp).out_info) == 6 and len(got) == 8
    assert shapes(got[6:]) == [((2, 4, 2, 2), 'uint8'), ((2,), 'int32')]
  else:                      # the prompt's and the generated tokens'
    assert shapes([got.prompt_routing, got.routing]) == [((2, 8, 2, 2), 'uint8'),
                                                          ((2, 4, 2, 2), 'uint8')]
