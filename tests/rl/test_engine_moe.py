"""The paged engine on the mixture-of-experts families against the one-call sampler: Qwen3-MoE
(per-attention-sublayer page pools) and the Nemotron-H hybrid, whose Mamba-2 layers carry each
row's recurrent state in a per-slot state pool beside the pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import page_pool
from rl import sampler
from rl import scheduler

CONFIGS = {'hybrid': config_lib.ModelConfig.tiny_hybrid(),
           'moe': config_lib.ModelConfig.tiny_moe()}
EOS = (46, 168, 192)     # tokens these policies sample often: rows stop and run to limits
_RS = np.random.RandomState(0)
# One token (nothing to prefill), a whole page plus one (no partial page), ragged ones.
PROMPTS = [[9], list(range(20, 29)), *[list(_RS.randint(1, 256, size=n)) for n in (5, 13, 2)]]
G = 3
LIMITS = _RS.randint(1, 31, size=len(PROMPTS) * G)
SP = sampler.SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.95)
GREEDY = sampler.SamplingParams(max_new_tokens=30, greedy=True)
BUCKETS = dict(prompt_buckets=(16,), new_token_buckets=(32,))


@pytest.fixture(scope='module', params=sorted(CONFIGS))
def family(request):
  """(config, graphdef, params): matrices scaled up, so distributions are peaked (stop tokens,
  few near-ties, distinct experts)."""
  cfg = CONFIGS[request.param]
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  return cfg, graphdef, jax.tree.map(lambda x: x * 3 if x.ndim >= 2 else x, params)


@pytest.fixture(scope='module')
def reference(family):
  """The one-call sampler's rows for the module's workload, by SamplingParams (made once)."""
  cfg, graphdef, params = family
  one_call = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, **BUCKETS)
  made = {}

  def get(sp):
    if sp not in made:
      made[sp] = one_call.generate(params, PROMPTS, jax.random.key(5), sp, num_samples=G,
                                   row_limits=LIMITS)
    return made[sp]
  return get


def _paged(cfg, graphdef, **kw):
  return sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                         **BUCKETS, **kw)


def _assert_same_rows(out, ref, atol=1e-4):
  for name in ('prompt_tokens', 'prompt_mask', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  # Another layout adds in another order (and a Mamba prefill scans in chunks where the decode
  # steps one token): equal up to float32 rounding.
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=atol, rtol=0)
  np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=atol, rtol=0)


def _spy(eng, name, seen):
  """Records the argument shapes of each call of the engine's jitted `name`."""
  real = getattr(eng, name)

  def spy(*args, **kw):
    sig = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), args[1:])
    if sig not in seen.setdefault(name, []):
      seen[name].append(sig)
    return real(*args, **kw)
  setattr(eng, name, spy)


@pytest.mark.parametrize('sp', [SP, pytest.param(GREEDY, marks=pytest.mark.heavy)],
                         ids=['sampled', 'greedy'])
def test_engine_rows_equal_the_one_call_sampler(family, reference, sp):
  """Prompts' samples share prefilled pages; a pool of barely one longest row preempts rows
  (recomputed from their prompt: pages and, for Mamba layers, the state); decode calls pack
  their live rows (padding rows repeat a live row's slot and must not write its state); and
  launch.plan's abstract calls have the shapes the run passes, and lower."""
  cfg, graphdef, params = family
  pages = 48 // 8 + 1      # one row of the bucket (16 + 32 tokens) and a partial copy
  samp = _paged(cfg, graphdef, slots=4, pages=pages, chunk_steps=4, prefill_prompts=2)
  eng = samp._rollout.engine(4)
  assert eng.unroll and eng.row_states == (cfg.mamba_layers > 0)
  seen, jitted = {}, (eng._prefill, eng._decode)
  _spy(eng, '_prefill', seen)
  _spy(eng, '_decode', seen)
  calls = []
  decode = eng._decode

  def record(graphdef, params, state, *args, **kw):
    calls.append((state.live.shape[0], int(np.sum(state.live))))
    return decode(graphdef, params, state, *args, **kw)
  eng._decode = record
  out = samp.generate(params, PROMPTS, jax.random.key(5), sp, num_samples=G, row_limits=LIMITS)
  eng._prefill, eng._decode = jitted
  ref = reference(sp)
  assert ref.truncated.any() and (~ref.truncated).any(), 'the workload needs both endings'
  _assert_same_rows(out, ref)
  assert eng.preemptions > 0 and samp.pages_in_use == 0
  assert any(live < rows for rows, live in calls), 'no call had padding rows'
  assert any(rows < 4 for rows, _ in calls), 'no call was packed'
  if sp.greedy:
    np.testing.assert_array_equal(out.sampling_logprobs, 0)
  for program, name in (('prefill', '_prefill'), ('decode', '_decode')):
    args, _, _ = samp.abstract_args(params, len(PROMPTS) * G, max(map(len, PROMPTS)), sp, G,
                                    program)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), args[1:]) in seen[name], program
    samp.lower(params, len(PROMPTS) * G, max(map(len, PROMPTS)), sp, G, program)


