"""The decoder stack of every family: residual sublayers chosen by a pattern, and its runner.

`ModelConfig.mixers` lists the sublayers in order; each is `x + mixer(norm(x))`
with its own RMSNorm, the mixer one of

* 'attention': grouped-query attention (models/layers.py), with RoPE and q/k
  norms as the family has them (Qwen3-MoE: both; Nemotron-H: neither);
* 'mamba': a Mamba-2 mixer (models/mamba.py) carrying a (conv, ssm) state;
* 'mlp': an MLP (SwiGLU, or Nemotron-H's squared ReLU);
* 'moe': routed experts and an optional shared expert (models/moe.py).

The sublayers differ in kind, so the stack cannot be one scan over identical
blocks as the dense decoders' is; compiling one body per sublayer, though, makes
the compile time grow with depth (Nemotron-3-Nano's 52 sublayers took minutes per
program for a TPU slice). `plan` cuts the pattern into segments: runs of a unit
repeated two or more times in a row, and single sublayers, choosing the cut
that needs the fewest sublayer bodies (Nemotron-3-Nano: 14, in 6 segments;
Qwen3-MoE's (attention, moe) x 48: 2). Where the kinds present are fewer than those bodies
(`folds`: Nemotron-3-Nano's 3 kinds against 14), the stack is instead one `Fold`: each
kind's sublayers, in pattern order, stacked on a leading 'layers' axis [count of that kind,
...], run as one `lax.scan` over the whole pattern whose body is a `lax.switch` on the
step's kind; the branch indexes its own kind's stack at the step's index within the kind
(both static per step, `fold_steps`), so a step reads no other kind's parameters. The
rematerialisation wraps the whole step, so the backward pass keeps the step's input and
indices per step and the stacks once (their gradients are accumulated in the backward
scan's carry, one stack-shaped accumulator per kind); without rematerialisation
(remat='none') a differentiated folded scan keeps every step's parameter slice as a
residual, so train a folded model with a remat policy. A repeated segment is a `Repeat`, whose
unit holds one Sublayer per position with the parameters of that position in
every repeat stacked on a leading 'layers' axis [repeats, ...] (the dense
blocks' logical axis, so the same sharding rules apply); it runs as one
`lax.scan` over the repeats when `cfg.scans_layers`, else as a Python loop over
the same stacks (a Fold likewise loops over the pattern, each sublayer sliced out of its
kind's stack). The layout depends only on the pattern. `locate` and `sublayer` map a sublayer's index in the pattern
to where its parameters live (HF interop, models/hf.py, reads and writes
each layer's tensors through it).

A cache stays per sublayer: a [B, K, S, H] key and value buffer per attention
sublayer (the dense cache's `unstack_cache` layout) and a `mamba.MambaState`
per Mamba sublayer. A call with a cache (prefill, decode, a paged step) runs a
repeated segment as a Python loop over its repeats, each sublayer updating its
own buffers, pools or state in place (a Fold: a loop over the pattern): a scan would stack
the caches for its carry and split them after, copying them on every decode step.
The dense families' pattern, ('attention', 'mlp') x L, is kept as one `Block` fusing the
two sublayers, its parameters stacked on a leading 'layers' axis [L, ...] (the paths every
checkpoint of theirs holds), run as one scanned body with one stacked [L, B, K, S, H] KV
cache per side, or as an unrolled loop over per-layer buffers (`layer_states`).
`models.transformer.Transformer` builds the stack its family names (models/families) and
calls `run` for every family; `run` picks one mode per call, each a named function below
(docs/model_families.md, "The stack runner's modes").
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import ad_checkpoint

from models import config as config_lib
from models import layers
from models import mamba
from models import moe
from models import sharding


class MoEStats(NamedTuple):
  """What a forward pass's 'moe' sublayers report (`Transformer.hidden` sows it as an
  nnx.Intermediate named 'moe_stats' where the model's `collect_moe_stats` is set).

  Attributes:
    indices: [M, B, T, k] int32 experts each token chose in each of the M 'moe'
      sublayers (routing replay feeds these back).
    aux_loss: [] float32 load-balancing loss, the mean over the sublayers.
    z_loss: [] float32 router z-loss, the mean over the sublayers.
    mismatched: [] float32 (real token, 'moe' sublayer) pairs whose router's own expert set
      differs from the `routing` given (replayed or only compared); None without one.
    compared: [] float32 (real token, 'moe' sublayer) pairs compared; None without routing.
    token_differs: [B, T] bool real tokens whose router's own expert set differs from the
      `routing` given in at least one 'moe' sublayer; None without routing.
  """
  indices: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  mismatched: jax.Array | None = None
  compared: jax.Array | None = None
  token_differs: jax.Array | None = None


class Sublayer(nnx.Module):
  """x + mixer(norm(x)) for one entry of `cfg.mixers`."""

  def __init__(self, cfg: config_lib.ModelConfig, kind: str, rngs: nnx.Rngs):
    self.kind = kind
    self.norm = layers.RMSNorm(cfg.embed_dim, cfg.norm_eps, cfg.jnp_param_dtype)
    if kind == 'attention':
      self.mixer = layers.Attention(cfg, rngs)
    elif kind == 'mamba':
      self.mixer = mamba.Mamba2Mixer(cfg, rngs)
    elif kind == 'mlp':
      self.mixer = (cfg.spec.mlp or layers.MLP)(cfg, rngs)
    elif kind == 'moe':
      self.mixer = moe.MoE(cfg, rngs)
    else:
      raise ValueError(f'unknown sublayer kind {kind!r}')

  def __call__(self, x, positions, mask, segment_ids, part=None, routing=None, replay=True, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES):
    """One sublayer.

    Args:
      x: [B, T, D] residual stream.
      positions, mask: as the attention takes them (attention only).
      segment_ids: [B, T] int32, 0 = padding (Mamba resets and MoE statistics).
      part: this sublayer's cache: an attention's (k, v, None, index) own buffers or
        a `layers._PagedStep`; a Mamba mixer's MambaState; None otherwise.
      routing: [B, T, k] experts to use instead of the router's choice (moe only).
      replay: with `routing`, replay it (True) or only compare with it (moe only).
      rules: the logical rules the caller traces with (`models.sharding`).

    Returns:
      (x, the written cache part or None, a moe.MoEOutput without y or None).
    """
    h = self.norm(x)
    report = None
    if self.kind == 'attention':
      h, part = self.mixer(h, positions, mask, part, rules=rules)
    elif self.kind == 'mamba':
      h, part = self.mixer(h, segment_ids, part, rules=rules)
    elif self.kind == 'mlp':
      h = self.mixer(h, rules=rules)
    else:
      out = self.mixer(h, token_mask=segment_ids > 0, routing=routing, replay=replay,
                       rules=rules)
      h, report = out.y, out._replace(y=None)
    x = x + h.astype(x.dtype)
    return sharding.constrain(x, ('batch', 'length', 'embed'), rules), part, report


class Block(nnx.Module):
  """The dense families' unit of the pattern, ('attention', 'mlp') fused into one pre-norm
  residual block: x + attn(norm(x)), then x + mlp(norm(x)). Their stack is L Blocks with
  the parameters stacked on a leading 'layers' axis (`stack_blocks`), run as one scanned
  body (`_blocks_*` below)."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs):
    pd = cfg.jnp_param_dtype
    self.input_norm = layers.RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    self.attn = layers.Attention(cfg, rngs)
    self.post_attn_norm = layers.RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    self.mlp = (cfg.spec.mlp or layers.MLP)(cfg, rngs)

  def __call__(self, x, positions, mask, kv_cache=None, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES):
    """(x after the block, the written cache or None); `rules`: the caller's logical rules."""
    h, new_kv = self.attn(self.input_norm(x), positions, mask, kv_cache, rules=rules)
    # The name the 'save_attention_out' remat policy keeps.
    x = x + ad_checkpoint.checkpoint_name(h, 'attention_out')
    x = x + self.mlp(self.post_attn_norm(x), rules=rules)
    return sharding.constrain(x, ('batch', 'length', 'embed'), rules), new_kv


