"""The paged engine (continuous batching over a paged KV cache) against the one-call sampler."""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from models import config as config_lib
from models import sharding
from models import transformer
from rl import engine
from rl import engine_options
from rl import sampler

CFG = config_lib.ModelConfig.tiny()          # GQA: 4 heads over 2 kv heads
EOS = (3, 17)
_RS = np.random.RandomState(0)
# Mixed prompt lengths: one token (nothing to prefill), a whole page plus one
# (len - 1 a page multiple: no partial page), and ragged ones.
PROMPTS = [[9], list(range(20, 29)), *[list(_RS.randint(1, CFG.vocab_size, size=n))
                                      for n in (5, 13, 31, 2, 24, 17)]]
G = 3
LIMITS = _RS.randint(1, 41, size=len(PROMPTS) * G)          # a per-row stop position
SP = sampler.SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95)


def _paged(graphdef, mesh=None, **kw):
  kw = dict(dict(page_size=8), **kw)
  return sampler.Sampler(graphdef, CFG, eos_ids=EOS, pad_id=0, mesh=mesh, engine='paged',
                         prompt_buckets=(16, 32), new_token_buckets=(16, 64), **kw)


@pytest.fixture(scope='module')
def reference(policy):
  """The one-call sampler's rows for the module's workload (sampled and greedy)."""
  one_call = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16, 32),
                             new_token_buckets=(16, 64))
  greedy = sampler.SamplingParams(max_new_tokens=40, greedy=True)
  return {sp.greedy: one_call.generate(policy[1], PROMPTS, jax.random.key(5), sp,
                                       num_samples=G, row_limits=LIMITS)
          for sp in (SP, greedy)}


def _assert_same_rows(out, ref, atol=1e-4):
  for name in ('prompt_tokens', 'prompt_mask', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  # Another layout adds in another order: equal up to float32 rounding.
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=atol, rtol=0)
  np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=atol, rtol=0)


def test_row_limits_stop_rows_in_the_one_call_sampler(reference):
  out = reference[False]
  assert np.all(out.lengths <= LIMITS)
  hit_limit = out.lengths == LIMITS
  # A row ends at its limit (truncated unless its last token stops) or on a stop token.
  assert np.all(out.truncated | ~hit_limit | np.isin(out.tokens[np.arange(len(LIMITS)),
                                                                  out.lengths - 1], EOS))
  assert np.all(hit_limit | ~out.truncated)
  assert out.truncated.any() and (~out.truncated).any(), 'the workload needs both endings'


@pytest.mark.parametrize('slots,pages,chunk', [
    pytest.param(8, None, 8, marks=pytest.mark.heavy),   # room for every slot's longest row
    (4, 14, 5),     # a pool of barely one longest row: rows are preempted and recomputed
    (4, 14, 48),    # the same pool, one chunk per row: admission reserves it all, no preemption
    pytest.param(3, 20, 16, marks=pytest.mark.heavy),    # fewer slots than a prompt's samples
    pytest.param(3, 'least', 3, marks=pytest.mark.heavy),  # the smallest pool: one longest row
    pytest.param(24, None, 64, marks=pytest.mark.heavy)],  # every row at once
    ids=['roomy', 'preempting', 'reserved', 'few_slots', 'least_pool', 'all_rows'])