@pytest.mark.parametrize('row_states', [False, True], ids=['dense', 'row_states'])
def test_scheduler_pairs_each_admitted_row_with_its_prompt_state(row_states):
  """Host only: with row states every admitted row is paired with one prefill entry of its
  prompt[:-1]: the prompt's prefill in that round (pages written once), or an entry without
  pages (a one-token prompt, or one whose pages an earlier round wrote: fewer slots than its
  samples). Without, prompts are prefilled once and no row is paired."""
  prompts = [np.arange(1, 12), np.array([7]), np.arange(30, 36)]
  g, chunk = 3, 3
  limits = np.array([6, 2, 5, 4, 4, 4, 1, 6, 3])
  sched = scheduler.Scheduler(prompts, g, limits, slots=2, page_size=4, chunk_steps=chunk,
                              pages=page_pool.PagePool(40, 1), table_pages=8, max_tokens=20,
                              eos_ids=(), row_states=row_states)
  prefilled, pageless = [], 0
  while sched.busy:
    adm = sched.admit()
    prefilled += [tuple(q) for q, pages in adm.prefill if pages]
    pageless += sum(not pages for _, pages in adm.prefill)
    if row_states:
      assert sorted(slot for _, slot in adm.row_states) == sorted(adm.slots)
      for e, slot in adm.row_states:
        np.testing.assert_array_equal(adm.prefill[e][0], prompts[sched.slot_row[slot] // g][:-1])
    else:
      assert adm.row_states == () and all(pages for _, pages in adm.prefill)
    sched.allocate()
    batch = sched.batch()
    made = np.where(batch.live, np.minimum(chunk, batch.limits - batch.n), 0)
    tokens = np.full((batch.live.size, chunk), 9, np.int32)
    zeros = np.zeros(tokens.shape, np.float32)
    sched.advance(batch, tokens, zeros, zeros, batch.n + made, batch.live & (batch.n + made
                                                                              < batch.limits))
  assert sorted(prefilled) == sorted(tuple(q[:-1]) for q in prompts if q.size > 1)
  assert [len(t) for t in sched.rows().tokens] == limits.tolist()
  # The one-token prompt's rows (one round each here), and one per later round of the others'
  # rows (two slots for three samples).
  assert pageless == (3 + 2 if row_states else 0)


# ------------------------------------------------------------------ sessions (kept between calls)

_TURN_BUCKETS = dict(prompt_buckets=(48,), new_token_buckets=(8,), batch_buckets=(4,))
_TURN_SP = sampler.SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95)


def _turns(params, samp, session, turns=2, keys=4, seed=0):
  """An agentic-like run: every key's prompt is its stream so far; after each call a stream
  gets its sampled tokens (some two short, so the next prompt diverges inside the kept
  tokens) and an observation, and some keys end. Returns each call's (keys, prompts, limits,
  SampleOutput)."""
  rs = np.random.RandomState(seed)
  streams = {k: list(rs.randint(20, 256, size=rs.randint(1, 12))) for k in range(keys)}
  live, calls = list(streams), []
  for turn in range(turns):
    prompts = [streams[k] for k in live]
    limits = [int(x) for x in rs.randint(1, 9, size=len(live))]
    out = samp.generate(params, prompts, jax.random.fold_in(jax.random.key(seed), turn),
                        _TURN_SP, row_limits=limits, session=session,
                        keys=[f'episode{k}' for k in live])
    calls.append((list(live), prompts, limits, out))
    for j, k in enumerate(live):
      n = int(out.lengths[j])
      n -= 2 * int(n > 2 and (k + turn) % 3 == 0)
      streams[k] = streams[k] + out.tokens[j, :n].tolist() + list(
          rs.randint(20, 256, size=rs.randint(5, 9)))
    live = [k for k in live if (k + turn) % 5 != 1]
  return calls


@pytest.mark.parametrize('name', ['hybrid', pytest.param('moe', marks=pytest.mark.heavy)])
def test_a_session_continues_kept_pages_and_states(name):
  """Each call's rows equal the one-call sampler's over the whole history. A prompt that
  continues every token its key kept prefills only what it adds (its Mamba layers continue
  the kept state); one that diverges inside them reuses the common prefix's pages, or, with
  Mamba layers (a state cannot be rewound), is prefilled in full."""
  cfg = CONFIGS[name]
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  params = jax.tree.map(lambda x: x * 3 if x.ndim >= 2 else x, params)
  one_call = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, **_TURN_BUCKETS)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, engine='paged', page_size=32,
                         slots=2, chunk_steps=4, prefill_prompts=4, pages=16, **_TURN_BUCKETS)
  session = samp.session(48)
  calls = _turns(params, samp, session)
  want_prefill = full = diverged = 0
  for turn, (live, prompts, limits, out) in enumerate(calls):
    ref = one_call.generate(params, prompts, jax.random.fold_in(jax.random.key(0), turn),
                            _TURN_SP, row_limits=limits)
    _assert_same_rows(out, ref)
    for j, k in enumerate(live):
      before = next((c for c in calls[:turn][::-1] if k in c[0]), None)
      q = prompts[j][:-1]
      if before is None:
        want_prefill += len(q)
        continue
      i = before[0].index(k)   # kept: the previous prompt and its sampled tokens but the last
      kept = before[1][i] + before[3].tokens[i, :before[3].lengths[i] - 1].tolist()
      common = next((x for x, (a, b) in enumerate(zip(kept, q)) if a != b),
                    min(len(kept), len(q)))
      full += common == len(kept)
      diverged += common < len(kept)
      if cfg.mamba_layers and common < len(kept):
        common = 0
      want_prefill += len(q) - common
  assert full and diverged, 'the run needs both continuations'
  total = sum(len(q) - 1 for c in calls for q in c[1])
  [eng] = samp._rollout.engines.values()
  assert eng.preemptions == 0 and session.evicted == 0
  assert (session.prefilled_tokens, session.reused_tokens) == (want_prefill,
                                                               total - want_prefill)
  assert samp.pages_in_use == 0, 'pages leaked'
  entries = session.entries.values()
  assert all((e.state is not None) == (cfg.mamba_layers > 0) for e in entries) and entries
  session.close()
  assert session.pages_held == 0 and session.pool is None