def stack_blocks(blocks: list[Block]) -> Block:
  """One Block holding `blocks`' parameters stacked on a leading 'layers' axis [L, ...].

  Built from Blocks made one after another, so layer i has exactly the values
  (and the RNG draws) it had as the i-th of a list of Blocks.
  """
  def stack(*vs):
    axes = ('layers',) + tuple(vs[0].get_metadata()['logical_axes'])
    return vs[0].replace(jnp.stack([v.get_value() for v in vs]), logical_axes=axes)
  states = [nnx.state(b) for b in blocks]
  stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(nnx.graphdef(blocks[0]), stacked)


class Segment(NamedTuple):
  """A run of the sublayer pattern: `unit` (a tuple of kinds) repeated `repeats` times from
  sublayer `start`. A segment of one repeat is a single sublayer run as it is; a longer one
  keeps each position's parameters stacked on a leading 'layers' axis [repeats, ...] and runs
  as one `lax.scan` over the repeats (or a Python loop, `scan_layers=False`)."""
  start: int
  unit: tuple[str, ...]
  repeats: int

  @property
  def stop(self) -> int:
    return self.start + len(self.unit) * self.repeats


@functools.lru_cache(maxsize=64)
def plan(mixers: tuple[str, ...]) -> tuple[Segment, ...]:
  """`mixers` cut into segments that need the fewest sublayer bodies to compile.

  A segment is a single sublayer (one body) or a unit of sublayers repeated >= 2 times in a
  row (len(unit) bodies, however many repeats); an exact dynamic programme over the cut points
  minimises the bodies, then the segments. Nemotron-3-Nano's 52 sublayers need 14 bodies:
  (M E M E M * E) x 5, (M E) x 3, M, *, E, (M E) x 4; Qwen3-MoE's (attention, moe) x 48 need 2.
  """
  n = len(mixers)
  best = [(0, 0, None)] * (n + 1)    # best[i]: (bodies, segments, first segment) of mixers[i:]
  for i in range(n - 1, -1, -1):
    rest = best[i + 1]
    options = [((1 + rest[0], 1 + rest[1]), Segment(i, (mixers[i],), 1))]
    for p in range(1, (n - i) // 2 + 1):
      unit = tuple(mixers[i:i + p])
      r = 1
      while i + (r + 1) * p <= n and tuple(mixers[i + r * p:i + (r + 1) * p]) == unit:
        r += 1
        rest = best[i + r * p]
        options.append(((p + rest[0], 1 + rest[1]), Segment(i, unit, r)))
    (bodies, segs), seg = min(options, key=lambda o: o[0])
    best[i] = (bodies, segs, seg)
  out, i = [], 0
  while i < n:
    seg = best[i][2]
    out.append(seg)
    i = seg.stop
  return tuple(out)


KINDS = ('mamba', 'moe', 'attention', 'mlp')


LAYOUTS = ('fold', 'segments')


def folds(mixers: tuple[str, ...], layout: str | None = None) -> bool:
  """Whether `mixers` is kept as a `Fold` (one body per kind of sublayer) rather than as
  `plan`'s segments: where the kinds present are fewer than the segments' bodies
  (Nemotron-3-Nano: 3 against 14; Qwen3-MoE's (attention, moe) x 48 keeps its 2).
  `layout` 'fold' or 'segments' chooses instead, whatever the pattern (for comparing the two
  layouts of one pattern: `Transformer(layout=)`, benchmarks/hybrid_compile.py)."""
  if layout is None:
    return _folds(tuple(mixers))
  if layout not in LAYOUTS:
    raise ValueError(f'layout={layout!r}: expected one of {LAYOUTS} (or None: by the pattern)')
  return layout == 'fold'


def is_folded(blocks: Sequence) -> bool:
  """Whether built `blocks` (`build`) are one Fold."""
  return len(blocks) == 1 and isinstance(blocks[0], Fold)


@functools.lru_cache(maxsize=64)
def _folds(mixers: tuple[str, ...]) -> bool:
  return len(set(mixers)) < sum(len(s.unit) for s in plan(mixers))


@functools.lru_cache(maxsize=64)
def fold_steps(mixers: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...],
                                                   tuple[int, ...]]:
  """(the kinds present in `KINDS` order, each sublayer's kind as an index into them, each
  sublayer's index within its kind's stack): what a folded scan steps over."""
  kinds = tuple(k for k in KINDS if k in mixers)
  within = tuple(mixers[:i].count(m) for i, m in enumerate(mixers))
  return kinds, tuple(kinds.index(m) for m in mixers), within