def test_engine_rows_equal_the_one_call_sampler(policy, reference, slots, pages, chunk):
  if pages == 'least':
    pages = -(-(max(len(q) for q in PROMPTS) - 1 + int(LIMITS.max())) // 8) + 1
    with pytest.raises(ValueError, match='cannot hold one row'):
      _paged(policy[0], slots=slots, pages=pages - 1).generate(
          policy[1], PROMPTS, jax.random.key(5), SP, num_samples=G, row_limits=LIMITS)
  eng = _paged(policy[0], slots=slots, pages=pages, chunk_steps=chunk, prefill_prompts=3)
  out = eng.generate(policy[1], PROMPTS, jax.random.key(5), SP, num_samples=G,
                     row_limits=LIMITS)
  _assert_same_rows(out, reference[False])
  assert eng.pages_in_use == 0, 'pages leaked'
  run = eng._rollout.engines[slots]
  if chunk >= SP.max_new_tokens:   # a row's first chunk is its whole length
    assert run.preemptions == 0
  elif pages is not None and pages < 20:
    assert run.preemptions > 0
  assert eng.generated_tokens == out.lengths.sum()
  assert eng.decode_slots >= eng.generated_tokens


@pytest.mark.parametrize('layers', ['scan', 'unrolled'])
def test_scanned_and_unrolled_decode_sample_the_same_rows(policy, reference, layers):
  # decode_layers='scan' (one loop body over the stacked weights and pool, as accelerators
  # run it) and 'unrolled' (per-layer weights and pools made once per decode call, the pools
  # stacked again after it) sample the one-call rows, with rows preempted between calls.
  # The scanned side's model scans its layers (scan_layers='auto' loops them on these CPUs).
  graphdef = (nnx.graphdef(transformer.create(CFG.replace(scan_layers=True), seed=0))
              if layers == 'scan' else policy[0])
  eng = _paged(graphdef, slots=4, pages=14, chunk_steps=5, prefill_prompts=3,
               decode_layers=layers)
  out = eng.generate(policy[1], PROMPTS, jax.random.key(5), SP, num_samples=G,
                     row_limits=LIMITS)
  assert eng._rollout.engines[4].unroll == (layers == 'unrolled')
  _assert_same_rows(out, reference[False])
  assert eng.pages_in_use == 0 and eng._rollout.engines[4].preemptions > 0
  # Another call makes its empty pool with the program the first compiled.
  pools = eng._rollout.engines[4]._init_pool._cache_size()
  eng.generate(policy[1], PROMPTS[:2], jax.random.key(6), SP, num_samples=G)
  assert eng._rollout.engines[4]._init_pool._cache_size() == pools
  if layers == 'unrolled':
    model = nnx.merge(*policy)
    k, v = transformer.init_pages(CFG, 4, 8)
    cache = transformer.PagedCache(k=k, v=v, page_table=jnp.zeros((1, 1), jnp.int32),
                                   lengths=jnp.zeros(1, jnp.int32), live=jnp.ones(1, bool))
    with pytest.raises(ValueError, match='split per layer'):
      model.decode_paged(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), cache,
                         layers=model.layer_states())


@pytest.mark.heavy
def test_greedy_engine_equals_one_call(policy, reference):
  eng = _paged(policy[0], slots=6, chunk_steps=7)
  out = eng.generate(policy[1], PROMPTS, jax.random.key(5),
                     sampler.SamplingParams(max_new_tokens=40, greedy=True), num_samples=G,
                     row_limits=LIMITS)
  _assert_same_rows(out, reference[True])
  np.testing.assert_array_equal(out.sampling_logprobs, 0)