@pytest.mark.heavy   # compiles the hybrid's prefill and decode on 8 simulated devices (~1-2 min)
def test_hybrid_engine_on_a_sequence_mesh_splits_rows_over_it():
  """Cascade 2's recipe on a mesh with a sequence axis (configs/_recipes.SEQUENCE_MESH): the
  weights in its training layout, the sampler with its rollout rules, which also split the
  rows over 'sequence', on (data, fsdp, expert, sequence, tensor) = (1, 1, 2, 2, 2): the paged
  engine's rows equal the unsharded one-call sampler's, and its slots and page pool are split
  over 4 batch shards (expert x sequence), not 2."""
  from configs import nemotron_cascade2  # pylint: disable=g-import-not-at-top
  from models import sharding  # pylint: disable=g-import-not-at-top
  recipe = nemotron_cascade2.get_config()
  assert len(recipe.mesh.shape) == 5
  rules, rollout = recipe.mesh.rules, recipe.sampler.rollout_rules
  cfg = CONFIGS['hybrid']
  mesh = sharding.make_mesh((1, 1, 2, 2, 2))
  graphdef, params = nnx.split(transformer.create(cfg, seed=0, mesh=mesh, rules=rules))
  params = jax.tree.map(lambda x: x * 3 if x.ndim >= 2 else x, params)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, engine='paged', page_size=8,
                         mesh=mesh, rules=rules, rollout_rules=rollout, slots=8, chunk_steps=4,
                         prefill_prompts=2, **BUCKETS)
  out = samp.generate(params, PROMPTS, jax.random.key(5), SP, num_samples=G, row_limits=LIMITS)
  host = jax.device_get(params)
  one_call = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, **BUCKETS)
  ref = one_call.generate(host, PROMPTS, jax.random.key(5), SP, num_samples=G,
                          row_limits=LIMITS)
  _assert_same_rows(out, ref)
  assert samp.pages_in_use == 0
  [eng] = samp._rollout.engines.values()
  assert eng.shards == 4
  assert sharding.batch_shards(mesh, samp.rules) == 4 and sharding.batch_shards(mesh, rules) == 2