class Fold(nnx.Module):
  """The whole pattern as one stack per kind: attribute `kind` (of `KINDS`; None where the
  pattern has none) is one Sublayer holding the parameters of every sublayer of that kind,
  in pattern order, stacked on a leading 'layers' axis [count of that kind, ...]."""

  def __init__(self, sublayers: Sequence[Sublayer], mixers: Sequence[str]):
    for kind in KINDS:
      subs = [s for s, m in zip(sublayers, mixers) if m == kind]
      setattr(self, kind, _stack(subs) if subs else None)


class Repeat(nnx.Module):
  """A segment's repeated unit: `unit[p]` is one Sublayer whose parameters are those of the
  segment's sublayers at position p of every repeat, stacked on a leading 'layers' axis."""

  def __init__(self, sublayers: Sequence[Sublayer], unit_len: int):
    repeats = len(sublayers) // unit_len
    self.repeats = repeats
    self.unit = nnx.List([_stack([sublayers[r * unit_len + p] for r in range(repeats)])
                          for p in range(unit_len)])


def _stack(sublayers: Sequence[Sublayer]) -> Sublayer:
  """One Sublayer holding `sublayers`' parameters stacked on a leading 'layers' axis."""
  def stack(*vs):
    axes = ('layers',) + tuple(vs[0].get_metadata().get('logical_axes') or
                               (None,) * vs[0].get_value().ndim)
    return vs[0].replace(jnp.stack([v.get_value() for v in vs]), logical_axes=axes)
  states = [nnx.state(s) for s in sublayers]
  stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(nnx.graphdef(sublayers[0]), stacked)


def build(cfg: config_lib.ModelConfig, rngs: nnx.Rngs, layout: str | None = None) -> nnx.List:
  """The blocks: one `Fold` where `folds(cfg.mixers, layout)`, else those of `plan(cfg.mixers)`: a
  Sublayer per single-sublayer segment, a Repeat per repeated one. The sublayers are made one
  after another in pattern order first, so sublayer i has exactly the values (and the RNG
  draws) it would have as the i-th of a plain list."""
  subs = [Sublayer(cfg, kind, rngs) for kind in cfg.mixers]
  if folds(cfg.mixers, layout):
    return nnx.List([Fold(subs, cfg.mixers)])
  return nnx.List([subs[s.start] if s.repeats == 1 else Repeat(subs[s.start:s.stop], len(s.unit))
                   for s in plan(cfg.mixers)])


def locate(cfg: config_lib.ModelConfig, i: int,
           layout: str | None = None) -> tuple[tuple, int | None]:
  """Where sublayer i's parameters live in `Transformer.blocks` (built with `layout`): (path
  of its Sublayer, relative to the model, and the index along the stacked 'layers' axis, None
  if unstacked)."""
  if not 0 <= i < len(cfg.mixers):
    raise IndexError(f'sublayer {i}: the pattern has {len(cfg.mixers)}')
  if folds(cfg.mixers, layout):
    return ('blocks', 0, cfg.mixers[i]), fold_steps(cfg.mixers)[2][i]
  for j, s in enumerate(plan(cfg.mixers)):
    if s.start <= i < s.stop:
      if s.repeats == 1:
        return ('blocks', j), None
      r, p = divmod(i - s.start, len(s.unit))
      return ('blocks', j, 'unit', p), r
  raise IndexError(f'sublayer {i}: the pattern has {len(cfg.mixers)}')


def sublayer(model: nnx.Module, i: int) -> Sublayer:
  """Sublayer i of a mixture-of-experts model (a copy sliced out of its stack if stacked)."""
  path, r = locate(model.cfg, i, 'fold' if is_folded(model.blocks) else 'segments')
  module = model
  for key in path:
    module = module[key] if isinstance(key, int) else getattr(module, key)
  if r is None:
    return module
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[r], state))


def layer_indices(n: int) -> jax.Array | range:
  """Indices 0 .. n - 1 for slicing n sublayers out of their stack in a Python loop.

  On TPU (and CPU) they are int32 values behind an optimization barrier, which the compiler
  cannot fold: each sublayer then dynamic-slices its parameters (fused into their consumers,
  as in a scan body) in code identical to its siblings', and the TPU compiler, which
  deduplicates identical code, builds it once. At static indices every sublayer's code
  differs by its slice's offset and is built anew: Cascade 2's 52-sublayer prefill spent most
  of its compile time building 23 copies of each Mamba and MoE sublayer's code. On GPU a
  Python range (static slices), where a dynamic slice of a dot's operand may be copied out."""
  if sharding.mesh_platform() == 'gpu':
    return range(n)
  return jax.lax.optimization_barrier(jnp.arange(n, dtype=jnp.int32))