@pytest.mark.heavy
def test_engine_logprobs_equal_a_training_forward(policy):
  eng = _paged(policy[0], slots=5, chunk_steps=6)
  out = eng.generate(policy[1], PROMPTS, jax.random.key(3), SP, num_samples=2)
  tokens = np.concatenate([out.prompt_tokens, out.tokens], 1)
  seg = np.concatenate([out.prompt_mask, out.mask], 1)
  pos = np.maximum(np.cumsum(seg, 1) - 1, 0)
  logits = nnx.merge(*policy)(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  p = out.prompt_tokens.shape[1]
  x = np.asarray(logits, np.float64)[:, p - 1:-1]
  logp = x - x.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  ref = np.take_along_axis(logp, out.tokens[..., None], -1)[..., 0] * out.mask
  np.testing.assert_allclose(out.logprobs, ref, atol=1e-4, rtol=0)
  assert out.mask.sum() > len(PROMPTS) * 2


@pytest.mark.heavy
def test_a_rows_tokens_do_not_depend_on_its_neighbours(policy):
  """Rows keep their tokens when other rows (longer, shorter, more of them) run beside them."""
  eng = _paged(policy[0], slots=4, chunk_steps=4)
  alone = eng.generate(policy[1], PROMPTS[:3], jax.random.key(9), SP, num_samples=G,
                       row_limits=LIMITS[:3 * G])
  crowd = eng.generate(policy[1], PROMPTS, jax.random.key(9), SP, num_samples=G,
                       row_limits=LIMITS)
  n = 3 * G
  for name in ('tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(crowd, name)[:n], getattr(alone, name), err_msg=name)
  np.testing.assert_allclose(crowd.logprobs[:n], alone.logprobs, atol=1e-5, rtol=0)


@pytest.mark.heavy
def test_compiles_are_bounded_by_the_shapes(policy):
  eng = _paged(policy[0], slots=4, chunk_steps=8)
  for seed, order in ((0, slice(None)), (1, slice(None, None, -1)), (2, slice(1, None, 2))):
    eng.generate(policy[1], PROMPTS[order], jax.random.key(seed), SP, num_samples=G,
                 row_limits=LIMITS.reshape(len(PROMPTS), G)[order].reshape(-1))
  # Prefill: prompt buckets 16 and 32, or copies only; decode: live rows packed into 1, 2 or
  # 4 rows (the pages a step reads are a loop bound, not a shape).
  assert 0 < eng.compile_count <= 3 + 3
  before = eng.compile_count
  eng.generate(policy[1], PROMPTS, jax.random.key(0), SP, num_samples=G, row_limits=LIMITS)
  assert eng.compile_count == before, 'a repeated call recompiled'


@pytest.mark.heavy
@pytest.mark.parametrize('pages', [None, 4 * 10])
def test_sharded_engine_equals_unsharded(make_policy, reference, pages):
  """Slots and the page pool split over the 4 batch shards (each slot's pages, and its prompt's,
  on its own shard); with 10 pages per shard rows are preempted within their shard."""
  assert jax.device_count() >= 8
  mesh = sharding.make_mesh((2, 2, 2))
  graphdef, params = make_policy(mesh)
  eng = _paged(graphdef, mesh=mesh, slots=8, chunk_steps=8, pages=pages)
  out = eng.generate(params, PROMPTS, jax.random.key(5), SP, num_samples=G, row_limits=LIMITS)
  _assert_same_rows(out, reference[False])
  assert eng.pages_in_use == 0
  [e] = eng._rollout.engines.values()
  assert e.shards == 4 and (e.preemptions > 0) == (pages is not None)
  with sharding.use_mesh(mesh):
    pool = jax.jit(lambda: transformer.init_pages(CFG, 48, 8))()[0]
  assert pool.sharding.shard_shape(pool.shape)[2] == 12     # the pages axis split 4 ways


def _paged_case(rng, lengths, n=4, kh=2, h=8, ps=4, m=3):
  s = len(lengths)
  num_pages = s * m + 1
  table = rng.permutation(num_pages)[:s * m].reshape(s, m).astype(np.int32)
  k_pages = rng.normal(size=(kh, num_pages, ps, h)).astype(np.float32)
  v_pages = rng.normal(size=(kh, num_pages, ps, h)).astype(np.float32)
  q = rng.normal(size=(s, n, h)).astype(np.float32)
  return q, k_pages, v_pages, np.asarray(lengths, np.int32), table


@pytest.mark.parametrize('lengths', [
    [1, 7, 12],
    # Skewed and shuffled, 11 slots (groups of 11, 5, 2, 1): the longest alone past block 1.
    [3, 12, 1, 4, 2, 9, 4, 1, 5, 2, 4],
])
def test_paged_attention_equals_dense_over_the_same_tokens(lengths):
  q, k_pages, v_pages, lengths, table = _paged_case(np.random.default_rng(0), lengths)
  (s, n, h), (kh, _, ps, _), m = q.shape, k_pages.shape, table.shape[1]
  got = attention.paged_attend(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                               jnp.asarray(lengths), jnp.asarray(table),
                               pages_per_compute_block=1)
  for i in range(s):   # float64 reference: the slot's tokens in order, GQA by head group
    keys = k_pages[:, table[i]].reshape(kh, m * ps, h)[:, :lengths[i]].astype(np.float64)
    vals = v_pages[:, table[i]].reshape(kh, m * ps, h)[:, :lengths[i]].astype(np.float64)
    for head in range(n):
      g = head // (n // kh)
      logit = keys[g] @ q[i, head] / np.sqrt(h)
      p = np.exp(logit - logit.max())
      np.testing.assert_allclose(got[i, head], (p / p.sum()) @ vals[g], atol=1e-5)


def test_paged_attention_per_shard_equals_one_device():
  rng = np.random.default_rng(1)
  case = _paged_case(rng, rng.integers(1, 13, 8))
  want = attention.paged_attend(*map(jnp.asarray, case), pages_per_compute_block=1)
  with sharding.use_mesh(sharding.make_mesh((2, 2, 2))):   # slots over 4, heads over 2
    got = jax.jit(functools.partial(attention.paged_attend, pages_per_compute_block=1))(
        *map(jnp.asarray, case))
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_planned_calls_have_the_shapes_of_the_run(policy):
  """launch.plan lowers the engine's decode and prefill calls from abstract arguments: they are
  the shapes and dtypes the run passes (the longest prompt's bucket, the bucketed row)."""
  eng = _paged(policy[0], slots=4)
  seen = {}
  for name in ('_prefill', '_decode'):
    real = getattr(eng._rollout.engine(4), name)

    def spy(*args, real=real, name=name, **kw):
      sig = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), args[1:])
      if sig not in seen.setdefault(name, []):
        seen[name].append(sig)
      return real(*args, **kw)
    setattr(eng._rollout.engine(4), name, spy)
  eng.generate(policy[1], PROMPTS, jax.random.key(0), SP, num_samples=G, row_limits=LIMITS)
  longest = max(map(len, PROMPTS))
  whats = {}
  for program, name in (('prefill', '_prefill'), ('decode', '_decode')):
    args, _, whats[program] = eng.abstract_args(policy[1], len(PROMPTS) * G, longest, SP, G,
                                                program)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), args[1:]) in seen[name], program
  # The plan's decode call is the run's largest: every slot live (smaller calls pack live slots).
  assert max(sig[1].lengths[0][0] for sig in seen['_decode']) == 4
  # Prefill calls of 0 (only copies), 16 and 32 tokens: the plan's is the largest.
  assert sorted(sig[3][0][1] for sig in seen['_prefill']) == [0, 16, 32]
  assert whats['prefill'].startswith('paged engine prefill: 8 prompts x 32 tokens')
  with pytest.raises(ValueError, match="no program 'prefill'"):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS).abstract_args(policy[1], 4, 4, SP, 1,
                                                               'prefill')


