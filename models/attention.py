"""Causal, segment-masked, grouped-query attention behind one switch.

Shape letters as in models/transformer.py: B batch, T query length, S key
length, N query heads, K kv heads, G = N // K, H head_dim.

  out = attend(q, k, v, mask, impl='auto')   # q [B,T,N,H]; k, v [B,K,S,H]

What a query may see is described by a `MaskInfo`, never by a [B, T, S] array:
query i of row b sees key slot j iff

  q_offset + i >= j  and  q_seg[b, i] == kv_seg[b, j]  and  kv_seg[b, j] != 0

(`q_offset` None means self-attention: the keys are the queries' own tokens).
Internally the causal rule compares token indices, `q_index[i] >= kv_index[j]`
(q_offset + i and j above), so a context-parallel shard, whose queries and
gathered keys sit in zig-zag order (`models.context`), uses the same tiles.
Segment id 0 is padding, which nothing attends to. A query whose row sees
nothing (a padding query) gets an output that depends on the backend; nothing
downstream of a real token reads it.

Implementations (`ModelConfig.attention`):
  'dense'      the [B, K, G, T, S] float32 logits of the reference math; the
               cached decode step (T = 1) always uses it.
  'blockwise'  pure XLA: a loop over query tiles, each a `lax.scan` over key
               tiles with an online softmax, and a custom VJP that rescans
               them, so neither pass holds more than [block_q, block_kv]
               scores per head; tiles wholly above the causal diagonal are
               skipped. Reproduces 'dense' on every real query up to float
               rounding. Runs anywhere, including the simulated-device
               planning path.
  'splash'     TPU splash attention (Pallas), vmapped over rows, inside a
               `shard_map` over the mesh's batch and head axes; interpreted
               off TPU (slow: tests only).
  'gpu_flash'  the Pallas GPU (Triton) flash kernel `mha` with segment ids,
               grouped-query native: run per group member over the K kv heads
               in place (`_gpu_flash`), never a copy of K/V repeated to N
               heads; interpreted off GPU. cuDNN's `dot_product_attention`
               is not used: it expresses padding only as right-padded lengths,
               not the segment ids of packed rows.
  'auto'       tpu -> 'splash', gpu -> 'gpu_flash', otherwise 'dense' below
               `DENSE_MAX_LEN` keys and 'blockwise' from there on (short CPU
               programs keep today's exact numerics).

The two kernels need self-attention (no cache): a prefill into a cache with
T > 1 uses 'blockwise' instead of them (its query offset is a traced value).

Context parallelism: self-attention on a mesh whose 'length' rule splits T
(`context.shards`) runs per shard in a `shard_map`: each shard's queries (its
two zig-zag chunks) against keys and values all-gathered over the sequence
axis, with 'dense' or 'blockwise' on the shard; 'splash' and 'gpu_flash' run
'blockwise' there too (their masks are static per kernel, a shard's zig-zag
token indices are not).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import config as config_lib
from models import context
from models import sharding

IMPLS = config_lib.ATTENTION_IMPLS
_KERNELS = ('splash', 'gpu_flash')

# 'auto' off TPU/GPU: below this many keys the dense [T, S] logits are small
# and keep the numerics every tiny config had before the switch existed.
DENSE_MAX_LEN = 1024

# Logit of a masked (query, key) pair. Finite, as in the reference math: a
# query that sees nothing averages every key instead of producing NaN.
_NEG_INF = -1e30

# The GPU kernel's own tile sizes (Triton shared memory), not the config's.
_GPU_BLOCK = 128


class MaskInfo(NamedTuple):
  """Which keys each query sees; a pytree.

  Attributes:
    q_segment_ids: [B, T] int32; 0 = padding.
    kv_segment_ids: [B, S] int32; 0 = padding or an empty cache slot.
    q_offset: [] int32 key slot of query 0 (the cache index), or None for
      self-attention (S == T, keys are the queries' own tokens).
  """
  q_segment_ids: jax.Array
  kv_segment_ids: jax.Array
  q_offset: jax.Array | None = None


def resolve(impl: str, q_len: int, kv_len: int, *, self_attention: bool,
            platform: str | None = None) -> str:
  """The implementation `attend` runs for these static shapes.

  Args:
    impl: one of IMPLS.
    q_len, kv_len: T and S.
    self_attention: no cache (the keys are the queries' own tokens).
    platform: 'cpu', 'gpu' or 'tpu' (default: jax.default_backend()).

  Returns:
    'dense', 'blockwise', 'splash' or 'gpu_flash'.
  """
  if impl not in IMPLS:
    raise ValueError(f'attention implementation {impl!r}: expected one of {IMPLS}')
  if impl == 'auto':
    platform = jax.default_backend() if platform is None else platform
    impl = {'tpu': 'splash', 'gpu': 'gpu_flash'}.get(
        platform, 'dense' if kv_len < DENSE_MAX_LEN else 'blockwise')
  if q_len == 1:
    return 'dense'
  if impl in _KERNELS and not self_attention:
    return 'blockwise'
  return impl


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: MaskInfo, *,
           impl: str = 'auto', block_q: int = 512, block_kv: int = 512,
           rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.Array:
  """Softmax attention of q over k/v under `mask`, in q's dtype.

  Args:
    q: [B, T, N, H] queries (RoPE applied, not yet scaled).
    k: [B, K, S, H] keys, N % K == 0.
    v: [B, K, S, H] values.
    mask: a MaskInfo.
    impl: one of IMPLS (see `resolve`).
    block_q: query tile of 'splash' and 'blockwise'.
    block_kv: key tile of 'splash' and 'blockwise'.
    rules: the logical rules the caller traces with (how a shard_map splits the arrays).

  Returns:
    [B, T, N, H]; logits and softmax are float32, matmuls in q's dtype.
  """
  b, t, n, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  self_attention = mask.q_offset is None
  if self_attention and s != t:
    raise ValueError(f'self-attention needs as many keys as queries: T={t}, S={s}')
  impl = resolve(impl, t, s, self_attention=self_attention)
  q = q.reshape(b, t, kh, n // kh, h) * (h ** -0.5)                    # [B, T, K, G, H]
  offset = 0 if self_attention else mask.q_offset
  if self_attention and context.shards(t, rules) > 1:
    out = _context_parallel(q, k, v, mask.q_segment_ids, impl, block_q, block_kv, rules)
  elif impl in ('dense', 'blockwise'):
    q_index = jnp.asarray(offset, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    out = _local(impl, q, k, v, mask.q_segment_ids, mask.kv_segment_ids, q_index,
                 jnp.arange(s, dtype=jnp.int32), block_q, block_kv)
  elif impl == 'splash':
    out = _sharded_kernel(functools.partial(_splash, block_q=block_q, block_kv=block_kv),
                          q, k, v, mask.q_segment_ids, rules)
  else:
    out = _sharded_kernel(_gpu_flash, q, k, v, mask.q_segment_ids, rules)
  return out.reshape(b, t, n, h)


def paged_attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 page_table: jax.Array, *, pages_per_compute_block: int = 8,
                 impl: str = 'auto', rules: sharding.Rules = sharding.DEFAULT_RULES
                 ) -> jax.Array:
  """One decode query per slot over that slot's pages of a paged KV cache.

  Slot s sees the first `lengths[s]` tokens of its sequence, token j living in
  page `page_table[s, j // page_size]` at offset `j % page_size`. On TPU devices
  (the ambient mesh's, so planning for a TPU topology from a CPU host counts)
  with the model's attention 'splash' or 'auto' this is the Pallas
  `paged_attention` kernel; elsewhere `_paged_xla`, blocks of
  page-table columns with an online softmax in which each slot reads only the
  blocks its own length reaches (to a power-of-two group of slots): a slot
  near its start does not pay for the longest live slot's pages. Under a mesh
  either runs per shard (`_per_shard`: slots and pool pages over the batch
  axes, heads over `kv_heads`).

  Args:
    q: [S, N, H] queries (RoPE applied, not yet scaled).
    k_pages: [K, P, page_size, H] one layer's key pages (P pages in the pool).
    v_pages: [K, P, page_size, H].
    lengths: [S] int32 tokens each slot sees (>= 1).
    page_table: [S, M] int32 page of each of the slot's first M * page_size tokens.
    pages_per_compute_block: page-table columns per block.
    impl: the model's attention implementation (`ModelConfig.attention`).
    rules: the logical rules the caller traces with.

  Returns:
    [S, N, H] in q's dtype.
  """
  h = q.shape[-1]
  m = page_table.shape[1]
  bp = min(pages_per_compute_block, m)
  q = q * (h ** -0.5)
  # The kernel where `attend` would use splash: on TPU, for 'splash' or 'auto'.
  if sharding.mesh_platform() == 'tpu' and impl in ('splash', 'auto') and m % bp == 0:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel
    dt = q.dtype
    fn = functools.partial(paged_attention_kernel.paged_attention, mask_value=_NEG_INF,
                           pages_per_compute_block=bp)
    return _per_shard(fn, q, k_pages.astype(dt), v_pages.astype(dt), lengths, page_table, rules)
  if jax.default_backend() == 'cpu':
    bp = min(bp, 2)      # XLA:CPU gathers slowly: small blocks measured fastest (S=32, 272 keys)
  return _per_shard(functools.partial(_paged_xla, block_pages=bp), q, k_pages, v_pages,
                    lengths, page_table, rules)


def _per_shard(fn, q, k_pages, v_pages, lengths, page_table, rules):
  """`fn(q, k_pages, v_pages, lengths, page_table)` per shard of the mesh traced for, split
  by `rules`: slots over the batch axes, heads over the kv-head axes, and the pool's pages
  over the batch axes as `models.transformer.PAGE_AXES` lays them out (a slot's pages are on
  its own shard: the table's global page ids become ids in the shard's part); the whole
  arrays without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn(q, k_pages, v_pages, lengths, page_table)
  batch, heads = sharding.logical_to_spec(('batch', 'kv_heads'),
                                          (q.shape[0], k_pages.shape[0]), mesh, rules)
  pages = sharding.logical_to_spec(('kv_heads', 'batch', None, None), k_pages.shape, mesh,
                                   rules)

  def local(q, k_pages, v_pages, lengths, page_table):
    if pages[1] is not None:          # this shard's part of the pool
      part = k_pages.shape[1]
      first = jax.lax.axis_index(pages[1]) * part
      page_table = jnp.clip(page_table - first, 0, part - 1)   # unused columns: any local page
    return fn(q, k_pages, v_pages, lengths, page_table)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(P(batch, heads, None), pages, pages, P(batch), P(batch, None)),
                       out_specs=P(batch, heads, None), check_vma=False)(
                           q, k_pages, v_pages, lengths, page_table)


def _paged_xla(q, k_pages, v_pages, lengths, page_table, *, block_pages: int):
  """`paged_attend` in XLA (q already scaled): slots sorted longest first, then for each group
  size b = S, S/2, ..., 1 a loop over the blocks of `block_pages` page-table columns that more
  than the next group's slots reach, run over the first b slots only. Every slot sees every
  block up to its length, in order, so its result is the one loop over all slots would give;
  the slots past b, which stop before those blocks, are not read."""
  s, n, h = q.shape
  kh, num_pages, ps, _ = k_pages.shape
  m = page_table.shape[1]
  bp, dt = block_pages, q.dtype
  g = n // kh
  order = jnp.argsort(-lengths)                                          # longest first
  q = q[order].reshape(s, kh, g, h)                                      # [S, K, G, H]
  lengths = lengths[order]
  blocks = -(-m // bp)
  table = jnp.pad(page_table[order], ((0, 0), (0, blocks * bp - m))).reshape(s, blocks, bp)
  bs = bp * ps                                                           # tokens per block
  reach = (lengths + bs - 1) // bs                                       # [S] non-increasing

  # Pages as rows of a 2-D [K * P, page_size * H] table: a row gather (one contiguous page of
  # one head per index) runs about twice as fast on XLA:CPU as a gather of [page_size, H]
  # slices, and lands in the [S, K, T, H] layout the dot products want.
  rows = lambda x: x.reshape(kh * num_pages, ps * h)
  k_rows, v_rows = rows(k_pages), rows(v_pages)
  head_base = (jnp.arange(kh, dtype=jnp.int32) * num_pages)[None, :, None]   # [1, K, 1]

  def group(b, end, carry):
    """Blocks j < end over the first b slots (every slot that reaches them)."""
    qb, lb, tb = q[:b], lengths[:b], table[:b]

    def body(c):
      j, mx, l, acc = c
      pages = jax.lax.dynamic_index_in_dim(tb, j, axis=1, keepdims=False)      # [b, bp]
      idx = head_base + pages[:, None, :]                                     # [b, K, bp]
      kb = k_rows[idx].reshape(b, kh, bs, h).astype(dt)                       # [b, K, T, H]
      vb = v_rows[idx].reshape(b, kh, bs, h).astype(dt)
      x = jnp.einsum('SKGH,SKTH->SKGT', qb, kb).astype(jnp.float32)
      seen = (j * bs + jnp.arange(bs, dtype=jnp.int32))[None] < lb[:, None]
      x = jnp.where(seen[:, None, None], x, _NEG_INF)
      mx_b = mx[:b]
      mx_new = jnp.maximum(mx_b, x.max(-1))
      p = jnp.exp(x - mx_new[..., None])
      corr = jnp.exp(mx_b - mx_new)
      pv = jnp.einsum('SKGT,SKTH->SKGH', p.astype(dt), vb, preferred_element_type=jnp.float32)
      return (j + 1, mx.at[:b].set(mx_new), l.at[:b].set(l[:b] * corr + p.sum(-1)),
              acc.at[:b].set(acc[:b] * corr[..., None] + pv))

    return jax.lax.while_loop(lambda c: c[0] < end, body, carry)

  sizes = [s]
  while sizes[-1] > 1:
    sizes.append(sizes[-1] // 2)
  carry = (jnp.zeros((), jnp.int32), jnp.full((s, kh, g), -jnp.inf, jnp.float32),
           jnp.zeros((s, kh, g), jnp.float32), jnp.zeros((s, kh, g, h), jnp.float32))
  for b, nxt in zip(sizes, sizes[1:] + [0]):
    # Group b runs while slot `nxt` (the first the next group leaves out) still reaches block
    # j: the slots past b stopped before it (the previous group ran to slot b's reach).
    carry = group(b, reach[nxt] if nxt else reach[0], carry)
  _, _, l, acc = carry
  out = (acc / l[..., None]).astype(dt).reshape(s, n, h)
  return out[jnp.argsort(order)]


def _local(impl, q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv):
  """'dense' or 'blockwise' on whole arrays: q [B, T, K, G, H] (scaled), k/v [B, K, S, H],
  q_index [T] / kv_index [S] int32 token indices of the causal rule."""
  if impl == 'dense':
    return _dense(q, k, v, q_seg, kv_seg, q_index, kv_index)
  t, s = q.shape[1], k.shape[2]
  return _blockwise(q, k, v, q_seg, kv_seg, q_index, kv_index, min(block_q, t),
                    min(block_kv, s))


def _context_parallel(q, k, v, seg, impl, block_q, block_kv, rules):
  """Self-attention with T split over the sequence axis in zig-zag order (`models.context`).

  Each shard holds its queries' two chunks; the keys, values and their segment ids are
  all-gathered over the axis (the backward reduce-scatters their gradients), and the
  shard attends with the zig-zag token indices of both sides, so causal tiles another
  shard's chunk covers are skipped as on one device.

  Args:
    q: [B, T, K, G, H] scaled queries in zig-zag order; k, v: [B, K, T, H]; seg: [B, T].
    impl: the resolved implementation ('splash' and 'gpu_flash' run 'blockwise').
    rules: the logical rules that split the row over the sequence axis.

  Returns:
    [B, T, K, G, H] in zig-zag order.
  """
  mesh = jax.sharding.get_abstract_mesh()
  b, t, kh = q.shape[:3]
  batch, length, heads = sharding.logical_to_spec(('batch', 'length', 'kv_heads'), (b, t, kh),
                                                  mesh, rules)
  n = context.shards(t, rules)
  impl = impl if impl == 'dense' else 'blockwise'

  def local(q, k, v, seg):
    k, v = (jax.lax.all_gather(x, length, axis=2, tiled=True) for x in (k, v))
    kv_seg = jax.lax.all_gather(seg, length, axis=1, tiled=True)
    q_index = context.zigzag_index(t, n, jax.lax.axis_index(length))
    kv_index = jnp.asarray(context.zigzag_order(t, n))
    return _local(impl, q, k, v, seg, kv_seg, q_index, kv_index, block_q, block_kv)

  q_spec, k_spec = P(batch, length, heads, None, None), P(batch, heads, length, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, k_spec, k_spec, P(batch, length)),
                       out_specs=q_spec, check_vma=False)(q, k, v, seg)


def _dense_mask(q_seg, kv_seg, q_index, kv_index):
  """[B, T, S] bool: the rule of the module docstring."""
  causal = q_index[:, None] >= kv_index[None, :]
  return (causal[None] & (q_seg[:, :, None] == kv_seg[:, None, :])
          & (kv_seg[:, None, :] != 0))


def _dense(q, k, v, q_seg, kv_seg, q_index, kv_index):
  """The reference: q [B, T, K, G, H] (scaled) -> [B, T, K, G, H]."""
  dt = q.dtype
  mask = _dense_mask(q_seg, kv_seg, q_index, kv_index)
  logits = jnp.einsum('BTKGH,BKSH->BKGTS', q, k.astype(dt)).astype(jnp.float32)
  logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(dt)
  return jnp.einsum('BKGTS,BKSH->BTKGH', probs, v.astype(dt))


# ---------------------------------------------------------------- blockwise


def _key_blocks(k, v, kv_seg, kv_index, block):
  """Keys cut into blocks along S (padded with slots that are never seen).

  Returns:
    (k [nb, B, K, block, H], v likewise, kv_seg [nb, B, block], real
    [nb, block] bool: the slot exists, index [nb, block] int32 token index of
    each slot).
  """
  b, kh, s, h = k.shape
  nb = -(-s // block)
  pad = nb * block - s
  if pad:
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)))
    # Slots past S come after every query: they never make a tile look visited.
    kv_index = jnp.pad(kv_index, (0, pad), constant_values=np.iinfo(np.int32).max)
  blocks = lambda x: jnp.moveaxis(x.reshape(b, kh, nb, block, h), 2, 0)
  seg = jnp.moveaxis(kv_seg.reshape(b, nb, block), 1, 0)
  real = (np.arange(nb * block) < s).reshape(nb, block)
  return blocks(k), blocks(v), seg, jnp.asarray(real), kv_index.reshape(nb, block)


def _query_blocks(x, axis, block):
  """x cut into [nq, ...] blocks of `block` along `axis` (zero-padded at the end)."""
  t = x.shape[axis]
  nq = -(-t // block)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, nq * block - t)
  x = jnp.pad(x, pad)
  x = x.reshape(x.shape[:axis] + (nq, block) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _query_unblock(x, axis, t):
  """Inverse of `_query_blocks`: [nq, ..., block at `axis`, ...] -> [..., T, ...]."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, t, axis=axis)


def _block_logits(q, kb, q_seg, seg_b, real_b, kv_index, q_index):
  """Masked float32 logits [B, K, G, Tq, block] of one (query, key) tile, and its mask.

  q [B, Tq, K, G, H] holds the queries of token indices q_index [Tq]; the tile's
  keys have token indices kv_index [block].
  """
  s = jnp.einsum('BTKGH,BKSH->BKGTS', q, kb.astype(q.dtype)).astype(jnp.float32)
  causal = q_index[:, None] >= kv_index[None, :]
  seen = (causal[None] & (q_seg[:, :, None] == seg_b[:, None, :])
          & (seg_b[:, None, :] != 0))[:, None, None]                 # [B, 1, 1, Tq, block]
  s = jnp.where(seen, s, _NEG_INF)
  # Slots past S do not exist: unlike masked ones they never enter an average.
  return jnp.where(real_b, s, -jnp.inf), seen


def _visited(q_last, k_first):
  """Whether a (query tile, key tile) pair holds any causally visible pair, from the tile's
  largest query index and smallest key index.

  A tile wholly above the diagonal (its first key after the tile's last query)
  is skipped in both passes: about half of a long causal sequence's tiles.
  """
  return q_last >= k_first


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _blockwise(q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv):
  """Online-softmax attention over (query, key) tiles; q [B, T, K, G, H] -> same shape."""
  return _blockwise_fwd(q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv)[0]


def _blockwise_fwd(q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv):
  b, t, kh, g, h = q.shape
  keys = _key_blocks(k, v, kv_seg, kv_index, block_kv)

  def query_tile(xs):
    qb, qseg_b, qi_b = xs                                             # [B, bq, K, G, H]
    q_last = qi_b.max()

    def body(carry, xs):
      kb, vb, seg_b, real_b, ki_b = xs

      def visit(carry):
        m, l, acc = carry
        s, _ = _block_logits(qb, kb, qseg_b, seg_b, real_b, ki_b, qi_b)
        m_new = jnp.maximum(m, s.max(-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum('BKGTS,BKSH->BKGTH', p.astype(q.dtype), vb.astype(q.dtype),
                        preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

      return jax.lax.cond(_visited(q_last, ki_b.min()), visit, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, block_q), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, block_q), jnp.float32),
            jnp.zeros((b, kh, g, block_q, h), jnp.float32))
    # Under a layer scan's partial evaluation, JAX would hoist the mask half of
    # this loop (it reads only segment ids) out of the layers and stack it per
    # tile: a [T, S] buffer again. A checkpointed body saves nothing, so the mask
    # stays inside the loop.
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    (m, l, acc), _ = jax.lax.scan(body, init, keys)
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)     # [B, K, G, bq, H], [B, K, G, bq]

  out, lse = jax.lax.map(query_tile, (_query_blocks(q, 1, block_q),
                                      _query_blocks(q_seg, 1, block_q),
                                      _query_blocks(q_index, 0, block_q)))
  out = jnp.moveaxis(_query_unblock(out, 3, t), 3, 1)                 # [B, T, K, G, H]
  lse = _query_unblock(lse, 3, t)                                     # [B, K, G, T]
  return out, (q, k, v, q_seg, kv_seg, q_index, kv_index, out, lse)


def _blockwise_bwd(block_q, block_kv, res, d_out):
  q, k, v, q_seg, kv_seg, q_index, kv_index, out, lse = res
  dt = q.dtype
  t = q.shape[1]
  kbs, vbs, segs, real, kv_idx = _key_blocks(k, v, kv_seg, kv_index, block_kv)
  nk = kbs.shape[0]
  delta = jnp.einsum('BTKGH,BTKGH->BKGT', d_out.astype(jnp.float32),
                     out.astype(jnp.float32))

  def query_tile(carry, xs):
    qb, qseg_b, qi_b, dob, lse_b, delta_b = xs
    q_last = qi_b.max()
    do = jnp.moveaxis(dob, 1, 3)                                      # [B, K, G, bq, H]

    def body(carry, xs):
      j, kb, vb, seg_b, real_b, ki_b = xs

      def visit(carry):
        dq, dks, dvs = carry
        s, seen = _block_logits(qb, kb, qseg_b, seg_b, real_b, ki_b, qi_b)
        p = jnp.exp(s - lse_b[..., None])                             # [B, K, G, bq, bk]
        dv = jnp.einsum('BKGTS,BKGTH->BKSH', p.astype(dt), do.astype(dt),
                        preferred_element_type=jnp.float32)
        dp = jnp.einsum('BKGTH,BKSH->BKGTS', do.astype(dt), vb.astype(dt),
                        preferred_element_type=jnp.float32)
        ds = jnp.where(seen, p * (dp - delta_b[..., None]), 0.).astype(dt)
        dq = dq + jnp.einsum('BKGTS,BKSH->BTKGH', ds, kb.astype(dt),
                             preferred_element_type=jnp.float32)
        dk = jnp.einsum('BKGTS,BTKGH->BKSH', ds, qb, preferred_element_type=jnp.float32)
        return dq, dks.at[j].add(dk), dvs.at[j].add(dv)

      return jax.lax.cond(_visited(q_last, ki_b.min()), visit, lambda c: c, carry), None

    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    dks, dvs = carry
    (dq, dks, dvs), _ = jax.lax.scan(
        body, (jnp.zeros(qb.shape, jnp.float32), dks, dvs),
        (jnp.arange(nk), kbs, vbs, segs, real, kv_idx))
    return (dks, dvs), dq

  zeros = jnp.zeros(kbs.shape, jnp.float32)
  (dks, dvs), dq = jax.lax.scan(query_tile, (zeros, zeros), (
      _query_blocks(q, 1, block_q), _query_blocks(q_seg, 1, block_q),
      _query_blocks(q_index, 0, block_q), _query_blocks(d_out, 1, block_q), _query_blocks(lse, 3, block_q),
      _query_blocks(delta, 3, block_q)))
  dq = _query_unblock(dq, 1, t)
  s = k.shape[2]
  unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(*k.shape[:2], -1, k.shape[3])[:, :, :s]
  return (dq.astype(q.dtype), unblock(dks).astype(k.dtype), unblock(dvs).astype(v.dtype),
          None, None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ------------------------------------------------------------------ kernels


def _pad_to(x, axis, multiple):
  """x zero-padded along `axis` to a multiple of `multiple` (segment 0: padding)."""
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _splash(q, k, v, seg, *, block_q, block_kv):
  """TPU splash attention; q [B, T, K, G, H] scaled, k/v [B, K, T, H], seg [B, T]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  b, t, kh, g, h = q.shape
  # Tiles of 128 lanes; a short sequence is padded to one tile, not to block_*.
  tile = 128
  bq, bkv = min(block_q, -(-t // tile) * tile), min(block_kv, -(-t // tile) * tile)
  tp = -(-t // max(bq, bkv)) * max(bq, bkv)
  qn = _pad_to(q.reshape(b, t, kh * g, h), 1, tp).transpose(0, 2, 1, 3)    # [B, N, Tp, H]
  k, v, seg = _pad_to(k, 2, tp), _pad_to(v, 2, tp), _pad_to(seg, 1, tp)
  kernel = _splash_kernel(tp, kh * g, bq, bkv, sharding.mesh_platform() != 'tpu')
  out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, splash.SegmentIds(s1, s1)))(
      qn, k, v, seg)
  return out.transpose(0, 2, 1, 3)[:, :t].reshape(b, t, kh, g, h)


@functools.lru_cache(maxsize=1)
def _causal_mask_cls():
  """splash's CausalMask, but blocks wholly below or above the diagonal are answered without
  evaluating them: building a kernel walks every block of the mask in numpy, about 11 s of a
  61,440-token train step's lowering, nearly all of it on blocks that are all True or all False.
  The kernel itself still computes the mask with the same function."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

  class BlockCausalMask(splash_attention_mask.CausalMask):

    def __getitem__(self, idx):
      if (self.offset == 0 and isinstance(idx, tuple) and len(idx) == 2
          and all(isinstance(x, slice) and x.step in (None, 1) for x in idx)):
        (q0, q1, _), (k0, k1, _) = (x.indices(n) for x, n in zip(idx, self.shape))
        if q1 > q0 and k1 > k0:
          if q0 >= k1 - 1:                        # every query after every key: all seen
            return np.ones((q1 - q0, k1 - k0), bool)
          if q1 - 1 < k0:                         # every key after every query: none seen
            return np.zeros((q1 - q0, k1 - k0), bool)
      return super().__getitem__(idx)

  return BlockCausalMask


def _splash_kernel(length: int, heads: int, block_q: int, block_kv: int, interpret: bool):
  """The splash kernel for causal attention over `length` positions, built inside the current
  trace (it makes arrays there, so it is not cached across traces)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as splash_mask)
  sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                            block_q_dkv=block_q, block_kv_dkv=block_kv,
                            block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                            block_kv_dq=block_kv)
  mask = splash_mask.MultiHeadMask([_causal_mask_cls()((length, length))] * heads)
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                mask_value=_NEG_INF, interpret=interpret)


def _gpu_flash(q, k, v, seg):
  """Pallas GPU flash attention, grouped-query native; q [B, T, K, G, H] scaled, k/v
  [B, K, T, H], seg [B, T].

  The kernel `mha` pairs query head i with key/value head i. It runs once per group member
  g < G (`jax.vmap` over q's G axis with k, v and seg unmapped): vmapping a `pallas_call`
  adds a grid dimension and leaves an unmapped operand's block index unchanged, so the
  kernel for (g, head k) reads kv head k where it lies and no [B, T, N, H] copy of K or V is
  made (`jnp.repeat` made one per layer, kept for the backward). The backward kernel writes
  dK and dV per query head ([G, B, T, K, H]); vmap's custom-VJP rule sums them over the
  group.
  """
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention
  b, t, kh, g, h = q.shape
  tp = -(-t // _GPU_BLOCK) * _GPU_BLOCK
  kernel = functools.partial(
      gpu_attention.mha, sm_scale=1.0, causal=True,
      block_sizes=gpu_attention.BlockSizes(block_q=_GPU_BLOCK, block_k=_GPU_BLOCK,
                                          block_q_dkv=32, block_kv_dkv=32,
                                          block_q_dq=32, block_kv_dq=32),
      interpret=sharding.mesh_platform() != 'gpu')
  heads = lambda x: _pad_to(x.transpose(0, 2, 1, 3), 1, tp)          # [B, Tp, K, H]
  qg = _pad_to(jnp.moveaxis(q, 3, 0), 2, tp)                          # [G, B, Tp, K, H]
  out = jax.vmap(kernel, in_axes=(0, None, None, None))(
      qg, heads(k), heads(v), _pad_to(seg, 1, tp))
  return jnp.moveaxis(out[:, :, :t], 0, 3)                            # [B, T, K, G, H]


def _sharded_kernel(kernel, q, k, v, seg, rules):
  """Runs a Pallas kernel per shard: rows over the batch axes, heads over the head axes.

  A Pallas call cannot be partitioned by XLA, so under a mesh it runs inside
  a `shard_map`. Heads are split as the rules split kv heads (query heads
  follow their kv head); the sequence is never split.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return kernel(q, k, v, seg)
  # kv heads decide the head split; each kv head's G query heads go with it.
  batch, heads = sharding.logical_to_spec(('batch', 'kv_heads'), k.shape[:2], mesh, rules)
  q_spec, k_spec = P(batch, None, heads, None, None), P(batch, heads, None, None)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, k_spec, k_spec, P(batch, None)),
                       out_specs=q_spec, check_vma=False)(q, k, v, seg)
