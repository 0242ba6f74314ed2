"""Rollout throughput of rl.sampler, optionally against `transformers` generate (same weights).

  .venv/bin/python -m benchmarks.sampler --compare_hf --mode=greedy
  .venv/bin/python -m benchmarks.sampler --compare_hf --mode=sample
  .venv/bin/python -m benchmarks.sampler --compare_hf --layers=4 --embed=512 \
      --heads=8 --head_dim=64 --kv_heads=8 --mlp=2048 --vocab=4096 --scaling=

Defaults are the tiny Qwen3-like shape (2 layers, embed 192, 6 x 32 heads,
MLP 768, vocab 256), batch 32, 16-token prompts, 64 new tokens. Both sides
generate exactly --new_tokens tokens per row, with no stop token (`generate`:
eos_token_id=None; a stop token held back by min_new_tokens would be one token
`generate` can never emit and ours can, which the greedy comparison below
caught on the hybrid family). With --compare_hf the two run alternately in
this process (torch on --hf_threads=2 threads) so that load from other
processes hits both alike; the ratio of medians is reported.

--workload=longtail is the long-tailed rollout workload instead: --prompts
prompts x --group samples, each row with its own target length drawn from a
lognormal (median --new_tokens / 8, a few rows at --new_tokens), enforced
identically on every side as a per-row stop position (`row_limits` for ours,
a per-row stopping criterion for `generate`). It reports useful tokens/s
(tokens of the rows, not padding) for the one-call sampler in chunks of
--batch rows, the paged engine at the same KV-cache memory (--batch x (prompt
+ new tokens) token slots as pages) with --slots x --batch slots, and
with --compare_hf `generate` in batches of --batch rows:

  .venv/bin/python -m benchmarks.sampler --workload=longtail --mode=sample --compare_hf

--workload=turns is an agentic workload: --prompts episodes, each a
--prompt_len-token opening, then --turns turns of --new_tokens sampled
tokens followed by an --obs_len-token observation; every turn's prompt is
the episode's stream so far. Side by side: the paged engine with a KV session
(each episode's cache kept between turns: a turn prefills only its new
tokens), the same engine re-prefilling the whole stream every turn, and the
one-call sampler (which re-prefills). All sides sample the same tokens:

  .venv/bin/python -m benchmarks.sampler --workload=turns --prompt_len=256 --obs_len=128 \
      --new_tokens=32 --turns=6 --mode=sample

--family=hybrid (Nemotron-H-like: Mamba-2, attention without RoPE, squared-ReLU MLP and
sigmoid-routed experts with a shared expert) and --family=moe (Qwen3-MoE-like: attention then
softmax-routed SwiGLU experts, one mlp-only layer), for any workload, build
ModelConfig.tiny_hybrid / ModelConfig.tiny_moe: its layer pattern ('ME*EM-'; 'moe, mlp, moe',
each layer attention + its feed-forward: 6 sublayers either way), expert count and top-k (8,
top-2), router, Mamba head width (16), groups, state and convolution, scaled by the shape
flags: --embed, --heads, --head_dim, --kv_heads and --vocab as given; --mlp the MLP
sublayers' width, the routed and the shared expert's widths at the preset's ratios to it
(1/3 and 1/2: 256 and 384 at the default 768); the Mamba heads at the preset's ratio to
--embed (inner width = residual width: 12 heads at 192). --layers does not apply (the
pattern fixes the stack; passing it is an error), nor does --compare_scan (these stacks
always run their sublayers unrolled). The floor counts the active parameters
(benchmarks.floor.generation_floor says what it counts), and with --compare_hf the fixed
workload compares the greedy tokens of both sides row by row, in every family (in sample
mode on one more greedy call per side over the first 8 rows):

  .venv/bin/python -m benchmarks.sampler --family=hybrid --compare_hf --mode=greedy
  .venv/bin/python -m benchmarks.sampler --family=moe --compare_hf --mode=greedy

Printed: a table per measurement, how the time per token grows with the
number of new tokens (--scaling), the physical floor of the generation (its
FLOPs over a measured float32 matmul rate, its bytes over a measured memory
bandwidth), for the fixed workload the same work as a bare jitted loop on this
backend (--xla_reference: the model's matmuls, attention and Mamba state
updates and nothing else, and its matmuls alone: what the compiler reaches,
below which no model code goes), and last one JSON line with tokens_per_s,
ms_per_token, compile_s, peak_rss_mb, xla_loop_s, xla_matmuls_s (and
hf_tokens_per_s, speedup_vs_hf;
with --compare_scan, speedup_vs_scan: the sampler's decode_layers='scan'), the
family (every workload's line) and, with --compare_hf, greedy_rows_agree and
greedy_tokens_agree out of greedy_rows x new_tokens.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

if __package__ in (None, ''):
  # Run as a file (python benchmarks/sampler.py): make the repository importable.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402  (the imports below need the path above)
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floor
from benchmarks import host
from cascade import policies
from models import config as config_lib
from models import transformer
from rl import buckets
from rl import engine_options
from rl import sampler as sampler_lib

_FAMILY = flags.DEFINE_enum(
    'family', 'dense', ['dense', 'hybrid', 'moe'],
    'dense: Qwen3-like blocks of the shape flags; hybrid / moe: ModelConfig.tiny_hybrid / '
    'tiny_moe scaled by the shape flags (the module docstring says which apply).')
_LAYERS = flags.DEFINE_integer('layers', 2, 'Transformer blocks (dense family only).')
_EMBED = flags.DEFINE_integer('embed', 192, 'Residual width.')
_HEADS = flags.DEFINE_integer('heads', 6, 'Query heads.')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 32, 'Per-head width.')
_KV_HEADS = flags.DEFINE_integer('kv_heads', 6, 'Key/value heads.')
_MLP = flags.DEFINE_integer('mlp', 768, 'MLP hidden width (hybrid / moe: also sets the '
                           'experts\' widths).')
_VOCAB = flags.DEFINE_integer('vocab', 256, 'Vocabulary size.')
_BATCH = flags.DEFINE_integer('batch', 32, 'Rows generated at once.')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 16, 'Tokens per prompt.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per row.')
_MODE = flags.DEFINE_enum('mode', 'greedy', ['greedy', 'sample'], 'Decoding mode.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sample mode: temperature.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample mode: nucleus mass (1 = off).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample mode: top-k (0 = off).')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed runs per side.')
_SCALING = flags.DEFINE_list('scaling', ['64', '256', '1024'],
                             'New-token counts for the per-token growth table (empty: skip).')
_COMPARE_HF = flags.DEFINE_bool('compare_hf', False,
                                'Also time transformers generate (torch CPU, 2 threads).')
_HF_THREADS = flags.DEFINE_integer(
    'hf_threads', 2, 'torch threads for --compare_hf (2 = the spec; 1 is steadier when other '
    'processes load the CPU, since a 2-thread op waits for a descheduled thread).')
_SEED = flags.DEFINE_integer('seed', 0, 'Weights and prompts seed.')
_XLA_REFERENCE = flags.DEFINE_bool(
    'xla_reference', True, 'Fixed: also time a bare jitted loop of the same matmuls and '
    'attention on this backend (benchmarks.floor.xla_decode_loop), with and without attention.')
_COMPARE_SCAN = flags.DEFINE_bool(
    'compare_scan', False, "Fixed: also time the sampler with decode_layers='scan' (alternated).")
_TURNS = flags.DEFINE_integer('turns', 6, 'Turns: assistant turns per episode.')
_OBS_LEN = flags.DEFINE_integer('obs_len', 128, 'Turns: observation tokens after each turn.')
_WORKLOAD = flags.DEFINE_enum('workload', 'fixed', ['fixed', 'longtail', 'turns'],
                              'fixed: every row --new_tokens; longtail: per-row lengths.')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'Longtail: prompts.')
_GROUP = flags.DEFINE_integer('group', 8, 'Longtail: samples per prompt (G).')
_PAGE_SIZE = flags.DEFINE_integer('page_size', 16, 'Longtail: KV page size of the engine.')
_CHUNK_STEPS = flags.DEFINE_integer('chunk_steps', 32, 'Longtail: engine decode steps per call.')
_SLOTS = flags.DEFINE_list('slots', ['1', '2', '4'],
                           'Longtail: engine slot counts, as multiples of --batch.')


_PRESETS = {'hybrid': config_lib.ModelConfig.tiny_hybrid,
            'moe': config_lib.ModelConfig.tiny_moe}


def _model_config() -> config_lib.ModelConfig:
  max_len = max(4096, _PROMPT_LEN.value + _NEW_TOKENS.value)
  if _FAMILY.value == 'dense':
    return config_lib.ModelConfig(
        family='qwen3', vocab_size=_VOCAB.value, embed_dim=_EMBED.value,
        num_layers=_LAYERS.value, num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value,
        head_dim=_HEAD_DIM.value, mlp_dim=_MLP.value, qk_norm=True, tie_embeddings=True,
        max_seq_len=max_len)
  preset = _PRESETS[_FAMILY.value]
  for name in ('layers', 'compare_scan'):
    if flags.FLAGS[name].present:
      raise app.UsageError(f'--{name} does not apply to --family={_FAMILY.value}: its layer '
                           'pattern fixes the stack and its sublayers always run unrolled')
  base = preset()
  widths = dict(moe_dim=_MLP.value * base.moe_dim // base.mlp_dim,
                shared_expert_dim=_MLP.value * base.shared_expert_dim // base.mlp_dim)
  if base.mamba_heads:
    widths['mamba_heads'] = _EMBED.value * base.mamba_heads // base.embed_dim
  return preset(vocab_size=_VOCAB.value, embed_dim=_EMBED.value, num_heads=_HEADS.value,
                num_kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value, mlp_dim=_MLP.value,
                max_seq_len=max_len, **widths)


def _describe(cfg: config_lib.ModelConfig) -> str:
  """The model line's shape part."""
  heads = f'{cfg.num_heads}x{cfg.head_dim} heads ({cfg.num_kv_heads} kv)'
  if cfg.kv_stacked:
    return (f'{cfg.num_layers} layers, embed {cfg.embed_dim}, {heads}, mlp {cfg.mlp_dim}, '
            f'vocab {cfg.vocab_size}, {cfg.num_params() / 1e6:.2f}M params')
  out = (f'{_FAMILY.value} ({cfg.family}): sublayers {",".join(cfg.mixers)}; embed '
         f'{cfg.embed_dim}, attention {heads}, mlp {cfg.mlp_dim}, {cfg.num_experts} experts '
         f'top-{cfg.experts_per_token} ({cfg.router}) of width {cfg.moe_dim}')
  if cfg.shared_expert_dim:
    out += f' + shared {cfg.shared_expert_dim}'
  if cfg.mamba_layers:
    out += (f', mamba {cfg.mamba_heads}x{cfg.mamba_head_dim} heads, {cfg.mamba_groups} groups, '
            f'state {cfg.mamba_state}')
  return (out + f', vocab {cfg.vocab_size}; {cfg.num_params() / 1e6:.2f}M params, '
          f'{cfg.num_params(active=True) / 1e6:.2f}M active')