def test_engine_options_and_pool_errors(policy):
  with pytest.raises(ValueError, match='engine='):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, engine='vllm')
  with pytest.raises(ValueError, match='page_size'):
    _paged(policy[0], slots=2, page_size=0)
  with pytest.raises(ValueError, match='row_limits'):
    _paged(policy[0], slots=2).generate(policy[1], PROMPTS, 0, SP, row_limits=[0] * 8)
  with pytest.raises(ValueError, match='pages=3 cannot hold one row'):
    _paged(policy[0], slots=2, pages=3).generate(policy[1], PROMPTS, 0, SP)
  mesh = sharding.make_mesh((2, 2, 2))
  with pytest.raises(ValueError, match='pages=50 must split evenly over the 4 batch shards'):
    _paged(policy[0], slots=4, pages=50, mesh=mesh)._rollout.engine(4).pool_pages(8, 8)
  with pytest.raises(ValueError, match='pages=36 cannot hold one row of 72 tokens .* on each '
                     'of 4 batch shards'):
    _paged(policy[0], slots=4, pages=36, mesh=mesh)._rollout.engine(4).pool_pages(72, 72)
  assert _paged(policy[0], slots=2, cache_tokens_per_device=160)._rollout.engine(
      2).opt.pages == 20
  # The budget is per device: the pool, split over 4 batch shards, has 4 times the pages.
  assert _paged(policy[0], slots=4, cache_tokens_per_device=160,
                mesh=sharding.make_mesh((2, 2, 2)))._rollout.engine(4).opt.pages == 80
  assert engine_options.EngineOptions(slots=2).pages is None
  with pytest.raises(ValueError, match='slots=6 must be a multiple of the mesh.s 4 batch'):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, engine='paged', slots=6,
                    mesh=sharding.make_mesh((2, 2, 2)))



def test_the_sampler_takes_the_engine_options_as_declared_once(policy):
  """The Sampler declares none of its options itself: it takes SamplerOptions' fields (the
  engine's among them) as they are, checks them there when it is built, and each engine runs
  with them."""
  names = {f.name for f in dataclasses.fields(engine_options.SamplerOptions)}
  assert not names & set(inspect.signature(sampler.Sampler.__init__).parameters)
  given = dict(slots=2, page_size=8, pages=12, chunk_steps=4, prefill_prompts=2,
               decode_rows='all')
  s = sampler.Sampler(policy[0], CFG, eos_ids=EOS, engine='paged', **given)
  assert s._rollout.engine(2).opt == engine_options.EngineOptions(**given)
  with pytest.raises(ValueError, match=r'^SamplerOptions.chunk_steps=0: must be an int >= 1$'):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, engine='paged', chunk_steps=0)

# ------------------------------------------------------------------ streaming (Sampler.stream)

class _Feed:
  """A stream source: feeds PROMPTS in `batches` (a 'wait' entry answers "none yet" once),
  records every finished group, and stops once `stop_after` groups (in any order) ended."""

  def __init__(self, batches, stop_after=None, limits=False):
    self.batches = list(batches)
    self.stop_after = stop_after
    self.limits = limits
    self.groups: dict[int, object] = {}
    self.calls = []

  def more(self):
    self.calls.append('more')
    if not self.batches:
      return None
    b = self.batches.pop(0)
    if b == 'wait':
      return []
    prompts = [PROMPTS[i] for i in b]
    if not self.limits:
      return prompts
    return prompts, LIMITS.reshape(len(PROMPTS), G)[b].reshape(-1)

  def finished(self, groups, samples):
    assert groups == sorted(groups) and not set(groups) & set(self.groups)
    assert samples.tokens.shape[0] == len(groups) * G
    for j, g in enumerate(groups):
      self.groups[g] = jax.tree.map(lambda x: x[j * G:(j + 1) * G], samples)

  def stop(self):
    return self.stop_after is not None and len(self.groups) >= self.stop_after