def _take(tree: Any, i) -> Any:
  """Every leaf's entry i along its leading axis (i from `layer_indices`)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                      if isinstance(i, jax.Array) else a[i], tree)


# A rematerialised Fold's backward pass is `_accumulating_scan`'s unless `run` is told
# `accumulate=False` (`Transformer.accumulate_fold_backward`; tests compare the two).
# Autodiff's backward of the folded scan adds each step's parameter gradient to its kind's
# whole stack-shaped accumulator as a zero stack with the step's slice written in, which XLA
# builds out of place: Cascade 2's train step held the accumulator, the written zero stack and
# their sum, and read and wrote every stack on every step. Planned with autodiff's and with
# this backward (launch.plan): the SFT train step on a v5p-128 slice 81.22 and 42.68 GiB per
# chip, the code RL step 65.04 and 33.73 GiB (TPU compiler); on one H200 118.89 and 99.60 GiB
# (XLA:GPU).


def _accumulating_scan(fns, params, x, js, ns):
  """`lax.scan` over the pattern, step i running fns[js[i]](its kind's sublayer ns[i], x, ns[i])
  -> (x, report), whose backward pass recomputes each step from its input (as the 'full'
  rematerialisation does; the forward keeps only the steps' inputs) and adds the step's
  parameter gradient into its kind's stack-shaped accumulator in place (a dynamic update of
  the step's slice, carried through the backward scan). Returns (x, the reports stacked)."""
  kinds = len(fns)

  def take(j, params, n):
    return _take(params[j], n)

  def forward(params, x):
    def body(x, jn):
      j, n = jn
      y, report = jax.lax.switch(j, [lambda p, x, n, j=j: fns[j](take(j, p, n), x, n)
                                     for j in range(kinds)], params, x, n)
      return y, (report, x)
    y, (report, inputs) = jax.lax.scan(body, x, (js, ns))
    return (y, report), inputs

  @jax.custom_vjp
  def scan(params, x):
    return forward(params, x)[0]

  def scan_fwd(params, x):
    out, inputs = forward(params, x)
    return out, (params, inputs)

  def scan_bwd(res, ct):
    params, inputs = res
    dy, dreport = ct
    grads = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)),
                         params)

    def branch(j):
      def g(params, grads, x, dy, dreport, n):
        p = take(j, params, n)
        _, vjp = jax.vjp(lambda p, x: fns[j](p, x, n), p, x)
        dp, dx = vjp((dy, dreport))
        mine = jax.tree.map(
            lambda acc, d: jax.lax.dynamic_update_index_in_dim(
                acc, jax.lax.dynamic_index_in_dim(acc, n, keepdims=True)
                + d.astype(acc.dtype)[None], n, 0), grads[j], dp)
        return dx, grads[:j] + (mine,) + grads[j + 1:]
      return g

    def body(carry, inp):
      dy, grads = carry
      x, j, n, dreport = inp
      dx, grads = jax.lax.switch(j, [branch(k) for k in range(kinds)], params, grads, x, dy,
                                 dreport, n)
      return (dx, grads), None

    # Integer reports (the experts chosen) have float0 cotangents, which are made per step
    # rather than scanned over.
    leaves, treedef = jax.tree.flatten(dreport)
    zero = [l.dtype == jax.dtypes.float0 for l in leaves]
    scanned = [l for l, z in zip(leaves, zero) if not z]

    def step_report(scanned):
      it = iter(scanned)
      return jax.tree.unflatten(treedef, [np.zeros(l.shape[1:], jax.dtypes.float0) if z
                                          else next(it) for l, z in zip(leaves, zero)])

    (dx, grads), _ = jax.lax.scan(lambda c, i: body(c, i[:3] + (step_report(i[3]),)),
                                  (dy, grads), (inputs, js, ns, scanned), reverse=True)
    grads = jax.tree.map(lambda g, a: g.astype(a.dtype), grads, params)
    return grads, dx

  scan.defvjp(scan_fwd, scan_bwd)
  return scan(params, x)


def _same_reports(fns: list[Callable], kinds: tuple[str, ...],
                  example: Callable[[int], tuple]) -> list[Callable]:
  """One function per kind (each -> (out, a MoE report or None)), wrapped so that every one
  returns a report of the 'moe' kind's shape, zeros where its kind has none, as the branches
  of a `lax.switch` must; `example(m)`: arguments to trace the 'moe' function (index m) with."""
  if 'moe' not in kinds:
    return list(fns)
  m = kinds.index('moe')
  shape = jax.eval_shape(fns[m], *example(m))[1]

  def wrap(j):
    def g(*args):
      out, report = fns[j](*args)
      if j != m:
        report = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
      return out, report
    return g
  return [wrap(j) for j in range(len(fns))]


class _Pass(NamedTuple):
  """What every sublayer of one `run` call sees (`run`'s arguments)."""
  positions: Any
  mask: Any
  segment_ids: Any
  replay: bool
  remat: Callable | None
  has_kv: bool          # attention buffers of a prefill / decode (kv), written from kv_index
  kv_index: Any
  paged: Any            # the PagedCache of a paged decode step, or None
  cached: bool          # a call with a cache: no rematerialisation, caches updated in place
  rules: sharding.Rules  # the logical rules the call traces with


class _Caches:
  """One call's caches by kind and index within the kind: the attention sublayers' key and
  value buffers (or pools) and the Mamba sublayers' states. `run` hands each sublayer its own
  (`own`) and keeps what it wrote (`put`)."""

  def __init__(self, kv, paged, states):
    self.attention = kv is not None or paged is not None
    self.ks = list(kv[0]) if kv is not None else list(paged.k) if paged is not None else []
    self.vs = list(kv[1]) if kv is not None else list(paged.v) if paged is not None else []
    self.states = list(states) if states is not None else None

  def own(self, kind: str, n: int):
    """The n-th `kind` sublayer's cache: an attention's (k, v), a Mamba mixer's state; None
    otherwise."""
    if kind == 'attention' and self.attention:
      return self.ks[n], self.vs[n]
    if kind == 'mamba' and self.states is not None:
      return self.states[n]
    return None

  def put(self, kind: str, n: int, mine) -> None:
    if kind == 'attention' and mine is not None:
      self.ks[n], self.vs[n] = mine
    elif kind == 'mamba' and self.states is not None:
      self.states[n] = mine


def _stack_trees(*trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _flat_reports(report):
  """[reps, moe per unit, ...] -> [reps * moe per unit, ...], in pattern order."""
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), report)


def _moe_route(routing, kind: str, n):
  """The n-th 'moe' sublayer's replayed routing inside a folded scan (n traced), or None."""
  if routing is None or kind != 'moe':
    return None
  return jax.lax.dynamic_index_in_dim(routing, n, keepdims=False)


def _part(ctx: _Pass, kind: str, mine):
  """A sublayer's cache argument from its own cache."""
  if kind == 'attention' and mine is not None:
    k, v = mine
    return (k, v, None, ctx.kv_index) if ctx.has_kv else layers._PagedStep(k, v, None, ctx.paged)
  return mine


def _sublayer_body(ctx: _Pass, graphdef, params, x, route):
  """A sublayer without a cache, from its graphdef and parameters: (y, report)."""
  y, _, report = nnx.merge(graphdef, params)(x, ctx.positions, ctx.mask, ctx.segment_ids, None,
                                             route, ctx.replay, rules=ctx.rules)
  return y, report