def _matmul_shapes(cfg: config_lib.ModelConfig, rows: int) -> list[tuple[int, int, int]]:
  """The model's own [M, K] x [K, N] products at `rows` rows, for floor.measure_machine."""
  d = cfg.embed_dim
  shapes = [(rows, d, cfg.mlp_dim), (rows, cfg.mlp_dim, d), (rows, d, cfg.vocab_size)]
  if cfg.num_experts:
    shapes.append((rows, d, cfg.num_experts * cfg.moe_dim))
  if cfg.mamba_layers:
    shapes.append((rows, d, 2 * cfg.mamba_heads * cfg.mamba_head_dim + cfg.mamba_conv_dim))
  return shapes


def _sampling_params(new_tokens: int, greedy: bool | None = None) -> sampler_lib.SamplingParams:
  if greedy is None:
    greedy = _MODE.value == 'greedy'
  if greedy:
    return sampler_lib.SamplingParams(max_new_tokens=new_tokens, greedy=True)
  return sampler_lib.SamplingParams(max_new_tokens=new_tokens, temperature=_TEMPERATURE.value,
                                    top_p=_TOP_P.value, top_k=_TOP_K.value)


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


class _Ours:
  """Our sampler on fixed prompts; each call uses a fresh key."""

  def __init__(self, cfg, model, prompts, new_tokens, decode_layers='auto'):
    self.graphdef, self.params = nnx.split(model)
    if decode_layers == 'scan':   # one lax.scan body, as accelerators run it (not 'auto''s loop)
      self.graphdef = policies.abstract_model(cfg.replace(scan_layers=True), 'policy')[0]
    # The prompt bucket is the prompt length, as configs set it (configs/_tiny_common.py).
    self.sampler = sampler_lib.Sampler(self.graphdef, cfg, eos_ids=(),
                                       prompt_buckets=(len(prompts[0]),),
                                       decode_layers=decode_layers)
    self.prompts = prompts
    self.sp = _sampling_params(new_tokens)
    self.calls = 0

  def __call__(self):
    self.calls += 1
    out = self.sampler.generate(self.params, self.prompts, jax.random.key(self.calls), self.sp)
    assert out.mask.all(), 'our sampler stopped early'
    return out