@pytest.fixture(scope='module')
def unlimited(policy):
  """The one-call sampler's rows of every prompt, no per-row limits (a stream has none)."""
  one_call = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16, 32),
                             new_token_buckets=(16, 64))
  return one_call.generate(policy[1], PROMPTS, jax.random.key(5), SP, num_samples=G)


def _assert_group_equals(got, ref, g, width):
  rows = slice(g * G, (g + 1) * G)
  p = ref.prompt_tokens.shape[1]
  np.testing.assert_array_equal(got.prompt_tokens[:, width - p:], ref.prompt_tokens[rows])
  assert not got.prompt_tokens[:, :width - p].any() and not got.prompt_mask[:, :width - p].any()
  for name in ('tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(got, name), getattr(ref, name)[rows], err_msg=name)
  np.testing.assert_allclose(got.logprobs, ref.logprobs[rows], atol=1e-4, rtol=0)


@pytest.mark.heavy
@pytest.mark.parametrize('limits', [False, True], ids=['max_new_tokens', 'row_limits'])
def test_streamed_groups_equal_one_call_over_every_fed_prompt(policy, unlimited, reference,
                                                              limits):
  """Prompts fed in batches as the queue runs dry (one "none yet" answer between them) give the
  rows of one call over all of them, each group handed over once, no page left behind."""
  ref = reference[False] if limits else unlimited
  eng = _paged(policy[0], slots=4, chunk_steps=5, prefill_prompts=2)
  feed = _Feed([[0, 1, 2], 'wait', [3, 4, 5], [6, 7]], limits=limits)
  fed = eng.stream(policy[1], jax.random.key(5), SP, G, feed, max_prompt_len=32, rows=12)
  assert fed == len(PROMPTS) and sorted(feed.groups) == list(range(len(PROMPTS)))
  for g, got in feed.groups.items():
    _assert_group_equals(got, ref, g, 32)
  assert eng.pages_in_use == 0
  assert feed.calls.count('more') == 5          # 4 batches (one of them 'wait'), then None
  assert eng.generated_tokens == ref.lengths.sum()


@pytest.mark.heavy
def test_a_stopped_stream_cancels_what_runs_and_keeps_what_ended(policy, unlimited):
  eng = _paged(policy[0], slots=4, chunk_steps=4)
  feed = _Feed([[0, 1, 2, 3, 4, 5, 6, 7]], stop_after=2)
  eng.stream(policy[1], jax.random.key(5), SP, G, feed, max_prompt_len=32, rows=6)
  assert 2 <= len(feed.groups) < len(PROMPTS)
  for g, got in feed.groups.items():
    _assert_group_equals(got, unlimited, g, 32)
  assert eng.pages_in_use == 0, 'a cancelled row kept its pages'
  # Cancelled rows are paid for but not counted as generated.
  ended = sum(int(s.lengths.sum()) for s in feed.groups.values())
  assert eng.generated_tokens == ended < eng.decode_slots
  full = _paged(policy[0], slots=4, chunk_steps=4)
  full.stream(policy[1], jax.random.key(5), SP, G, _Feed([list(range(8))]), 32, rows=6)
  assert eng.decode_slots < full.decode_slots


def test_a_stream_stopped_mid_group_counts_only_handed_over_tokens(policy):
  # Two slots for groups of three: when the stream stops, later groups have some rows ended
  # and others running; none of their tokens count as generated, and no page stays taken.
  eng = _paged(policy[0], slots=2, chunk_steps=4)
  feed = _Feed([[1, 3, 5, 7]], stop_after=1)
  eng.stream(policy[1], jax.random.key(7), SP, G, feed, max_prompt_len=32, rows=6)
  assert len(feed.groups) >= 1
  assert eng.generated_tokens == sum(int(s.lengths.sum()) for s in feed.groups.values())
  assert eng.generated_tokens < eng.decode_slots and eng.pages_in_use == 0


def test_default_pool_and_a_one_page_pool(policy):
  make = lambda **kw: engine.Engine(policy[0], CFG, engine_options.EngineOptions(**kw), eos_ids=EOS,
                                    pad_id=0, prompt_buckets=(16, 32))
  eng = make(slots=3, page_size=8)
  # A power of two pages per slot (one pool shape per row bucket), plus the scratch page.
  assert [eng.pool_pages(10, t) for t in (8, 9, 40, 64, 65)] == [4, 7, 25, 25, 49]
  assert engine_options.EngineOptions(slots=1, pages=1).pages == 1     # the smallest pool is legal
  # Page-table columns: whole blocks of the attention's pages per block, enough for the row.
  bp = engine._BLOCK_PAGES
  for t in (1, 8, 9, 8 * bp, 8 * bp + 1, 5 * 8 * bp - 3):
    cols = eng.table_pages(t)
    assert cols % bp == 0 and (cols - bp) * 8 < t <= cols * 8, (t, cols)
  with pytest.raises(ValueError, match='pages=1 cannot hold one row of 9 tokens'):
    make(slots=1, pages=1, page_size=8).pool_pages(9, 16)


def test_engine_checks_what_a_stream_feeds_it(policy):
  # Driven directly (Sampler.stream checks the same before the engine sees it).
  eng = engine.Engine(policy[0], CFG, engine_options.EngineOptions(slots=2, page_size=8), eos_ids=EOS,
                      pad_id=0, prompt_buckets=(16, 64))

  class Feed:
    def __init__(self, got):
      self.got = got
    def more(self):
      return self.got
    def finished(self, prompts, rows):
      raise AssertionError('nothing ran')
    def stop(self):
      return False

  run = lambda got: eng.run(policy[1], [], G, np.zeros(0, np.int32), jax.random.key(0),
                            (np.float32(1), np.float32(1), np.int32(0)), greedy=False,
                            filtered=False, row_tokens=48, stream=Feed(got))
  with pytest.raises(ValueError, match='gave 1 prompts and 2 limits .expected 3 per prompt'):
    run(([np.arange(1, 5)], np.full(G - 1, 5)))
  with pytest.raises(ValueError, match='prompt of 41 tokens with rows of up to 9 new tokens '
                                       'does not fit row_tokens=48'):
    run(([np.arange(1, 42)], np.array([3, 9, 1])))   # 40 cached + 9 new > 48


def test_stream_errors(policy):
  eng = _paged(policy[0], slots=2)
  with pytest.raises(RuntimeError, match='no prompts while no row is live'):
    eng.stream(policy[1], 0, SP, G, _Feed(['wait']), max_prompt_len=32, rows=6)
  with pytest.raises(ValueError, match='prompt 1 has 31 tokens .expected 1 to max_prompt_len=30'):
    eng.stream(policy[1], 0, SP, G, _Feed([[0, 4]]), max_prompt_len=30, rows=6)
  bad = _Feed([[0]])
  bad.more = lambda: ([PROMPTS[0]], [5] * (G - 1))
  with pytest.raises(ValueError, match=r'row limits: expected 3 ints in \[1, max_new_tokens=40'):
    eng.stream(policy[1], 0, SP, G, bad, max_prompt_len=32, rows=6)
  with pytest.raises(ValueError, match="needs engine='paged'"):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS).stream(policy[1], 0, SP, G, _Feed([[0]]), 32, 6)
  assert eng.pages_in_use == 0


