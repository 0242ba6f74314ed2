"""Sampler: on-policy log-probs, top-k/top-p/temperature, stop tokens, groups, buckets, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer
from rl import engine_options
from rl import sampler
from rl import sampling

CFG = config_lib.ModelConfig.tiny()          # GQA: 4 heads over 2 kv heads
PROMPTS = [[5, 6, 7, 8, 9], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
EOS = (3, 17)


@pytest.fixture(scope='module')
def samp(policy):
  return sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16, 32),
                         new_token_buckets=(16, 32), batch_buckets=(8, 16, 256))


def _forward_logprobs(graphdef, params, out):
  """Training-style pass over prompt ++ completion: float64 log-softmax of every completion step."""
  tokens = np.concatenate([out.prompt_tokens, out.tokens], 1)
  seg = np.concatenate([out.prompt_mask, out.mask], 1)
  pos = np.maximum(np.cumsum(seg, 1) - 1, 0)
  logits = nnx.merge(graphdef, params)(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  p = out.prompt_tokens.shape[1]
  x = np.asarray(logits, np.float64)[:, p - 1:-1]                          # [B, N, V]
  return x, _log_softmax(x)


def _reference_filter(x, temperature, top_p, top_k):
  """float64 numpy, by sorting: temperature, then top-k, then top-p; -inf outside."""
  x = x / temperature
  if top_k:
    kth = np.sort(x, -1)[..., ::-1][..., top_k - 1:top_k]
    x = np.where(x >= kth, x, -np.inf)
  desc = np.sort(x, -1)[..., ::-1]
  probs = np.exp(desc - desc[..., :1])
  probs /= probs.sum(-1, keepdims=True)
  before = np.cumsum(probs, -1) - probs
  count = np.sum(before < top_p, -1, keepdims=True)
  threshold = np.take_along_axis(desc, count - 1, -1)
  return np.where(x >= threshold, x, -np.inf)


def _log_softmax(x):
  m = np.max(x, -1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


_FILTER = jax.jit(sampling.filter_logits)    # top_p / top_k traced: one compile


@pytest.mark.parametrize('top_p,top_k', [(1.0, 5), (0.7, 0), (0.9, 40), (1e-6, 0), (1.0, 1),
                                         (0.999, 0)])
def test_filter_matches_sorted_reference(top_p, top_k):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 256)).astype(np.float32) * 3
  x[0, :10] = x[0, 10]                    # ties straddling the cut
  x[1, 7] = -np.inf                       # an already-excluded token
  # Flat rows of negative logits: a top_p near 1 keeps every token, the lowest included.
  x[2] = -1.5
  x[3] = -2.0 - rng.uniform(0, 0.01, 256).astype(np.float32)
  # The top two one float step apart: top_k=1 keeps the first alone.
  x[4, 0] = 20.0
  x[4, 1] = np.nextafter(np.float32(20.0), np.float32(0))
  got = _FILTER(jnp.asarray(x), jnp.float32(top_p), jnp.int32(top_k))
  ref = _reference_filter(x.astype(np.float64), 1.0, top_p, top_k)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
  np.testing.assert_array_equal(np.asarray(got)[np.isfinite(ref)], x[np.isfinite(ref)])


@pytest.mark.parametrize('sp', [
    sampler.SamplingParams(max_new_tokens=12, greedy=True),
    sampler.SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=30)],
    ids=['greedy', 'temp_top_p_top_k'])
def test_logprobs_equal_training_forward(policy, samp, sp):
  out = samp.generate(policy[1], PROMPTS, jax.random.key(1), sp, num_samples=2)
  assert out.prompt_tokens.shape == (8, 11) and out.tokens.shape == (8, 12)
  np.testing.assert_array_equal(out.prompt_mask.sum(1), np.repeat([len(q) for q in PROMPTS], 2))
  for i, q in enumerate(PROMPTS):                      # left-padded, prompt-major
    np.testing.assert_array_equal(out.prompt_tokens[2 * i, 11 - len(q):], q)
  logits, logp = _forward_logprobs(*policy, out)
  ref = np.take_along_axis(logp, out.tokens[..., None], -1)[..., 0] * out.mask
  np.testing.assert_allclose(out.logprobs, ref, atol=1e-4, rtol=0)
  if sp.greedy:
    np.testing.assert_array_equal(out.sampling_logprobs, 0)
    np.testing.assert_array_equal(np.where(out.mask > 0, out.tokens, 0),
                                  np.where(out.mask > 0, logits.argmax(-1), 0))
  else:
    sampled = _log_softmax(_reference_filter(logits, sp.temperature, sp.top_p, sp.top_k))
    ref = np.take_along_axis(sampled, out.tokens[..., None], -1)[..., 0]
    ref = np.where(out.mask > 0, ref, 0)
    assert np.all(np.isfinite(ref)), 'a sampled token lies outside the top-k/top-p support'
    np.testing.assert_allclose(out.sampling_logprobs, ref, atol=1e-4, rtol=0)
  assert np.all(out.logprobs <= 0) and out.mask.sum() > 0


def test_stop_on_any_eos_masks_lengths_truncated(policy):
  free = sampler.Sampler(policy[0], CFG, eos_ids=(), prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,))
  sp = sampler.SamplingParams(max_new_tokens=10, greedy=True)
  ref = free.generate(policy[1], PROMPTS, jax.random.key(0), sp)
  assert ref.mask.all() and ref.truncated.all() and (ref.lengths == 10).all()
  # Two stop ids that row 0 and row 1 emit at different steps; rows that emit neither run out.
  eos = (int(ref.tokens[0, 3]), int(ref.tokens[1, 5]))
  stop = sampler.Sampler(policy[0], CFG, eos_ids=eos, pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,))
  out = stop.generate(policy[1], PROMPTS, jax.random.key(0), sp)
  for r in range(len(PROMPTS)):
    hits = np.flatnonzero(np.isin(ref.tokens[r], eos))
    n = hits[0] + 1 if hits.size else 10
    assert out.lengths[r] == n and out.truncated[r] == (hits.size == 0)
    np.testing.assert_array_equal(out.tokens[r, :n], ref.tokens[r, :n])
    np.testing.assert_array_equal(out.tokens[r, n:], 0)
    np.testing.assert_array_equal(out.mask[r], np.arange(10) < n)
    np.testing.assert_allclose(out.logprobs[r, :n], ref.logprobs[r, :n], atol=1e-6)
    np.testing.assert_array_equal(out.logprobs[r, n:], 0)
  assert out.lengths[0] <= 4 and out.lengths[1] <= 6 and not out.truncated[:2].any()


def test_long_generation_across_decode_phases(policy):
  # A 256-token bucket decodes in two phases (cache extents 128 and 256 new tokens).
  assert sampler._phase_ends(256) == (128, 256)
  assert sampler._phase_ends(1024) == (128, 256, 512, 1024) and sampler._phase_ends(64) == (64,)
  assert sampler._phase_ends(1024, 1) == (1024,)
  s = sampler.Sampler(policy[0], CFG, eos_ids=(), prompt_buckets=(16,),
                      new_token_buckets=(256,), batch_buckets=(4,), decode_phases=2)
  out = s.generate(policy[1], PROMPTS[:2], jax.random.key(4),
                   sampler.SamplingParams(max_new_tokens=140), num_samples=2)
  assert out.mask.all() and out.truncated.all() and out.tokens.shape == (4, 140)
  _, logp = _forward_logprobs(*policy, out)
  ref = np.take_along_axis(logp, out.tokens[..., None], -1)[..., 0]
  # 1.01e-4 at worst here, as against the jitted unrolled forward before the blocks were
  # scanned (the sampler's own numbers did not change; the eager op-by-op forward was 8.5e-5).
  np.testing.assert_allclose(out.logprobs, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize('greedy', [True, False], ids=['greedy', 'sample'])
def test_unrolled_decode_equals_scanned(policy, greedy):
  # decode_layers='unrolled' (per-layer weights and caches made before the loop) samples
  # the tokens the scanned stack does, across a phase switch (which grows the per-layer
  # caches) and with a shared prefill (group 2); 'auto' is 'unrolled' on these CPUs. The
  # scanned side's model scans its layers (scan_layers='auto' loops them on these CPUs).
  scanned = nnx.graphdef(transformer.create(CFG.replace(scan_layers=True), seed=0))
  make = lambda layers: sampler.Sampler(
      scanned if layers == 'scan' else policy[0], CFG, eos_ids=EOS, prompt_buckets=(16,),
      new_token_buckets=(256,), batch_buckets=(8,), decode_phases=2, decode_layers=layers)
  assert make('auto').decode_layers == 'unrolled' and make('scan').decode_layers == 'scan'
  sp = sampler.SamplingParams(max_new_tokens=150, greedy=greedy, temperature=0.8, top_k=20)
  outs = [make(layers).generate(policy[1], PROMPTS, jax.random.key(7), sp, num_samples=2)
          for layers in ('scan', 'unrolled')]
  assert outs[0].lengths.max() > 128                   # the second phase ran
  np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
  np.testing.assert_array_equal(outs[1].mask, outs[0].mask)
  np.testing.assert_allclose(outs[1].logprobs, outs[0].logprobs, atol=2e-5, rtol=0)
  np.testing.assert_allclose(outs[1].sampling_logprobs, outs[0].sampling_logprobs, atol=2e-5,
                             rtol=0)


def test_top_k_1_tiny_top_p_tiny_temperature_equal_greedy(policy, samp):
  greedy = samp.generate(policy[1], PROMPTS, jax.random.key(0),
                         sampler.SamplingParams(max_new_tokens=12, greedy=True), num_samples=2)
  n = samp.compile_count
  for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_p=1e-6, top_k=3), dict(temperature=1e-4),
             dict(temperature=1e-4, top_p=0.8)):
    out = samp.generate(policy[1], PROMPTS, jax.random.key(7),
                        sampler.SamplingParams(max_new_tokens=12, **kw), num_samples=2)
    np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=str(kw))
    np.testing.assert_allclose(out.logprobs, greedy.logprobs, atol=1e-6)
    if 'temperature' not in kw:       # a one-token support: the sampling log-prob is log 1
      np.testing.assert_allclose(out.sampling_logprobs, 0, atol=1e-6)
  # Temperature, top-p and top-k are traced: only the filtered/unfiltered switch compiles.
  assert samp.compile_count <= n + 2


@pytest.mark.heavy
def test_sampling_distribution_and_support(policy, samp):
  g = 256
  prompt = [[12, 13, 14]]
  full = samp.generate(policy[1], prompt, jax.random.key(3),
                       sampler.SamplingParams(max_new_tokens=1, temperature=1.5), num_samples=g)
  first = full.tokens[:, 0]
  # Every row saw the same first-step distribution; its frequencies match it.
  _, logp = _forward_logprobs(*policy, full)
  p = np.exp(_log_softmax(logp[0, 0] / 1.5))
  np.testing.assert_allclose(np.exp(full.sampling_logprobs[:, 0]), p[first], atol=1e-5)
  freq = np.bincount(first, minlength=CFG.vocab_size) / g
  big = p > 0.03
  assert big.sum() >= 3
  np.testing.assert_array_less(np.abs(freq - p)[big], 4.5 * np.sqrt(p * (1 - p) / g)[big])
  assert len(set(first.tolist())) > 5               # G samples of one prompt really differ
  order = np.argsort(-logp[0, 0])
  top3 = samp.generate(policy[1], prompt, jax.random.key(3),
                       sampler.SamplingParams(max_new_tokens=1, temperature=1.5, top_k=3),
                       num_samples=g)
  assert set(top3.tokens[:, 0].tolist()) == set(order[:3].tolist())
  nucleus = samp.generate(policy[1], prompt, jax.random.key(3),
                          sampler.SamplingParams(max_new_tokens=1, top_p=0.5), num_samples=g)
  mass_before = np.cumsum(np.exp(logp[0, 0][order])) - np.exp(logp[0, 0][order])
  allowed = set(order[mass_before < 0.5].tolist())
  assert set(nucleus.tokens[:, 0].tolist()) <= allowed and len(allowed) >= 2


def test_seeds_groups_and_padding_independence(policy, samp):
  sp = sampler.SamplingParams(max_new_tokens=12, temperature=1.0)
  a = samp.generate(policy[1], PROMPTS, jax.random.key(5), sp, num_samples=2)
  b = samp.generate(policy[1], PROMPTS, jax.random.key(5), sp, num_samples=2)
  c = samp.generate(policy[1], PROMPTS, jax.random.key(6), sp, num_samples=2)
  d = samp.generate(policy[1], PROMPTS, 5, sp, num_samples=2)          # an int seed
  for x, y, z in zip(a, b, d):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)
  assert not np.array_equal(a.tokens, c.tokens)
  assert not np.array_equal(a.tokens[0::2], a.tokens[1::2])     # G samples are independent
  # More prompts -> a larger batch bucket (8 -> 16 rows); the first rows are unchanged.
  more = samp.generate(policy[1], PROMPTS + [[50, 51], [60]], jax.random.key(5), sp, num_samples=2)
  np.testing.assert_array_equal(more.tokens[:8], a.tokens)
  # (Prefill batches of 4 and 6 distinct prompts round differently in the last bits.)
  np.testing.assert_allclose(more.logprobs[:8], a.logprobs, atol=1e-5, rtol=1e-5)


def test_a_prompts_samples_share_one_prefill(policy, samp, monkeypatch):
  sp = sampler.SamplingParams(max_new_tokens=12, temperature=1.0)
  assert samp.prefill_group(8, 2) == 2 and samp.prefill_group(8, 3) == 1
  assert samp.prefill_group(8, 1) == 1
  _, kw, what = samp.abstract_args(policy[1], 8, 11, sp, num_samples=2)
  assert kw['group'] == 2 and '4 prompts prefilled once each' in what
  shared = samp.generate(policy[1], PROMPTS, jax.random.key(5), sp, num_samples=2)
  monkeypatch.setattr(samp, 'prefill_group', lambda chunk, n: 1)
  alone = samp.generate(policy[1], PROMPTS, jax.random.key(5), sp, num_samples=2)
  for name in ('prompt_tokens', 'prompt_mask', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(shared, name), getattr(alone, name), err_msg=name)
  np.testing.assert_allclose(shared.logprobs, alone.logprobs, atol=1e-4, rtol=0)


@pytest.mark.heavy
def test_compile_count_bounded_by_buckets(policy):
  s = sampler.Sampler(policy[0], CFG, eos_ids=EOS, prompt_buckets=(8, 16),
                      new_token_buckets=(8, 16), batch_buckets=(4,))
  rng = np.random.default_rng(0)
  sp = lambda n, t: sampler.SamplingParams(max_new_tokens=n, temperature=t)
  for length in range(1, 9):              # varied prompt lengths, one bucket
    prompts = [list(rng.integers(4, 200, length)) for _ in range(2)]
    out = s.generate(policy[1], prompts, jax.random.key(length),
                     sp(3 + length % 5, 0.5 + length / 8))
    assert out.tokens.shape == (2, 3 + length % 5) and out.prompt_tokens.shape == (2, length)
  assert s.compile_count == 1
  s.generate(policy[1], [[5] * 12], jax.random.key(0), sp(8, 1.0))      # prompt bucket 16
  s.generate(policy[1], [[5] * 12], jax.random.key(0), sp(12, 1.0))     # new-token bucket 16
  s.generate(policy[1], [[5] * 10], jax.random.key(0), sp(9, 0.3))      # seen already
  assert s.compile_count == 3
  with pytest.raises(ValueError, match='prompt length=17 exceeds the largest bucket 16'):
    s.generate(policy[1], [[5] * 17], jax.random.key(0), sp(4, 1.0))
  with pytest.raises(ValueError, match='batch'):
    s.generate(policy[1], [[5]] * 5, jax.random.key(0), sp(4, 1.0))


def test_bad_input_errors(policy, samp):
  with pytest.raises(ValueError, match='temperature'):
    sampler.SamplingParams(max_new_tokens=4, temperature=0.0)
  with pytest.raises(ValueError, match='top_p'):
    sampler.SamplingParams(max_new_tokens=4, top_p=0.0)
  with pytest.raises(ValueError, match='top_k'):
    sampler.SamplingParams(max_new_tokens=4, top_k=-1)
  with pytest.raises(ValueError, match='max_new_tokens'):
    sampler.SamplingParams(max_new_tokens=0)
  sp = sampler.SamplingParams(max_new_tokens=4)
  with pytest.raises(ValueError, match=r'prompts\[1\] is empty'):
    samp.generate(policy[1], [[1], []], jax.random.key(0), sp)
  with pytest.raises(ValueError, match=r'prompts\[0\] has token ids outside'):
    samp.generate(policy[1], [[CFG.vocab_size]], jax.random.key(0), sp)
  with pytest.raises(ValueError, match='eos_ids'):
    sampler.Sampler(policy[0], CFG, eos_ids=(CFG.vocab_size,))
  with pytest.raises(ValueError, match='decode_phases'):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, decode_phases=0)
  with pytest.raises(ValueError, match="decode_layers='unroll'"):
    sampler.Sampler(policy[0], CFG, eos_ids=EOS, decode_layers='unroll')


@pytest.mark.heavy
@pytest.mark.parametrize('greedy', [True, False], ids=['greedy', 'sampled'])
def test_sharded_equals_unsharded(policy, make_policy, samp, greedy):
  assert jax.device_count() >= 8
  mesh = sharding.make_mesh((2, 2, 2))
  graphdef, params = make_policy(mesh)
  assert params['layers']['attn']['q_proj'].value.sharding.spec == \
      jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None)    # [L, D, N, H]
  sharded = sampler.Sampler(graphdef, CFG, eos_ids=EOS, pad_id=0, mesh=mesh,
                            prompt_buckets=(16, 32), new_token_buckets=(16, 32),
                            batch_buckets=(8, 16, 256))
  sp = sampler.SamplingParams(max_new_tokens=12, greedy=greedy, temperature=0.9)
  out = sharded.generate(params, PROMPTS, jax.random.key(2), sp, num_samples=2)
  ref = samp.generate(policy[1], PROMPTS, jax.random.key(2), sp, num_samples=2)
  for name in ('prompt_tokens', 'prompt_mask', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  # Sharded reductions add in another order: equal up to float32 rounding.
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
  np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=1e-4)


@pytest.mark.parametrize('greedy', [pytest.param(True, marks=pytest.mark.heavy), False],
                         ids=['greedy', 'sampled'])
def test_chunked_rows_equal_one_call(policy, samp, greedy):
  sp = sampler.SamplingParams(max_new_tokens=12, greedy=greedy, temperature=0.9)
  whole = samp.generate(policy[1], PROMPTS, jax.random.key(7), sp, num_samples=3)   # 12 rows
  # 16 prompt + 16 new-token slots per row: a budget of 100 slots holds 3 rows,
  # and the largest batch bucket of <= 3 rows is 2: six chunks of 2 rows.
  chunked = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16, 32),
                            new_token_buckets=(16, 32), batch_buckets=(2, 4, 16),
                            cache_tokens_per_device=100)
  assert chunked.chunk_rows(12, 32) == 2 and samp.chunk_rows(12, 32) == 16
  out = chunked.generate(policy[1], PROMPTS, jax.random.key(7), sp, num_samples=3)
  assert chunked.compile_count == 1          # six chunks, one program
  for name in ('prompt_tokens', 'prompt_mask', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(out, name), getattr(whole, name), err_msg=name)
  # Tokens are identical; log-probs to float32 rounding (a 2-row and a 16-row
  # matmul add in another order on XLA:CPU: 3.6e-6 relative at worst here).
  np.testing.assert_allclose(out.logprobs, whole.logprobs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.sampling_logprobs, whole.sampling_logprobs, rtol=1e-5,
                             atol=1e-6)
  # Rows keep their own noise: the same rows in another chunking, the same samples.
  other = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16, 32),
                          new_token_buckets=(16, 32), batch_buckets=(2, 4, 16),
                          cache_tokens_per_device=4 * 32)
  assert other.chunk_rows(12, 32) == 4
  np.testing.assert_array_equal(
      other.generate(policy[1], PROMPTS, jax.random.key(7), sp, num_samples=3).tokens,
      out.tokens)


def test_chunk_rows_from_the_cache_budget(policy):
  mk = lambda budget, bb=None, mesh=None: sampler.Sampler(
      policy[0], CFG, eos_ids=EOS, batch_buckets=bb, mesh=mesh,
      cache_tokens_per_device=budget)
  assert mk(None).chunk_rows(100, 64) == 128                     # one call: the whole bucket
  assert mk(64 * 5).chunk_rows(100, 64) == 4                      # 5 rows fit: a power of two
  assert mk(64 * 5).chunk_rows(3, 64) == 4                        # never more than the call
  assert mk(10).chunk_rows(100, 64) == 1                          # at least one row
  assert mk(64 * 5, bb=(3, 6, 12)).chunk_rows(10, 64) == 3
  assert mk(64, bb=(3, 6, 12)).chunk_rows(10, 64) == 3            # none fits: the smallest
  mesh = sharding.make_mesh((2, 2, 2))
  shards = sharding.batch_shards(mesh, sharding.DEFAULT_RULES)
  assert shards == 4 and mk(64 * 3, mesh=mesh).chunk_rows(100, 64) == 2 * shards
  with pytest.raises(ValueError, match='cache_tokens_per_device'):
    mk(0)
  # Default prompt buckets: the powers of two from 32 to 262,144 (past 128K positions).
  default = sampler.Sampler(policy[0], CFG, eos_ids=EOS, new_token_buckets=(16,))
  assert [default.call_shape(1, n, 16)[0] for n in (1, 32, 33, 40_000, 65_537, 131_072)] == [
      32, 32, 64, 65_536, 131_072, 131_072]
  with pytest.raises(ValueError, match='prompt length=262145 exceeds the largest bucket 262144'):
    default.call_shape(1, 262_145, 16)
  assert max(engine_options.DEFAULT_NEW_TOKEN_BUCKETS) == 262_144
  # launch.plan's words for a chunked call: rows per chunk and how many chunks.
  sp = sampler.SamplingParams(max_new_tokens=16)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy[1])
  samp = sampler.Sampler(policy[0], CFG, eos_ids=EOS, prompt_buckets=(16,),
                         new_token_buckets=(16,), cache_tokens_per_device=32 * 4)
  assert '4 rows per chunk, 3 chunks, prompt bucket 16' in samp.abstract_args(
      abstract, 10, 12, sp)[2]
  assert samp.abstract_args(abstract, 4, 12, sp)[2].startswith('4 rows, prompt bucket 16')
  # A call's rows: its batch bucket, rounded up to split over the batch shards.
  assert [mk(None, bb=(3, 6, 12), mesh=mesh)._batch_bucket(n) for n in (1, 3, 5, 7)] == [
      4, 4, 8, 12]
  assert [mk(None, mesh=mesh)._batch_bucket(n) for n in (1, 5, 9)] == [4, 8, 16]


def test_decode_step_writes_the_cache_in_place():
  # A decode step writes its slot into the stacked [L, B, K, S, H] cache in place
  # and reads one layer: its temporaries stay below 1.2 layers of cache (a
  # per-layer copy written and then put back into the stack measured 1.5).
  cfg = config_lib.ModelConfig.tiny(max_seq_len=4096, num_layers=8)
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  cache = transformer.init_cache(cfg, 16, 2048)

  def step(params, cache, tok):
    model = nnx.merge(graphdef, params)
    return model(tok, jnp.full((16, 1), 5, jnp.int32), jnp.ones((16, 1), jnp.int32),
                 cache=cache)

  compiled = jax.jit(step, donate_argnums=1).lower(
      params, cache, jnp.zeros((16, 1), jnp.int32)).compile()
  layer_bytes = (cache.k.nbytes + cache.v.nbytes) // cfg.num_layers
  assert compiled.memory_analysis().temp_size_in_bytes < 1.2 * layer_bytes


@pytest.mark.heavy
def test_sharded_chunked_rollout_layout_equals_unsharded(policy, make_policy, samp):
  # Chunks of 4 rows (one per batch shard) in the rollout layout (weights
  # replicated over fsdp, split over tensor) sample what one unsharded call does.
  mesh = sharding.make_mesh((2, 2, 2))
  graphdef, params = make_policy(mesh)
  s = sampler.Sampler(graphdef, CFG, eos_ids=EOS, pad_id=0, mesh=mesh,
                      prompt_buckets=(16, 32), new_token_buckets=(16, 32),
                      batch_buckets=(4, 8, 16), cache_tokens_per_device=32,
                      rollout_rules=(('embed', None),))
  assert s.chunk_rows(8, 32) == 4
  moved = s.rollout_params(params)
  q = moved['layers']['attn']['q_proj'].value
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, 'tensor', None)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(params['layers']['attn']['q_proj'].value))
  # The training layout is untouched (generate works on a copy).
  assert params['layers']['attn']['q_proj'].value.sharding.spec == \
      jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None)
  sp = sampler.SamplingParams(max_new_tokens=12, temperature=0.9)
  out = s.generate(params, PROMPTS, jax.random.key(8), sp, num_samples=2)
  ref = samp.generate(policy[1], PROMPTS, jax.random.key(8), sp, num_samples=2)
  for name in ('tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
  # Abstract params (launch.plan) get the same layout.
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          params)
  assert s.rollout_params(abstract)['layers']['attn']['q_proj'].value.sharding.spec == q.sharding.spec
  with pytest.raises(ValueError, match="unknown logical axes \\['embedding'\\]"):
    sampler.Sampler(graphdef, CFG, eos_ids=EOS, mesh=mesh, rollout_rules=(('embedding', None),))


def test_accounting_counts_paid_decode_slots_and_generated_tokens(policy):
  s = sampler.Sampler(policy[0], CFG, eos_ids=EOS, pad_id=0, prompt_buckets=(16,),
                      new_token_buckets=(16,), batch_buckets=(4, 16),
                      cache_tokens_per_device=4 * 32)
  sp = sampler.SamplingParams(max_new_tokens=12, temperature=1.0)
  prompts = PROMPTS + [[1, 2, 3]]                  # 5 prompts x 2 = 10 rows in chunks of 4
  out = s.generate(policy[1], prompts, jax.random.key(4), sp, num_samples=2)
  assert s.generated_tokens == int(out.lengths.sum())
  # Each chunk of 4 rows pays for its longest row; the last one holds 2 real + 2 padding rows.
  lens = out.lengths
  full = 4 * int(lens[0:4].max()) + 4 * int(lens[4:8].max())
  assert full + 4 * int(lens[8:10].max()) <= s.decode_slots <= full + 4 * 12
  assert s.decode_slots > s.generated_tokens
  before = (s.decode_slots, s.generated_tokens)
  s.generate(policy[1], PROMPTS[:2], jax.random.key(4), sp, num_samples=2)
  assert s.decode_slots > before[0] and s.generated_tokens > before[1]   # cumulative
