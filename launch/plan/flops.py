"""FLOPs counted from the config (`models.flops`) where XLA's count is no measure of the work:
the mixture-of-experts families' programs, and every part of the step-time bound."""

from __future__ import annotations

import numpy as np

from cascade import kinds
from launch.plan import programs as programs_lib
from models import flops as model_flops

# How the mixture-of-experts families' FLOPs are counted (`counted_flops`), in the output,
# what that means and why (printed once per plan).
COUNTED = 'counted from the config'
WHY_COUNTED = ("FLOPs counted from the config: matmuls of the active parameters and attention "
               "scores, Mamba's scan left out (a lower bound). XLA's count does not apply to the "
               'routed experts: on TPU their grouped matmul is a Pallas kernel, whose work XLA '
               'does not count; XLA:CPU lowers ragged_dot as a dense dot of every expert of a '
               'shard over every token-expert pair; and a shard_map body is counted once, not '
               'once per device.')
NOT_COUNTED = "not counted (the paged engine's calls of a mixture-of-experts model)"


# Matmul FLOPs counted from the model config (models/flops.py).
counted_flops = model_flops.counted_flops


def train_flops(stage, model_cfg, mesh, rules) -> float:
  """A train step's counted FLOPs: every '*tokens' field of its largest batch, causal."""
  batch, _ = kinds.get(stage.kind).abstract_batch(stage, mesh, rules)
  tokens = [v for k, v in batch._asdict().items() if k.endswith('tokens')]
  length = tokens[0].shape[1]
  return counted_flops(model_cfg, stage.MODEL, sum(int(np.prod(t.shape)) for t in tokens),
                       (length + 1) / 2, train=True)


def sampler_flops(model_cfg, mesh, rules, sampler_cfg: dict, *, rows: int, prompt_len: int,
                  max_new_tokens: int, num_samples: int = 1, frozen: bool = False,
                  **_) -> tuple[float, str]:
  """(counted FLOPs, how) of one one-call sampler call: its prefill (a prompt once for the rows
  that share it) and every decode step over the filled part of the cache. The paged engine's
  calls are left uncounted."""
  if sampler_cfg.get('engine', 'one_call') != 'one_call':
    return 0.0, NOT_COUNTED
  sampler, _ = programs_lib.sampler_for(model_cfg, mesh, rules, sampler_cfg, frozen=frozen)
  p, nb, b = sampler.call_shape(rows, prompt_len, max_new_tokens)
  u = b // sampler.prefill_group(b, num_samples)
  return (counted_flops(model_cfg, 'policy', u * p, (p + 1) / 2, head_tokens=u)
          + counted_flops(model_cfg, 'policy', b * nb, p + (nb + 1) / 2)), COUNTED


def forward_flops(model_cfg, model_kind, mesh, rules, rows, length) -> tuple[float, str]:
  """(counted FLOPs, how) of one call of a frozen pass (log-probs or scores of every row)."""
  n = programs_lib.forward_rows(rows, mesh, rules)
  return counted_flops(model_cfg, model_kind, n * length, (length + 1) / 2), COUNTED