# ------------------------------------------------------------------ sessions (KV kept between calls)

_TURN_BUCKETS = dict(prompt_buckets=(16, 32, 64, 128), new_token_buckets=(16,))


def _turns(policy, samp, session, turns=4, keys=8, seed=0):
  """An agentic-like run: every key's prompt is its stream so far; after each call a stream
  gets its sampled tokens (some one short: a turn cut by a budget) and an observation, and
  some keys end. Returns each call's (keys, prompts, limits, SampleOutput)."""
  rs = np.random.RandomState(seed)
  sp = sampler.SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95)
  streams = {k: list(rs.randint(20, CFG.vocab_size, size=rs.randint(1, 20))) for k in range(keys)}
  live, calls = list(streams), []
  for turn in range(turns):
    if not live:
      break
    prompts = [streams[k] for k in live]
    limits = [int(x) for x in rs.randint(1, 13, size=len(live))]
    kw = dict(session=session, keys=[f'episode{k}' for k in live]) if session else {}
    out = samp.generate(policy[1], prompts, jax.random.fold_in(jax.random.key(seed), turn), sp,
                        row_limits=limits, **kw)
    calls.append((list(live), prompts, limits, out))
    for j, k in enumerate(live):
      n = int(out.lengths[j])
      n -= int(n > 1 and (k + turn) % 3 == 0)
      streams[k] = streams[k] + out.tokens[j, :n].tolist() + list(
          rs.randint(20, CFG.vocab_size, size=rs.randint(1, 24)))
    live = [k for k in live if len(streams[k]) < 100 and (k + turn) % 5 != 1]
  return calls