def _call(ctx: _Pass, block, x, kind: str, mine, route, prevent_cse: bool):
  """One sublayer, rematerialised in the backward pass where asked; (x, own cache, report)."""
  if ctx.remat is None or ctx.cached:
    x, mine, report = block(x, ctx.positions, ctx.mask, ctx.segment_ids, _part(ctx, kind, mine),
                            route, ctx.replay, rules=ctx.rules)
    return x, (tuple(mine) if kind == 'attention' and mine is not None else mine), report
  graphdef, params = nnx.split(block)
  body = functools.partial(_sublayer_body, ctx, graphdef)
  y, report = ctx.remat(body, prevent_cse)(params, x, route)
  return y, None, report


# --- A Fold: the pattern with one stack per kind of sublayer.

def _fold_parts(blocks, cfg: config_lib.ModelConfig):
  """What a folded scan steps over: (the kinds, each kind's (graphdef, stacked state), the
  states alone, each step's kind index, each step's index within its kind)."""
  kinds, kind_of, within = fold_steps(cfg.mixers)
  stacks = tuple(nnx.split(getattr(blocks[0], kind)) for kind in kinds)
  return (kinds, stacks, tuple(state for _, state in stacks),
          jnp.asarray(kind_of, jnp.int32), jnp.asarray(within, jnp.int32))


def _moe_rows(cfg: config_lib.ModelConfig, report):
  """A folded scan's per-step reports (one per sublayer) cut to its 'moe' steps."""
  if report is None:
    return None
  steps = [i for i, m in enumerate(cfg.mixers) if m == 'moe']
  return jax.tree.map(lambda a: a[jnp.asarray(steps)], report)


def _fold_branch(ctx: _Pass, kind: str, graphdef, routing, params, x, n):
  """A folded scan's branch for `kind`: its sublayer n (`params` already sliced) -> (y,
  report)."""
  return _sublayer_body(ctx, graphdef, params, x, _moe_route(routing, kind, n))


def _on_own_slice(fn, j: int, params, x, n):
  """Branch j with its kind's sublayer n indexed out of that kind's stack inside the branch,
  so a step reads no other kind's parameters."""
  return fn(_take(params[j], n), x, n)


def _fold_step(branches, params, x, j, n):
  return jax.lax.switch(j, branches, params, x, n)


def _folded_scan(ctx: _Pass, blocks, cfg, x, routing, accumulate: bool):
  """Train scan: x through a Fold as one `lax.scan` over the pattern whose body switches on
  the step's kind; (x, the 'moe' steps' reports stacked in pattern order, or None)."""
  kinds, stacks, params, js, ns = _fold_parts(blocks, cfg)
  on_slice = _same_reports(
      [functools.partial(_fold_branch, ctx, kinds[j], stacks[j][0], routing)
       for j in range(len(kinds))], kinds,
      lambda m: (_take(stacks[m][1], 0), x, jnp.zeros((), jnp.int32)))
  if ctx.remat is not None and accumulate:
    x, report = _accumulating_scan(on_slice, params, x, js, ns)
    return x, _moe_rows(cfg, report)
  # The rematerialisation wraps the whole step (the switch inside it): its residuals are then
  # its inputs, i.e. the step's x and indices, and the stacks, which are the scan's loop
  # invariants and kept once. Around each branch instead, the switch would hand the branch's
  # inputs (its whole stack) out as residuals on every step, stacked by the scan.
  step = functools.partial(_fold_step, [functools.partial(_on_own_slice, on_slice[j], j)
                                        for j in range(len(kinds))])
  if ctx.remat is not None:
    step = ctx.remat(step, False)
  x, report = jax.lax.scan(lambda x, jn: step(params, x, jn[0], jn[1]), x, (js, ns))
  return x, _moe_rows(cfg, report)


def _cached_fold_branch(ctx: _Pass, kind: str, graphdef, j: int, routing, params, carry, n):
  """A fresh-buffer prefill scan's branch for `kind`: its sublayer n over the carried stacks
  of buffers and states, writing its own slice; ((y, ck, cv, st), report)."""
  x, ck, cv, st = carry
  part = None
  if kind == 'attention' and ck is not None:
    part = (ck, cv, n, ctx.kv_index)         # the stacks, written at this sublayer's slice
  elif kind == 'mamba' and st is not None:
    part = _take(st, n)
  y, mine, report = nnx.merge(graphdef, _take(params[j], n))(
      x, ctx.positions, ctx.mask, ctx.segment_ids, part, _moe_route(routing, kind, n),
      ctx.replay, rules=ctx.rules)
  if kind == 'attention' and ck is not None:
    ck, cv = mine
  elif kind == 'mamba' and st is not None:
    st = jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(
        a, b.astype(a.dtype), n, 0), st, mine)
  return (y, ck, cv, st), report


def _folded_prefill_scan(ctx: _Pass, blocks, cfg, x, caches: _Caches, routing):
  """Fresh-buffer prefill scan: x through a Fold with a cache of exactly this call's tokens,
  as one `lax.scan` over the pattern, the attention buffers and Mamba states stacked per kind
  in the carry, each step updating its own slice in place; (x, the 'moe' reports as
  `_folded_scan`'s). `caches` gets the written buffers and states."""
  kinds, stacks, params, js, ns = _fold_parts(blocks, cfg)
  cache_axes = ('layers', 'batch', 'kv_heads', 'cache_length', 'head_dim')
  ks, vs, states = caches.ks, caches.vs, caches.states
  ck = sharding.constrain(jnp.stack(ks), cache_axes, ctx.rules) if ks else None
  cv = sharding.constrain(jnp.stack(vs), cache_axes, ctx.rules) if vs else None
  st = _stack_trees(*states) if states else None
  fns = _same_reports([functools.partial(_cached_fold_branch, ctx, kinds[j], stacks[j][0], j,
                                         routing) for j in range(len(kinds))], kinds,
                      lambda m: (params, (x, ck, cv, st), jnp.zeros((), jnp.int32)))
  (x, ck, cv, st), report = jax.lax.scan(
      lambda carry, jn: jax.lax.switch(jn[0], fns, params, carry, jn[1]), (x, ck, cv, st),
      (js, ns))
  for n in range(len(ks)):
    caches.put('attention', n, (ck[n], cv[n]))
  for n in range(len(states or ())):
    caches.put('mamba', n, jax.tree.map(lambda a, n=n: a[n], st))
  return x, _moe_rows(cfg, report)


