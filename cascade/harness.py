"""An lm-evaluation-harness backend: EleutherAI's lm-eval tasks on a cascade checkpoint.

  lm_eval --model cascade --model_args checkpoint=DIR --tasks arc_easy
  python -m cascade.harness run --model cascade ...     # the same, from a source tree

  from cascade import harness
  lm = harness.CascadeLM(checkpoint='runs/tiny')   # an HF directory, or a run's workdir
  lm_eval.simple_evaluate(model=lm, tasks=['arc_easy'])

`CascadeLM` is lm-eval's `LM`, its model 'cascade': an installed cascade registers the name
in every lm-eval process (cascade/lm_eval_hook.py, a .pth hook: lm-eval reads no plugin entry
points) and lm-eval imports this module when it looks the model up; importing it registers
it too, and `python -m cascade.harness` is lm-eval's own command line with it registered
where cascade is not installed. It runs over the project's own model and
sampler, on whatever devices JAX has (TPU, GPU, CPU; `mesh=1,8,1` shards it):

* `loglikelihood`: the log-probability of each continuation after its context and
  whether greedy decoding would produce it, from one jitted forward pass of the
  model (`models.transformer`) per batch of rows. As lm-eval's HF backend does it:
  trailing whitespace of the context moves to the continuation, the pair is encoded
  whole and the continuation is what follows the context's tokens, an empty
  context is the prefix token (the tokenizer's BOS, else its EOS), and a row longer
  than `max_length` + 1 tokens keeps its last ones.
* `loglikelihood_rolling`: a text's whole log-likelihood over lm-eval's own
  disjoint rolling windows of `max_length` tokens (`lm_eval.utils`), each window a
  row of the same forward pass.
* `generate_until`: the prompts sampled by `rl.sampler.Sampler` (the paged engine by
  default, `sampler=` options as config.sampler takes them), greedy unless a task
  asks `do_sample` with a temperature; each completion is cut at the first of the
  task's `until` strings (and ends at the tokenizer's EOS).

Rows go through the forward pass `batch_size` at a time, padded to a power-of-two
length bucket (at least 16 tokens), so a task compiles a few shapes. Thinking: lm-eval
renders its own prompts; with `apply_chat_template` (lm-eval's --apply_chat_template)
they are rendered by `foundation.chat.render` with `thinking=` (None: no /think switch).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
try:
  import lm_eval.api.model
  import lm_eval.api.registry
  import lm_eval.utils
except ImportError as _e:
  raise ImportError('cascade.harness needs lm-eval (pip install -e ".[evals]")') from _e
import numpy as np
from flax import nnx

from cascade import config as config_lib
from cascade import lm_eval_hook
from cascade.suites import checkpoint as checkpoint_lib
from foundation import chat
from models import sharding
from rl import batch as batch_lib
from rl import sampler as sampler_lib

# The shortest length bucket of the forward pass.
MIN_BUCKET = 16


@functools.partial(jax.jit, static_argnums=0, static_argnames=('rules',))
def _score(graphdef, params, tokens, targets, segment_ids, *, rules: sharding.Rules):
  """Per-position log-prob of `targets` and whether it is the argmax ([B, T] each), traced
  with the logical `rules`."""
  model = nnx.merge(graphdef, params)
  model.rules = rules
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  logits = model(tokens, positions, segment_ids)
  return (batch_lib.token_logprobs(logits, targets),
          jnp.argmax(logits, -1).astype(jnp.int32) == targets)


def _options(value, name: str) -> Any:
  """A `model_args` value that lm-eval parsed from 'a=b' text (a mesh '1,8,1' is split on ':'
  there, so '1:8:1' is taken too)."""
  if value is None or value == '':
    return None
  if isinstance(value, (list, tuple)):
    return list(value)
  if isinstance(value, int):
    return [value]
  return [x for x in str(value).replace(':', ',').split(',') if x] if name == 'mesh' else value


class CascadeLM(lm_eval.api.model.LM):
  """lm-eval's `LM` over a cascade checkpoint (see the module docstring).

  Args:
    checkpoint: an HF checkpoint directory or a run's workdir (`cascade.evaluate`'s).
    stage: with a run's workdir, the stage whose export to load (default: the last).
    batch_size: rows per forward pass and prompts per sampler call ('auto': 8).
    max_length: the longest row of the forward pass (0: the model's max_seq_len).
    max_gen_toks: a generation's budget unless the task gives `max_gen_toks`.
    mesh: the device mesh shape ('1,8,1'; None: a run's config.mesh, else one device).
    sampler: sampler options as config.sampler takes them (a dict, or 'k=v;k=v' text).
    thinking: the /think switch of `apply_chat_template` (True, False, None).
    seed: the sampling seed of `generate_until`.
    loaded: an already loaded `cascade.suites.checkpoint.Loaded` (then `checkpoint` only
      names it).
    **unused: lm-eval's own arguments for other backends (device, max_batch_size, ...).
  """

  def __init__(self, checkpoint: str = '', stage: str = '', batch_size: int | str = 8,
               max_length: int = 0, max_gen_toks: int = 256, mesh: Any = None,
               sampler: Any = None, thinking: bool | None = None, seed: int = 0,
               loaded: checkpoint_lib.Loaded | None = None, **unused):
    super().__init__()
    del unused
    bs = _batch_size(batch_size)
    if loaded is None:
      if not checkpoint:
        raise config_lib.ConfigError('cascade lm-eval backend: model_args needs checkpoint=DIR '
                                     "(an HF checkpoint directory or a run's workdir)")
      source = checkpoint_lib.resolve(str(checkpoint), str(stage or ''))
      mesh_shape = _options(mesh, 'mesh')
      loaded = checkpoint_lib.load(source, [int(x) for x in mesh_shape] if mesh_shape else None,
                                   _sampler_options(sampler))
    self.loaded = loaded
    self.name = str(checkpoint) or loaded.policy.identity
    self.batch_size = bs
    self.max_length = int(max_length) or int(loaded.cfg.max_seq_len)
    self.max_gen_toks = int(max_gen_toks)
    self.thinking = thinking
    self._key = jax.random.PRNGKey(int(seed))
    self._calls = 0
    tok = self.tokenizer
    bos = getattr(tok, 'bos_id', None)
    prefix = bos if bos is not None else tok.eos_id
    if prefix is None:
      raise config_lib.ConfigError(f'{self.name}: its tokenizer has neither a BOS nor an EOS '
                                   'token (the prefix of an empty context)')
    self.prefix_token_id = int(prefix)

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
    """lm-eval's constructor from `--model_args` text: as `create_from_arg_obj`."""
    return cls.create_from_arg_obj(lm_eval.utils.simple_parse_args_string(arg_string),
                                   additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
    """lm-eval's constructor: `arg_dict` (`--model_args`) over `additional_config` (the command
    line's --batch_size, which lm-eval's CLI passes always, 1 by default; lm-eval's own merge
    raises on `--model_args batch_size=N`)."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**{**extra, **arg_dict})

  # --- what lm-eval reads ----------------------------------------------------------------------

  @property
  def tokenizer(self):
    return self.loaded.policy.tokenizer

  @property
  def tokenizer_name(self) -> str:
    return f'cascade:{self.name}'

  def chat_template(self, chat_template: bool | str = False) -> str:
    del chat_template
    return 'foundation.chat.render (ChatML)'

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    return chat.render(chat_history, thinking=self.thinking,
                       add_generation_prompt=add_generation_prompt)

  # --- the forward pass ----------------------------------------------------------------------

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's tokens, as lm-eval's HF backend splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      continuation, context = context[-spaces:] + continuation, context[:-spaces]
    if not context:
      return [self.prefix_token_id], self.tokenizer.encode(continuation)
    whole = self.tokenizer.encode(context + continuation)
    ctx = self.tokenizer.encode(context)
    return ctx, whole[len(ctx):]

  def score_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                   ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probs, whether each of its tokens is the argmax) of each
    (context tokens, continuation tokens) pair, the row cut to its last max_length + 1 tokens.

    Raises:
      ValueError: an empty continuation, or a pair with no token to condition on.
    """
    rows = []
    for ctx, cont in pairs:
      if not cont:
        raise ValueError('loglikelihood: an empty continuation (nothing to score)')
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      if len(whole) < 2:
        raise ValueError('loglikelihood: a continuation needs a context token before it')
      rows.append((whole, min(len(cont), len(whole) - 1)))
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))   # like lengths together
    lm = self.loaded
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      longest = max(len(rows[i][0]) - 1 for i in idx)
      t = min(max(MIN_BUCKET, 1 << (longest - 1).bit_length()), self.max_length)
      b = self.batch_size
      tokens = np.zeros((b, t), np.int32)
      targets = np.zeros((b, t), np.int32)
      segs = np.zeros((b, t), np.int32)
      for r, i in enumerate(idx):
        whole = rows[i][0]
        n = len(whole) - 1
        tokens[r, :n], targets[r, :n], segs[r, :n] = whole[:-1], whole[1:], 1
      with sharding.use_mesh(lm.mesh):
        lp, hit = _score(lm.graphdef, lm.params, jnp.asarray(tokens), jnp.asarray(targets),
                         jnp.asarray(segs), rules=sharding.as_rules(lm.rules))
      lp, hit = np.asarray(lp, np.float64), np.asarray(hit)
      for r, i in enumerate(idx):
        whole, k = rows[i]
        n = len(whole) - 1
        out[i] = (float(lp[r, n - k:n].sum()), bool(hit[r, n - k:n].all()))
    return out  # type: ignore[return-value]

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    del disable_tqdm
    pairs = [self.encode_pair(*req.args) for req in requests]
    out = self.score_tokens(pairs)
    for req, res in zip(requests, out):
      self.cache_hook.add_partial('loglikelihood', req.args, res)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    out = []
    for req in requests:
      (text,) = req.args[:1]
      windows = [lm_eval.utils.make_disjoint_window(w) for w in
                 lm_eval.utils.get_rolling_token_windows(
                     token_list=self.tokenizer.encode(text), prefix_token=self.prefix_token_id,
                     max_seq_len=self.max_length, context_len=1)]
      total = sum(lp for lp, _ in self.score_tokens(windows)) if windows else 0.0
      self.cache_hook.add_partial('loglikelihood_rolling', (text,), total)
      out.append(total)
    return out

  # --- generation ----------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(dict(req.args[1]).items())), []).append(i)
    tok = self.tokenizer
    for members in groups.values():
      kwargs = dict(requests[members[0]].args[1])
      until = kwargs.pop('until', None) or []
      until = [until] if isinstance(until, str) else list(until)
      budget = int(kwargs.pop('max_gen_toks', self.max_gen_toks))
      temperature = float(kwargs.pop('temperature', 0.0) or 0.0)
      sample = bool(kwargs.pop('do_sample', False)) and temperature > 0
      sp = sampler_lib.SamplingParams(
          greedy=not sample, temperature=temperature if sample else 1.0,
          top_p=float(kwargs.pop('top_p', 1.0) or 1.0), top_k=int(kwargs.pop('top_k', 0) or 0),
          max_new_tokens=budget)
      room = max(1, self.max_length - budget)
      for start in range(0, len(members), self.batch_size):
        idx = members[start:start + self.batch_size]
        prompts = []
        for i in idx:
          ids = tok.encode(requests[i].args[0])[-room:]
          prompts.append(ids or [self.prefix_token_id])
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        res = self.loaded.policy.sampler.generate(self.loaded.policy.params, prompts, key, sp, 1)
        for r, i in enumerate(idx):
          ids = [t for t in np.asarray(res.tokens[r, :int(res.lengths[r])]).tolist()
                 if t < tok.vocab_size and t != tok.eos_id]
          text = tok.decode(ids, skip_special=True)
          for stop in until:
            if stop:
              text = text.split(stop)[0]
          out[i] = text
          self.cache_hook.add_partial('generate_until', requests[i].args, text)
    return out  # type: ignore[return-value]


# lm-eval's model 'cascade'. The installed hook (cascade/lm_eval_hook.py) registered it as the
# placeholder 'cascade.harness:CascadeLM', which this turns into the class; without the hook this
# registers it. Run as `python -m cascade.harness`, this file is `__main__` (a second copy of the
# class), so main() registers the module's own copy instead.
if __name__ != '__main__':
  lm_eval.api.registry.register_model(lm_eval_hook.MODEL)(CascadeLM)


def _batch_size(value) -> int:
  """`batch_size` as model_args or --batch_size give it: an int >= 1 or its text; 'auto',
  'auto:N' or nothing is 8."""
  if value is None or value == '' or (isinstance(value, str) and value.split(':')[0] == 'auto'):
    return 8
  if isinstance(value, str) and value.strip().isdigit():
    value = int(value)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise config_lib.ConfigError(f'cascade lm-eval backend: batch_size={value!r} must be an int '
                                 ">= 1 or 'auto'")
  return value


def _sampler_options(value) -> dict | None:
  """config.sampler options from model_args (a dict, or 'k=v;k=v' text)."""
  if value is None or value == '':
    return None
  if isinstance(value, dict):
    return value
  out = {}
  for item in str(value).split(';'):
    key, eq, v = item.partition('=')
    if not eq:
      raise config_lib.ConfigError(f'cascade lm-eval backend: sampler={value!r}: {item!r} is not '
                                   'KEY=VALUE (items separated by ;)')
    out[key.strip()] = lm_eval.utils.handle_arg_string(v.strip())
  return out


def main(argv: Sequence[str] | None = None) -> None:
  """lm-eval's command line (`lm-eval run ...`), with the 'cascade' model registered (also where
  the installed hook is not: a source tree on PYTHONPATH)."""
  import importlib  # pylint: disable=g-import-not-at-top
  from lm_eval import __main__ as lm_eval_main  # pylint: disable=g-import-not-at-top
  importlib.import_module('cascade.harness')   # registers CascadeLM (see above)
  if argv is not None:
    sys.argv = [sys.argv[0]] + list(argv)
  sys.argv[0] = 'python -m cascade.harness'
  lm_eval_main.cli_evaluate()


if __name__ == '__main__':
  main()
