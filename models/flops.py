"""Matmul FLOPs of a model's passes, counted from its config (no compiling).

`launch.plan` bounds step times with these counts and counts the mixture-of-experts
families' FLOPs with them (XLA's count is no measure of their work there); a run logs its
model FLOP utilisation from them (`cascade.metrics`).
"""

from __future__ import annotations


def counted_flops(cfg, model_kind: str, tokens: float, context: float, *,
                  head_tokens: float | None = None, train: bool = False) -> float:
  """Matmul FLOPs of a pass of `tokens` positions, counted from the model config.

  For the mixture-of-experts families, whose XLA count is no measure of the
  work (`launch.plan.WHY_COUNTED`): 2 FLOPs per active sublayer parameter
  (`num_params(active=True)`: a token's `experts_per_token` routed experts,
  the shared expert, router, attention, Mamba projections and convolution)
  per position, plus 4 * heads * head_dim per attention sublayer per key
  attended (QK^T and PV), plus the output head over `head_tokens` positions
  (default: all; the reward model's scalar head is left out). Mamba's scan
  (a few percent of its projections at these widths), norms and the
  embedding's gather are not counted, so the count is a lower bound.

  Args:
    cfg: the ModelConfig.
    model_kind: 'policy' or 'reward_model'.
    tokens: positions through the sublayers.
    context: keys each position attends to, on average.
    head_tokens: positions through the output head.
    train: a training step: forward, backward (twice the forward) and, with
      `cfg.remat`, the sublayers' forward once more (attention's scores kept
      under 'save_attention_out').

  Returns:
    FLOPs over all devices.
  """
  emb = cfg.vocab_size * cfg.embed_dim
  blocks = cfg.num_params(active=True) - emb * (1 if cfg.tie_embeddings else 2) - cfg.embed_dim
  head = emb if model_kind == 'policy' else 0
  attn = cfg.attention_layers * 4 * cfg.num_heads * cfg.head_dim * context
  fwd = 2 * blocks + attn
  head_tokens = tokens if head_tokens is None else head_tokens
  if not train:
    return float(tokens * fwd + head_tokens * 2 * head)
  recompute = 0.0 if cfg.remat == 'none' else (
      2 * blocks + (0 if cfg.remat == 'save_attention_out' else attn))
  return float(tokens * (3 * fwd + recompute) + head_tokens * 6 * head)