def _folded_loop(ctx: _Pass, blocks, cfg, x, caches: _Caches, routing):
  """Cached decode loop (and `scan_layers=False`): one sublayer at a time, each sliced out of
  its kind's stack (`layer_indices`; with a cache, each updating its own buffers, pools or
  state in place); (x, per-'moe'-sublayer reports)."""
  index = layer_indices(max(cfg.mixers.count(kind) for kind in KINDS))
  reports = []
  for kind, n in zip(cfg.mixers, fold_steps(cfg.mixers)[2]):
    graphdef, state = nnx.split(getattr(blocks[0], kind))
    x, mine, report = _call(ctx, nnx.merge(graphdef, _take(state, index[n])), x, kind,
                            caches.own(kind, n),
                            None if routing is None or kind != 'moe' else routing[n], True)
    caches.put(kind, n, mine)
    if report is not None:
      reports.append(jax.tree.map(lambda a: a[None], report))
  return x, reports


def _run_fold(ctx: _Pass, blocks, cfg, x, caches: _Caches, routing, scan: bool,
              accumulate: bool, whole_call: bool):
  """x through a Fold in the mode the call asks for; (x, reports)."""
  if scan and not ctx.cached:
    x, report = _folded_scan(ctx, blocks, cfg, x, routing, accumulate)
  elif scan and whole_call:
    x, report = _folded_prefill_scan(ctx, blocks, cfg, x, caches, routing)
  else:
    return _folded_loop(ctx, blocks, cfg, x, caches, routing)
  return x, ([] if report is None else [report])


# --- `plan`'s segments: single sublayers and Repeats of a unit.

def _segment_offsets(unit: tuple[str, ...], reps: int, counts: dict[str, int]):
  """(first, per, counts after): the n-th sublayer of a kind at repeat r, position p of the
  unit is first[p] + r * per[kind]; `counts` are the sublayers of each kind before it."""
  per = {k: unit.count(k) for k in counts}
  first = [counts[kind] + unit[:p].count(kind) for p, kind in enumerate(unit)]
  return first, per, {k: counts[k] + per[k] * reps for k in counts}


def _repeat_cached_loop(ctx: _Pass, block, unit, reps, first, per, x, caches: _Caches, route):
  """Cached decode loop over a Repeat: a Python loop over the repeats, each sublayer reading
  and writing its own buffers, pools or state in place (a scan would stack a segment's caches
  for its carry and split them after: a copy of those KV pools / states on every call, i.e.
  every decode step); (x, the segment's reports or None)."""
  split = [nnx.split(sub) for sub in block.unit]
  ys = []
  index = layer_indices(reps)
  for r in range(reps):
    outs = []
    for p, (graphdef, state) in enumerate(split):
      kind = unit[p]
      n = first[p] + r * per[kind]     # its own kind's count, not the last sublayer's
      r_moe = None if route is None or kind != 'moe' else route[r, unit[:p].count('moe')]
      x, mine, report = _call(ctx, nnx.merge(graphdef, _take(state, index[r])), x, kind,
                              caches.own(kind, n), r_moe, True)
      caches.put(kind, n, mine)
      if report is not None:
        outs.append(report)
    ys.append(_stack_trees(*outs) if outs else None)
  return x, (None if ys[0] is None else _flat_reports(_stack_trees(*ys)))


def _repeat_body(ctx: _Pass, split, unit, prevent_cse: bool, x, xs):
  """One repeat of a Repeat's unit without a cache: (x, its reports stacked or None)."""
  params, route = xs
  outs = []
  for p, (graphdef, _) in enumerate(split):
    kind = unit[p]
    r_moe = None if route is None or kind != 'moe' else route[unit[:p].count('moe')]
    x, _, report = _call(ctx, nnx.merge(graphdef, params[p]), x, kind, None, r_moe,
                         prevent_cse)
    if report is not None:
      outs.append(report)
  return x, (_stack_trees(*outs) if outs else None)


def _repeat_train(ctx: _Pass, block, unit, reps, x, route, scan: bool):
  """Train scan over a Repeat (one `lax.scan` over its repeats, each sublayer rematerialised
  on its own), or with `scan` False a Python loop over the same stacks; (x, reports or
  None)."""
  split = [nnx.split(sub) for sub in block.unit]
  body = functools.partial(_repeat_body, ctx, split, unit, not scan)
  xs = ([state for _, state in split], route)
  if scan:
    x, report = jax.lax.scan(body, x, xs)
  else:
    ys = []
    index = layer_indices(reps)
    for r in range(reps):
      x, y = body(x, _take(xs, index[r]))
      ys.append(y)
    report = _stack_trees(*ys)
  return x, (None if report is None else _flat_reports(report))


def _run_segments(ctx: _Pass, blocks, cfg, x, caches: _Caches, routing, scan: bool):
  """x through `plan`'s segments; (x, reports in pattern order)."""
  counts = {'attention': 0, 'mamba': 0, 'mlp': 0, 'moe': 0}
  reports = []
  for seg, block in zip(plan(cfg.mixers), blocks):
    unit, reps = seg.unit, seg.repeats
    first, per, after = _segment_offsets(unit, reps, counts)
    route = None
    if routing is not None and per['moe']:
      e0 = first[unit.index('moe')]
      route = routing[e0:e0 + per['moe'] * reps]
    counts = after
    if reps == 1:
      x, mine, report = _call(ctx, block, x, unit[0], caches.own(unit[0], first[0]),
                              None if route is None else route[0], True)
      caches.put(unit[0], first[0], mine)
      report = None if report is None else jax.tree.map(lambda a: a[None], report)
    else:
      if route is not None:   # [reps * moe per unit, ...] -> [reps, moe per unit, ...]
        route = route.reshape((reps, per['moe']) + route.shape[1:])
      if ctx.cached:
        x, report = _repeat_cached_loop(ctx, block, unit, reps, first, per, x, caches, route)
      else:
        x, report = _repeat_train(ctx, block, unit, reps, x, route, scan)
    if report is not None:
      reports.append(report)
  return x, reports


# --- The dense families' stack: the pattern ('attention', 'mlp') x L as one stacked Block.