@pytest.mark.parametrize('pages', [
    200,                                            # every key's cache stays
    pytest.param(30, marks=pytest.mark.heavy),     # some kept caches are given up
    pytest.param('least', marks=pytest.mark.heavy)],  # one row's pages: rows preempted too
    ids=['roomy', 'tight', 'least'])
def test_a_session_keeps_pages_between_calls_and_samples_the_same(policy, pages):
  """Each call's rows equal the one-call sampler's; a roomy pool prefills only what each prompt
  adds after its key's kept cache; smaller pools give kept pages up (rows then prefill in full)
  or preempt rows, and nothing leaks."""
  one_call = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, **_TURN_BUCKETS)
  if pages == 'least':
    pages = -(-128 // 8) + 1
  samp = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                         slots=4, chunk_steps=5, prefill_prompts=3, pages=pages,
                         **_TURN_BUCKETS)
  session = samp.session(100 + 12)
  assert session.row_tokens == 128
  calls = _turns(policy, samp, session)
  want_prefill = 0
  for turn, (live, prompts, limits, out) in enumerate(calls):
    ref = one_call.generate(policy[1], prompts, jax.random.fold_in(jax.random.key(0), turn),
                            sampler.SamplingParams(max_new_tokens=12, temperature=0.9,
                                                   top_p=0.95), row_limits=limits)
    _assert_same_rows(out, ref)
    for j, k in enumerate(live):
      before = next((c for c in calls[:turn][::-1] if k in c[0]), None)
      if before is None:
        want_prefill += len(prompts[j]) - 1
      else:   # kept: the previous prompt and its sampled tokens but the last
        i = before[0].index(k)
        kept = before[1][i] + before[3].tokens[i, :before[3].lengths[i] - 1].tolist()
        common = next((x for x, (a, b) in enumerate(zip(kept, prompts[j][:-1])) if a != b),
                      min(len(kept), len(prompts[j]) - 1))
        want_prefill += len(prompts[j]) - 1 - common
  assert len(calls) == 4 and len(calls[-1][0]) < len(calls[0][0]), 'keys must end on the way'
  total = sum(len(q) - 1 for c in calls for q in c[1])
  assert session.prefilled_tokens + session.reused_tokens >= total
  [eng] = samp._rollout.engines.values()
  if pages == 200:
    assert (session.prefilled_tokens, session.reused_tokens) == (want_prefill,
                                                                 total - want_prefill)
    assert eng.preemptions == 0 and session.evicted == 0
  elif pages == 30:   # given-up caches are prefilled again
    assert session.evicted > 0 and session.prefilled_tokens > want_prefill
    assert session.reused_tokens > total // 3
  else:
    assert session.evicted > 0 and eng.preemptions > 0
  assert samp.pages_in_use == 0, 'pages leaked'
  # Only the last call's keys are kept, each holding the pages of its cache tokens.
  assert set(session.entries) <= {f'episode{k}' for k in calls[-1][0]}
  assert session.pages_held == sum(-(-e.tokens.size // 8) for e in session.entries.values())
  session.close()
  assert session.pages_held == 0 and session.pool is None


@pytest.mark.heavy
def test_session_compiles_are_bounded(policy):
  """A session's calls share one page table and pool: decode compiles per packed row count,
  the chunked prefills per (power-of-two new tokens, power-of-two context pages)."""
  samp = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                         slots=4, chunk_steps=5, prefill_prompts=3, pages=200, **_TURN_BUCKETS)
  assert len(_turns(policy, samp, samp.session(112), seed=1)) == 4
  first = samp.compile_count
  # decode: 1, 2, 4 rows; prefill: 16, 32 tokens or copies; extend: few (new, context) pairs.
  assert first <= 3 + 3 + 8
  _turns(policy, samp, samp.session(112), seed=1)
  assert samp.compile_count == first, 'the same run recompiled'


def test_session_errors(policy):
  samp = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                         slots=4, **_TURN_BUCKETS)
  session = samp.session(40)
  sp = sampler.SamplingParams(max_new_tokens=12)
  gen = lambda prompts, **kw: samp.generate(policy[1], prompts, 0, sp, **dict(
      dict(session=session, keys=list(range(len(prompts)))), **kw))
  with pytest.raises(ValueError, match="KV session needs engine='paged'"):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, **_TURN_BUCKETS).session(40)
  with pytest.raises(ValueError, match='one distinct key per prompt'):
    gen([[5, 6], [7]], keys=['a', 'a'])
  with pytest.raises(ValueError, match='one distinct key per prompt'):
    gen([[5, 6], [7]], keys=None)
  with pytest.raises(ValueError, match='one row per prompt'):
    gen([[5, 6]], num_samples=2)
  with pytest.raises(ValueError, match='session row tokens=200 exceeds'):
    samp.session(200)
  gen([[5, 6, 7], [8]])
  held = session.pages_held
  assert held > 0
  # The unrolled decode ('auto' on these CPUs) keeps the pools per layer between calls; an
  # engine that keeps them stacked refuses them, and the session keeps what it holds.
  assert all(isinstance(p, tuple) and len(p) == CFG.num_layers for p in session.pool)
  scanned = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                            slots=4, decode_layers='scan', **_TURN_BUCKETS)
  with pytest.raises(ValueError, match="session's pool is per layer, this engine keeps it "
                                       r"stacked \(decode_layers\)"):
    scanned.generate(policy[1], [[5, 6]], 0, sp, session=session, keys=[0])
  assert session.pages_held == held
  # A call refused before it starts keeps what the session holds.
  with pytest.raises(ValueError, match="does not fit the session's row_tokens=64"):
    gen([list(range(20, 80))])
  assert session.pages_held == held
  # A call that fails inside the engine closes the session: nothing half-written is kept.
  def broken(*a, **kw):
    raise RuntimeError('device lost')
  samp._rollout.engines[4]._decode = broken
  with pytest.raises(RuntimeError, match='device lost'):
    gen([[5, 6, 7, 9], [8]])
  assert session.pool is None and not session.entries