class _HF:
  """transformers generate on the same weights (written through models.hf.save_model)."""

  def __init__(self, model, prompts, new_tokens, workdir):
    try:                                            # only with --compare_hf
      import torch
      import transformers
    except ImportError as e:
      raise SystemExit(f'--compare_hf needs torch and transformers ({e}); install them with '
                       "pip install -e '.[interop]'") from e
    from models import hf
    torch.set_num_threads(_HF_THREADS.value)
    hf.save_model(model, workdir)
    self.torch = torch
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        workdir, dtype=torch.float32).eval()
    self.ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    self.new_tokens = new_tokens
    # Identical weights: same prompt logits up to float32 rounding.
    with torch.no_grad():
      theirs = self.model(self.ids).logits.numpy()
    # One compiled forward: run eagerly, every op of the hybrid stack compiled on its own
    # (40 s of a 60 s smoke run on these CPUs).
    ours = np.asarray(nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(prompts, jnp.int32)))
    self.logits_max_abs_diff = float(np.max(np.abs(theirs - ours)))
    if self.logits_max_abs_diff > 1e-3:
      raise RuntimeError(f'HF logits differ from ours by {self.logits_max_abs_diff}: '
                         'the weights did not round-trip')

  def __call__(self):
    return self.generate(self.ids, greedy=_MODE.value == 'greedy')

  def generate(self, ids, greedy: bool):
    """[rows, prompt + new] tokens of `generate` on the prompt rows `ids`."""
    kw = dict(do_sample=False)
    if not greedy:
      kw = dict(do_sample=True, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                top_k=_TOP_K.value)
    with self.torch.no_grad():
      out = self.model.generate(
          ids, attention_mask=self.torch.ones_like(ids),
          max_new_tokens=self.new_tokens, eos_token_id=None, pad_token_id=0, **kw)
    assert out.shape[1] == ids.shape[1] + self.new_tokens, out.shape
    return out