def _layer_loop(cfg: config_lib.ModelConfig, body, carry, xs):
  """`body` over the L layers: one `lax.scan`, or a Python loop (`cfg.scans_layers`)."""
  if cfg.scans_layers:
    carry, _ = jax.lax.scan(body, carry, xs)
  else:
    for i in range(cfg.num_layers):
      carry, _ = body(carry, jax.tree.map(lambda a, i=i: a[i], xs))
  return carry


def _block_train_body(graphdef, positions, mask, rules, x, layer_params):
  """One layer without a cache; its input named 'block_input' (the 'offload' policy's)."""
  x = ad_checkpoint.checkpoint_name(x, 'block_input')
  return nnx.merge(graphdef, layer_params)(x, positions, mask, rules=rules)[0], None


def _blocks_train(block: Block, cfg, x, positions, mask, remat: Callable | None, rules):
  """Train scan: x through the L layers with no cache, each layer rematerialised as one
  block in the backward pass (`remat`); x."""
  graphdef, params = nnx.split(block)
  body = functools.partial(_block_train_body, graphdef, positions, mask, rules)
  if remat is not None:
    body = remat(body, not cfg.scans_layers)   # a scan's body cannot be CSE'd anyway
  return _layer_loop(cfg, body, x, params)


def _block_cached_body(graphdef, positions, mask, index, rules, carry, layer_xs):
  """Layer i writes its T new slots into the stacked caches in place and reads its slice."""
  x, k_all, v_all = carry
  layer_params, i = layer_xs
  x, (k_all, v_all) = nnx.merge(graphdef, layer_params)(x, positions, mask,
                                                        (k_all, v_all, i, index), rules=rules)
  return (x, k_all, v_all), None


def _block_paged_body(graphdef, positions, paged, rules, carry, layer_xs):
  """Layer i of a paged decode step over the stacked page pools (`positions`: [S])."""
  x, k_all, v_all = carry
  layer_params, i = layer_xs
  x, (k_all, v_all) = nnx.merge(graphdef, layer_params)(
      x, positions[:, None], None, layers._PagedStep(k_all, v_all, i, paged), rules=rules)
  return (x, k_all, v_all), None


def _blocks_cached(block: Block, cfg, x, positions, mask, k, v, rules, index=None, paged=None):
  """Cached scan: x through the L layers over the stacked [L, ...] caches (a prefill or
  decode's buffers written from `index`, or a paged step's pools, `positions` then [S]),
  carried and updated in place; (x, k, v)."""
  graphdef, params = nnx.split(block)
  if paged is None:
    body = functools.partial(_block_cached_body, graphdef, positions, mask, index, rules)
  else:
    body = functools.partial(_block_paged_body, graphdef, positions, paged, rules)
  return _layer_loop(cfg, body, (x, k, v),
                     (params, jnp.arange(cfg.num_layers, dtype=jnp.int32)))


def _blocks_unrolled(block: Block, layer_states, x, positions, mask, ks, vs, rules, index=None,
                     paged=None):
  """Cached decode loop: x through the layers given one by one (`layer_states`: their
  parameters sliced out of the stack once, by the caller's loop), each over its own buffers
  or pools (`ks`, `vs`: tuples); (x, ks, vs)."""
  graphdef = nnx.graphdef(block)
  ks, vs = list(ks), list(vs)
  for i, layer_params in enumerate(layer_states):
    part = ((ks[i], vs[i], None, index) if paged is None
            else layers._PagedStep(ks[i], vs[i], None, paged))
    x, (ks[i], vs[i]) = nnx.merge(graphdef, layer_params)(x, positions, mask, part,
                                                          rules=rules)
  return x, tuple(ks), tuple(vs)


def _run_blocks(block: Block, cfg, x, positions, mask, kv, paged, layer_states, remat, rules):
  """x through the dense stack in the mode the call asks for; `run`'s return value."""
  if layer_states is not None:
    if paged is not None:
      if not isinstance(paged.k, tuple):
        raise ValueError('layers= needs the pools split per layer (split_layers)')
      x, ks, vs = _blocks_unrolled(block, layer_states, x, positions[:, None], mask, paged.k,
                                   paged.v, rules, paged=paged)
    else:
      if kv is None or not isinstance(kv[0], tuple):
        raise ValueError('layers= needs a cache in the unstack_cache layout')
      x, ks, vs = _blocks_unrolled(block, layer_states, x, positions, mask, kv[0], kv[1],
                                   rules, index=kv[2])
  elif paged is not None:
    x, ks, vs = _blocks_cached(block, cfg, x, positions, mask, paged.k, paged.v, rules,
                               paged=paged)
  elif kv is not None:
    x, ks, vs = _blocks_cached(block, cfg, x, positions, mask, kv[0], kv[1], rules,
                               index=kv[2])
  else:
    return _blocks_train(block, cfg, x, positions, mask, remat, rules), (), (), None, None
  return x, ks, vs, None, None


def _stats(reports, routing, segment_ids, moe_sublayers: int) -> MoEStats | None:
  """The call's MoEStats from its reports in pattern order (None without 'moe' sublayers)."""
  if not reports:
    return None
  cat = lambda name: jnp.concatenate([getattr(r, name) for r in reports])
  stats = MoEStats(indices=cat('indices'), aux_loss=jnp.mean(cat('aux_loss')),
                   z_loss=jnp.mean(cat('z_loss')))
  if routing is not None:
    real = jnp.sum((segment_ids > 0).astype(jnp.float32))
    stats = stats._replace(mismatched=jnp.sum(cat('mismatched')),
                           compared=moe_sublayers * real,
                           token_differs=jnp.any(cat('differs'), axis=0))
  return stats