@pytest.mark.heavy
def test_sharded_session_equals_unsharded(make_policy, policy):
  """A session's pool split over the 4 batch shards: each key's kept pages stay on its shard
  and are reused there; rows equal the unsharded session's."""
  mesh = sharding.make_mesh((2, 2, 2))
  graphdef, params = make_policy(mesh)
  kw = dict(eos_ids=EOS, pad_id=0, engine='paged', page_size=8, slots=8, chunk_steps=5,
            prefill_prompts=4, pages=4 * 40, **_TURN_BUCKETS)
  flat = sampler.Sampler(policy[0], CFG, **kw)
  split = sampler.Sampler(graphdef, CFG, mesh=mesh, **kw)
  s_flat, s_split = flat.session(112), split.session(112)
  a = _turns(policy, flat, s_flat, seed=2)
  b = _turns((graphdef, params), split, s_split, seed=2)
  assert len(a) == len(b) == 4
  for (_, _, _, x), (_, _, _, y) in zip(a, b):
    _assert_same_rows(y, x)
  assert s_split.reused_tokens == s_flat.reused_tokens > 0
  assert s_split.prefilled_tokens == s_flat.prefilled_tokens
  assert split.pages_in_use == 0 and s_split.shards == 4
  per_shard = 40
  for e in s_split.entries.values():
    assert all(e.shard * per_shard <= p < (e.shard + 1) * per_shard for p in e.pages)


@pytest.mark.heavy      # four engine runs, each compiling its decode programs
@pytest.mark.parametrize('slots,pages', [(4, 14), (8, None)], ids=['preempting', 'roomy'])
def test_every_slot_decode_calls_sample_the_same_rows_with_one_decode_program(
    policy, reference, slots, pages):
  # decode_rows='all': every call carries every slot (free ones masked), so the decode
  # compiles once, where 'live' packs the live rows into 1, 2, 4... rows and compiles per size.
  # Rows are the one-call sampler's either way; every call pays for every slot.
  runs = {}
  for rows in ('live', 'all'):
    eng = _paged(policy[0], slots=slots, pages=pages, chunk_steps=5, prefill_prompts=3,
                 decode_rows=rows)
    out = eng.generate(policy[1], PROMPTS, jax.random.key(5), SP, num_samples=G,
                       row_limits=LIMITS)
    _assert_same_rows(out, reference[False])
    run = eng._rollout.engines[slots]
    decode = run._decode._cache_size()   # distinct decode programs compiled
    runs[rows] = (decode, eng.decode_slots)
  assert runs['all'][0] == 1, runs
  assert runs['live'][0] > 1, runs       # the workload's tail runs on fewer rows
  assert runs['all'][1] > runs['live'][1], runs


def test_decode_rows_errors(policy):
  with pytest.raises(ValueError, match=r"decode_rows='every'"):
    _paged(policy[0], slots=4, decode_rows='every')