# Rows whose greedy tokens are compared in sample mode (a separate greedy call on each side).
_AGREE_ROWS = 8


def _greedy_agreement(ours: _Ours, hf: _HF, new: int) -> dict:
  """Greedy tokens of our sampler and of `generate` on the same prompts, row by row.

  In greedy mode the timed programs themselves on every row; in sample mode one greedy call
  per side on the first _AGREE_ROWS rows (our sampler compiles its greedy program for it).

  Returns:
    greedy_rows, greedy_rows_agree (rows identical over all `new` tokens),
    greedy_tokens_agree (equal tokens, position by position) and greedy_first_divergence
    (per disagreeing row, the first step that differs).
  """
  if _MODE.value == 'greedy':
    prompts, mine = ours.prompts, ours().tokens
  else:
    prompts = ours.prompts[:_AGREE_ROWS]
    mine = ours.sampler.generate(ours.params, prompts, jax.random.key(0),
                                 _sampling_params(new, greedy=True)).tokens
  ids = hf.torch.tensor(np.asarray(prompts), dtype=hf.torch.long)
  theirs = hf.generate(ids, greedy=True)[:, ids.shape[1]:].numpy()
  same = np.asarray(mine)[:, :new] == theirs
  rows = same.all(axis=1)
  return dict(greedy_rows=len(rows), greedy_rows_agree=int(rows.sum()),
              greedy_tokens_agree=int(same.sum()),
              greedy_first_divergence=[int(np.argmin(r)) for r in same if not r.all()])


def _time(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def _row(name, seconds, batch, new):
  med = statistics.median(seconds)
  return (f'{name:<24} {med * 1e3:10.1f} {min(seconds) * 1e3:10.1f} '
          f'{batch * new / med:12.0f} {med / new * 1e3:10.3f}')


class _HFLimits:
  """transformers generate in batches of --batch rows, each row stopped at its own length."""

  def __init__(self, model, prompts, limits, workdir):
    import torch
    import transformers
    from models import hf
    torch.set_num_threads(_HF_THREADS.value)
    hf.save_model(model, workdir)
    self.torch, self.transformers = torch, transformers
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        workdir, dtype=torch.float32).eval()
    self.prompts, self.limits = np.asarray(prompts), np.asarray(limits)

  def __call__(self):
    torch, batch = self.torch, _BATCH.value
    plen = self.prompts.shape[1]
    useful = 0
    for start in range(0, len(self.prompts), batch):
      ids = torch.tensor(self.prompts[start:start + batch], dtype=torch.long)
      lim = torch.tensor(self.limits[start:start + batch])

      class _Stop(self.transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
          return (input_ids.shape[1] - plen) >= lim          # [rows] bool: per-row stop

      kw = dict(do_sample=_MODE.value == 'sample')
      if _MODE.value == 'sample':
        kw.update(temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value)
      with torch.no_grad():
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(lim.max()),
            stopping_criteria=self.transformers.StoppingCriteriaList([_Stop()]),
            eos_token_id=None, pad_token_id=0, **kw)   # no stop token: rows end at their length
      useful += int(np.minimum(out.shape[1] - plen, self.limits[start:start + batch]).sum())
    return useful