def run(blocks: Sequence[Sublayer | Repeat] | Block, cfg: config_lib.ModelConfig, x, positions,
        mask, segment_ids, *, kv=None, states=None, paged=None, routing=None, replay=True,
        remat: Callable | None = None, scan: bool | None = None, accumulate: bool = True,
        layer_states=None, rules: sharding.Rules = sharding.DEFAULT_RULES):
  """x through every sublayer.

  Args:
    blocks: the blocks (`build`): `plan`'s segments, or one Fold; or, for the dense
      families, their one stacked `Block` (the pattern ('attention', 'mlp') x L), whose
      caches are stacked [L, ...] (or tuples of one per layer with `layer_states`).
    cfg: the model config.
    x: [B, T, D] embedded tokens.
    positions, mask: as attention takes them; for a paged step [S] (each slot's one
      token's) and None.
    segment_ids: [B, T] int32 (None for a paged step: its slots' `live` flags).
    kv: None, or (ks, vs, index): a tuple of [B, K, S, H] buffers per attention sublayer
      and the slot the new tokens are written from.
    states: None, or a tuple of MambaState per Mamba sublayer (carried and returned).
    paged: a PagedCache whose k/v are tuples of per-attention-sublayer pools (a paged
      decode step; then `states` holds the slots' Mamba states).
    routing: None, or [M, B, T, k] int experts per 'moe' sublayer (routing replay).
    replay: with `routing`: replay it (True), or route on the routers' own choice and only
      count where it differs (`MoEStats.mismatched`).
    remat: `remat(body, prevent_cse)` wraps a sublayer's function for the backward pass (no
      cache only).
    scan: run each repeated segment as one `lax.scan` over its repeats, a Fold as one scan
      over the pattern (default `cfg.scans_layers`), else as a Python loop over the same
      stacked parameters.
    accumulate: a rematerialised Fold's backward pass is `_accumulating_scan`'s (True) or
      autodiff's (False).
    layer_states: the dense stack only: its layers' parameters sliced out of the stack
      (`Transformer.layer_states`), run as an unrolled loop over per-layer caches.
    rules: the logical rules every sublayer traces with (`Transformer.rules`).

  With a cache (`kv`, `states` or `paged`) a repeated segment is always a Python loop over
  its repeats, so each sublayer's buffers, pools and state are updated in place (a scan
  would copy the segment's caches into and out of its stacked carry on every call). A Fold
  whose buffers hold exactly this call's tokens (a prefill into fresh buffers) is the
  exception: one scan with the caches stacked per kind (`_folded_prefill_scan`).

  Returns:
    (x, ks, vs, states, MoEStats or None): the written buffers / pools and states
    (tuples; empty without a cache).
  """
  if isinstance(blocks, Block):
    if routing is not None:
      raise ValueError(f'routing= is for the mixture-of-experts families; family='
                       f'{cfg.family!r} has no experts')
    return _run_blocks(blocks, cfg, x, positions, mask, kv, paged, layer_states, remat, rules)
  if paged is not None:
    # A slot that is not live is padding to the Mamba mixers: its state stays as it is.
    segment_ids = paged.live.astype(jnp.int32)[:, None]
    positions = positions[:, None]
  scan = cfg.scans_layers if scan is None else scan
  ctx = _Pass(positions, mask, segment_ids, replay, remat, has_kv=kv is not None,
              kv_index=None if kv is None else kv[2], paged=paged,
              cached=kv is not None or paged is not None or states is not None, rules=rules)
  caches = _Caches(kv, paged, states)
  if is_folded(blocks):
    # A cache that holds exactly this call's tokens (a prefill into fresh buffers, as the paged
    # engine's) is scanned over with its buffers stacked per kind: stacking and unstacking cost
    # a copy of only this call's keys and values, and the compiler builds each kind's code
    # once. Longer buffers (a one-call sampler's, filled over decode steps) and decode steps
    # keep the loop, which updates each sublayer's buffers in place.
    whole_call = (paged is None and x.shape[1] > 1 and
                  (kv is None or all(k.shape[2] == x.shape[1] for k in caches.ks)))
    x, reports = _run_fold(ctx, blocks, cfg, x, caches, routing, scan, accumulate, whole_call)
  else:
    x, reports = _run_segments(ctx, blocks, cfg, x, caches, routing, scan)
  stats = _stats(reports, routing, segment_ids, cfg.mixers.count('moe'))
  return (x, tuple(caches.ks), tuple(caches.vs),
          None if caches.states is None else tuple(caches.states), stats)


def init_kv(cfg: config_lib.ModelConfig, batch: int, length: int, dtype,
            rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[tuple, tuple]:
  """Empty key and value buffers, one [B, K, S, H] per attention sublayer, laid out by
  `rules`."""
  shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
  axes = ('batch', 'kv_heads', 'cache_length', 'head_dim')
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), axes, rules)
  n = cfg.attention_layers
  return tuple(zeros() for _ in range(n)), tuple(zeros() for _ in range(n))


def init_states(cfg: config_lib.ModelConfig, batch: int, dtype=None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple:
  """Zero Mamba states, one per Mamba sublayer, laid out by `rules`."""
  return tuple(mamba.init_state(cfg, batch, dtype, rules) for _ in range(cfg.mamba_layers))


def repeat_rows(tree: Any, group: int) -> Any:
  """Every array of `tree` (per-sublayer buffers or states, batch first) with each row
  repeated `group` times."""
  return jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), tree)


def moe_stats(model: nnx.Module) -> MoEStats | None:
  """Pops the 'moe_stats' intermediates sown by the model's forward passes since the last
  pop: their losses averaged over the passes, their routing mismatch counts summed over those
  that compared (None if none did) and their `token_differs` or-ed (the passes that compared
  must share one [B, T]), indices of the last pass; None if none."""
  found = nnx.pop(model, nnx.Intermediate)
  sown = []
  for path, var in nnx.to_flat_state(found):
    if path and path[-1] == 'moe_stats':
      value = var.get_value() if hasattr(var, 'get_value') else var.value
      sown.extend(value if isinstance(value, tuple) and value and
                  isinstance(value[0], MoEStats) else [value])
  if not sown:
    return None
  compared = [s for s in sown if s.mismatched is not None]
  shapes = {s.token_differs.shape for s in compared}
  if len(shapes) > 1:
    raise ValueError(f'moe_stats: the forward passes that compared routing ran over tokens of '
                     f'different shapes {sorted(shapes)}; their token_differs cannot be or-ed')
  token_differs = (functools.reduce(jnp.logical_or, [s.token_differs for s in compared])
                   if compared else None)
  return MoEStats(indices=sown[-1].indices,
                  aux_loss=jnp.mean(jnp.stack([s.aux_loss for s in sown])),
                  z_loss=jnp.mean(jnp.stack([s.z_loss for s in sown])),
                  mismatched=sum(s.mismatched for s in compared) if compared else None,
                  compared=sum(s.compared for s in compared) if compared else None,
                  token_differs=token_differs)