def longtail(cfg, model):
  """The long-tail workload (see the module docstring); prints a table and one JSON line."""
  load_before = os.getloadavg()
  batch, plen, cap, g = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value, _GROUP.value
  rng = np.random.default_rng(_SEED.value)
  prompts = rng.integers(0, cfg.vocab_size, (_PROMPTS.value, plen)).tolist()
  rows = len(prompts) * g
  limits = floor.longtail_limits(rows, cap, _SEED.value)
  useful = int(limits.sum())
  graphdef, params = nnx.split(model)
  sp = _sampling_params(cap)
  pb = buckets.smallest_fit(engine_options.DEFAULT_PROMPT_BUCKETS, plen, 'prompt')
  nb = buckets.smallest_fit(engine_options.DEFAULT_NEW_TOKEN_BUCKETS, cap, 'new tokens')
  budget = batch * (pb + nb)                       # KV token slots: the same for every side
  one_call = sampler_lib.Sampler(graphdef, cfg, eos_ids=(), cache_tokens_per_device=budget)
  assert one_call.chunk_rows(rows, pb + nb) == batch
  sides = {'one-call sampler': one_call}
  engines = [int(x) * batch for x in _SLOTS.value]
  for slots in engines:
    sides[f'paged engine, {slots} slots'] = sampler_lib.Sampler(
        graphdef, cfg, eos_ids=(), engine='paged', slots=slots, page_size=_PAGE_SIZE.value,
        pages=budget // _PAGE_SIZE.value, chunk_steps=_CHUNK_STEPS.value)
  calls = [0]

  def run(s):
    def call():
      calls[0] += 1
      out = s.generate(params, prompts, jax.random.key(calls[0]), sp, num_samples=g,
                       row_limits=limits)
      assert int(out.lengths.sum()) == useful, 'a row did not run to its target length'
    return call

  first = {name: _time(run(s)) for name, s in sides.items()}
  hf = None
  if _COMPARE_HF.value:
    hf = _HFLimits(model, np.repeat(np.asarray(prompts), g, axis=0), limits,
                   tempfile.mkdtemp(prefix='sampler_bench_hf_'))
    assert hf() == useful
  secs = {name: [] for name in sides}
  if hf is not None:
    secs['transformers generate'] = []
  for _ in range(_REPEATS.value):                   # alternate, so load drift hits all alike
    for name, s in sides.items():
      secs[name].append(_time(run(s)))
    if hf is not None:
      secs['transformers generate'].append(_time(hf))
  med = {name: statistics.median(v) for name, v in secs.items()}
  base = med['one-call sampler']
  print(f'\nlong-tail workload: {len(prompts)} prompts x {g} samples = {rows} rows, target '
        f'lengths median {int(np.median(limits))}, mean {limits.mean():.0f}, max {limits.max()} '
        f'(cap {cap}); {useful} useful tokens; KV memory {budget} token slots on every side')
  print(f'{"":<28} {"median s":>9} {"useful tok/s":>13} {"vs one-call":>12} {"slot use":>9}')
  result = dict(workload='longtail', family=_FAMILY.value, rows=rows, group=g, cap=cap,
                useful_tokens=useful,
                kv_token_slots=budget, page_size=_PAGE_SIZE.value,
                chunk_steps=_CHUNK_STEPS.value, sides={})
  for name, m in med.items():
    s = sides.get(name)
    use = ''
    if s is not None and s.decode_slots:
      use = f'{s.generated_tokens / s.decode_slots:.0%}'
    print(f'{name:<28} {m:>9.3f} {useful / m:>13.0f} {base / m:>11.2f}x {use:>9}')
    result['sides'][name] = dict(median_s=m, useful_tokens_per_s=useful / m,
                                 speedup_vs_one_call=base / m,
                                 first_call_s=first.get(name),
                                 compile_count=None if s is None else s.compile_count)
  best = min(med[f'paged engine, {n} slots'] for n in engines)
  result['engine_vs_one_call'] = base / best
  if hf is not None:
    result['engine_vs_hf'] = med['transformers generate'] / best
  flops_rate, bandwidth = floor.measure_machine(_matmul_shapes(cfg, batch))
  # The floor of the useful work: its FLOPs (every row's own tokens, no padding, no idle
  # slot) at the measured matmul rate; the weight reads of a batched step amortise.
  flops = sum(floor.generation_floor(cfg, 1, plen, int(n), flops_rate, bandwidth)['flops']
              for n in limits)
  fl = flops / flops_rate
  print(f'machine: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s, memory read '
        f'{bandwidth / 1e9:.1f} GB/s; floor of the useful work {flops / 1e9:.2f} GFLOP -> '
        f'{fl:.3f} s; best side {min(med.values()) / fl:.1f}x the floor')
  result.update(floor_s=fl)
  result.update(matmul_gflops=flops_rate / 1e9, mem_gbps=bandwidth / 1e9)
  host.print_load_warning(load_before)
  print(json.dumps(result))


def turns(cfg, model):
  """The agentic turns workload (see the module docstring); prints a table and one JSON line."""
  load_before = os.getloadavg()
  n, plen, new, obs, t = (_PROMPTS.value, _PROMPT_LEN.value, _NEW_TOKENS.value, _OBS_LEN.value,
                          _TURNS.value)
  rng = np.random.default_rng(_SEED.value)
  openings = rng.integers(0, cfg.vocab_size, (n, plen)).tolist()
  observations = rng.integers(0, cfg.vocab_size, (t, n, obs)).tolist()
  graphdef, params = nnx.split(model)
  sp = _sampling_params(new)
  longest = plen + t * new + (t - 1) * obs
  paged = lambda: sampler_lib.Sampler(graphdef, cfg, eos_ids=(), engine='paged', slots=n,
                                      page_size=_PAGE_SIZE.value, chunk_steps=_CHUNK_STEPS.value)
  sides = {'paged engine + KV session': (paged(), True),
           'paged engine, re-prefill': (paged(), False),
           'one-call sampler, re-prefill': (sampler_lib.Sampler(graphdef, cfg, eos_ids=()), False)}
  calls = [0]

  def run(s, keep):
    """All turns of every episode; returns (each turn's tokens, tokens prefilled)."""
    calls[0] += 1
    streams = [list(q) for q in openings]
    session = s.session(longest) if keep else None
    out, prefilled = [], 0
    for turn in range(t):
      kw = dict(session=session, keys=list(range(n))) if keep else {}
      got = s.generate(params, streams, jax.random.fold_in(jax.random.key(calls[0]), turn), sp,
                       **kw)
      assert got.mask.all(), 'a turn stopped early'
      out.append(got.tokens)
      prefilled += sum(len(q) - 1 for q in streams)
      for i in range(n):
        streams[i] += got.tokens[i].tolist() + (observations[turn][i] if turn < t - 1 else [])
    if keep:
      prefilled = session.prefilled_tokens
      session.close()
    return out, prefilled

  first, prefilled, ref = {}, {}, None
  for name, (s, keep) in sides.items():
    t0 = time.perf_counter()
    calls[0] = 0
    toks, prefilled[name] = run(s, keep)
    first[name] = time.perf_counter() - t0
    for a, b in zip(toks, ref or toks):         # every side samples the same tokens
      np.testing.assert_array_equal(a, b)
    ref = ref or toks
  secs = {name: [] for name in sides}
  for rep_i in range(_REPEATS.value):               # alternate, so load drift hits all alike
    for name, (s, keep) in sides.items():
      calls[0] = rep_i + 1
      secs[name].append(_time(lambda: run(s, keep)))
  med = {name: statistics.median(v) for name, v in secs.items()}
  useful = n * t * new
  base = med['paged engine, re-prefill']
  print(f'\nturns workload: {n} episodes x {t} turns of {new} tokens, opening {plen}, '
        f'observations {obs}; streams end at {longest} tokens; {useful} sampled tokens')
  print(f'{"":<30} {"median s":>9} {"tokens/s":>9} {"prefilled":>10} {"vs re-prefill":>14}')
  result = dict(workload='turns', family=_FAMILY.value, episodes=n, turns=t, new_tokens=new,
                opening=plen,
                obs_len=obs, sides={})
  for name, m in med.items():
    print(f'{name:<30} {m:>9.3f} {useful / m:>9.0f} {prefilled[name]:>10} {base / m:>13.2f}x')
    result['sides'][name] = dict(median_s=m, tokens_per_s=useful / m,
                                 prefilled_tokens=prefilled[name], first_call_s=first[name],
                                 speedup_vs_reprefill=base / m,
                                 compile_count=sides[name][0].compile_count)
  result['session_vs_reprefill'] = base / med['paged engine + KV session']
  result['session_vs_one_call'] = (med['one-call sampler, re-prefill']
                                   / med['paged engine + KV session'])
  flops_rate, bandwidth = floor.measure_machine(_matmul_shapes(cfg, n))
  # The floor: each stream's non-sampled tokens prefilled once, its sampled tokens decoded
  # once (a batch of the episodes), at the measured rates.
  fl = floor.generation_floor(cfg, n, plen + (t - 1) * obs, t * new, flops_rate, bandwidth)
  best = min(med.values())
  print(f'machine: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s, memory read '
        f'{bandwidth / 1e9:.1f} GB/s; floor (each stream prefilled and decoded once) '
        f'{fl["floor_s"]:.3f} s; best side {best / fl["floor_s"]:.1f}x the floor')
  result.update(floor_s=fl['floor_s'], matmul_gflops=flops_rate / 1e9,
                mem_gbps=bandwidth / 1e9)
  host.print_load_warning(load_before)
  print(json.dumps(result))


def main(argv):
  del argv
  load_before = os.getloadavg()
  cfg = _model_config()
  if _WORKLOAD.value == 'turns':
    print(f'model: {_describe(cfg)} | jax {jax.__version__} on {jax.devices()[0].platform}')
    return turns(cfg, transformer.create(cfg, seed=_SEED.value))
  if _WORKLOAD.value == 'longtail':
    print(f'model: {_describe(cfg)} | jax {jax.__version__} on {jax.devices()[0].platform}')
    return longtail(cfg, transformer.create(cfg, seed=_SEED.value))
  batch, plen, new = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  model = transformer.create(cfg, seed=_SEED.value)
  rng = np.random.default_rng(_SEED.value)
  prompts = rng.integers(0, cfg.vocab_size, (batch, plen)).tolist()
  print(f'model: {_describe(cfg)} | batch {batch}, prompt {plen}, new {new}, '
        f'mode {_MODE.value} | jax {jax.__version__} on {jax.devices()[0].platform}')

  ours = _Ours(cfg, model, prompts, new)
  first_s = _time(ours)
  compile_count = ours.sampler.compile_count
  peak_rss = _peak_rss_mb()                         # before torch is imported
  hf = None
  if _COMPARE_HF.value:
    hf = _HF(model, prompts, new, tempfile.mkdtemp(prefix='sampler_bench_hf_'))
    hf()                                            # warm-up
  scan = None
  if _COMPARE_SCAN.value:
    scan = _Ours(cfg, model, prompts, new, decode_layers='scan')
    scan()                                          # compile
  ours_s, hf_s, scan_s = [], [], []
  for _ in range(_REPEATS.value):                   # alternate, so load drift hits all
    ours_s.append(_time(ours))
    if hf is not None:
      hf_s.append(_time(hf))
    if scan is not None:
      scan_s.append(_time(scan))
  compile_s = max(first_s - statistics.median(ours_s), 0.0)
  agree = {} if hf is None else _greedy_agreement(ours, hf, new)

  header = f'{"":<24} {"median ms":>10} {"best ms":>10} {"tokens/s":>12} {"ms/step":>10}'
  print('\n' + header)
  print(_row('cascade rl.sampler', ours_s, batch, new)
        + f'   (decode layers {ours.sampler.decode_layers})')
  if scan is not None:
    print(_row('  layers scanned', scan_s, batch, new))
    print(f'unrolled vs scanned: {statistics.median(scan_s) / statistics.median(ours_s):.2f}x '
          '(medians)')
  if hf is not None:
    print(_row(f'transformers ({_HF_THREADS.value} thr)', hf_s, batch, new))
    speedup = statistics.median(hf_s) / statistics.median(ours_s)
    print(f'speedup vs HF: {speedup:.2f}x (medians), {min(hf_s) / min(ours_s):.2f}x (best); '
          f'prompt logits max |diff| {hf.logits_max_abs_diff:.2e}')
    diverge = agree['greedy_first_divergence']
    print(f'greedy tokens, ours vs transformers: {agree["greedy_rows_agree"]}/'
          f'{agree["greedy_rows"]} rows identical, {agree["greedy_tokens_agree"]}/'
          f'{agree["greedy_rows"] * new} tokens equal'
          + (f' (differing rows first differ at steps {diverge})' if diverge else ''))
  print(f'first call (compile + run): {first_s:.2f} s, compile ~{compile_s:.2f} s, '
        f'{compile_count} compilation(s)')

  flops_rate, bandwidth = floor.measure_machine(_matmul_shapes(cfg, batch))
  fl = floor.generation_floor(cfg, batch, plen, new, flops_rate, bandwidth)
  med = statistics.median(ours_s)
  print(f'\nmachine: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s, memory read '
        f'{bandwidth / 1e9:.1f} GB/s')
  if not cfg.kv_stacked:
    mamba = (f', the state updates of {cfg.mamba_layers} Mamba sublayers' if cfg.mamba_layers
             else '')
    state = (f', {fl["step_state_bytes"] / 1e6:.2f} MB of Mamba state (read and written)'
             if cfg.mamba_layers else '')
    print(f'floor counts {cfg.num_params(active=True) / 1e6:.3f}M active of '
          f'{cfg.num_params() / 1e6:.3f}M params per token (top-{cfg.experts_per_token} of '
          f'{cfg.num_experts} routed experts), attention scores in {cfg.attention_layers} of '
          f'{len(cfg.mixers)} sublayers{mamba}; a decode step reads '
          f'{fl["step_weight_bytes"] / 1e6:.2f} MB of weights ({fl["experts_read"]} of '
          f'{cfg.num_experts} routed experts per moe sublayer: the bound min(experts, batch x '
          f'top-k) = min({cfg.num_experts}, {batch * cfg.experts_per_token}), as a small batch '
          f'touches every expert){state} and the attention sublayers\' filled KV')
  print(f'floor: {fl["flops"] / 1e9:.2f} GFLOP -> {fl["flops_s"] * 1e3:.1f} ms; '
        f'{fl["bytes"] / 1e9:.2f} GB -> {fl["bytes_s"] * 1e3:.1f} ms; per-step max -> '
        f'{fl["floor_s"] * 1e3:.1f} ms; measured {med * 1e3:.1f} ms = '
        f'{med / fl["floor_s"]:.1f}x the floor')
  xla = {}
  if _XLA_REFERENCE.value:
    xla = dict(xla_loop_s=floor.xla_decode_loop(cfg, batch, plen, new, repeats=_REPEATS.value),
               xla_matmuls_s=floor.xla_decode_loop(cfg, batch, plen, new, attention=False,
                                                   repeats=_REPEATS.value))
    print(f'this backend\'s bare loop of the same work: {xla["xla_loop_s"] * 1e3:.1f} ms '
          f'({xla["xla_loop_s"] / fl["floor_s"]:.1f}x the floor), its matmuls alone '
          f'{xla["xla_matmuls_s"] * 1e3:.1f} ms ({xla["xla_matmuls_s"] / fl["floor_s"]:.1f}x); '
          f'ours = {med / xla["xla_loop_s"]:.2f}x the bare loop')
    if cfg.num_experts:
      print(f'  (its moe sublayers run every routed expert over every row: '
            f'{cfg.num_experts / cfg.experts_per_token:.0f}x the routed FLOPs the floor counts, '
            'the fastest exact form on the CPU: see floor.xla_decode_loop)')

  scaling = []
  counts = [int(x) for x in _SCALING.value if x]
  if counts:
    print(f'\ntime per token vs new tokens ({_MODE.value}, batch {batch}, prompt {plen}):')
    print(f'{"new tokens":>10} {"median ms":>10} {"ms/step":>10} {"tokens/s":>10} '
          f'{"floor ms/step":>14} {"x floor":>8}')
    for n in counts:
      run = _Ours(cfg, model, prompts, n)
      run()
      secs = [_time(run) for _ in range(max(2, _REPEATS.value // 2))]
      m = statistics.median(secs)
      f = floor.generation_floor(cfg, batch, plen, n, flops_rate, bandwidth)
      scaling.append(dict(new_tokens=n, ms_per_step=m / n * 1e3, tokens_per_s=batch * n / m,
                          floor_ms_per_step=f['floor_s'] / n * 1e3))
      print(f'{n:>10} {m * 1e3:>10.1f} {m / n * 1e3:>10.3f} {batch * n / m:>10.0f} '
            f'{f["floor_s"] / n * 1e3:>14.3f} {m / f["floor_s"]:>8.1f}')

  result = dict(
      family=_FAMILY.value, model_family=cfg.family, mode=_MODE.value, batch=batch,
      prompt_len=plen, new_tokens=new,
      layers=cfg.num_layers, embed=cfg.embed_dim, heads=cfg.num_heads,
      head_dim=cfg.head_dim, kv_heads=cfg.num_kv_heads, mlp=cfg.mlp_dim, vocab=cfg.vocab_size,
      params=cfg.num_params(), active_params=cfg.num_params(active=True),
      tokens_per_s=batch * new / med, ms_per_token=med / (batch * new) * 1e3,
      ms_per_step=med / new * 1e3, compile_s=compile_s, first_call_s=first_s,
      peak_rss_mb=peak_rss, peak_rss_total_mb=_peak_rss_mb(),
      matmul_gflops=flops_rate / 1e9, mem_gbps=bandwidth / 1e9,
      floor_s=fl['floor_s'], x_floor=med / fl['floor_s'], scaling=scaling,
      decode_layers=ours.sampler.decode_layers, **xla)
  if scan is not None:
    result.update(scan_tokens_per_s=batch * new / statistics.median(scan_s),
                  speedup_vs_scan=statistics.median(scan_s) / med)
  if hf is not None:
    hf_med = statistics.median(hf_s)
    result.update(hf_tokens_per_s=batch * new / hf_med, speedup_vs_hf=hf_med / med,
                  speedup_vs_hf_best=min(hf_s) / min(ours_s),
                  hf_logits_max_abs_diff=hf.logits_max_abs_diff, hf_threads=_HF_THREADS.value,
                  **agree)
  host.print_load_warning(load_before)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
