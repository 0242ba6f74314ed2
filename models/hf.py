"""Hugging Face interop: load and save Llama / Qwen2 / Qwen3 / Qwen3-MoE / Nemotron-H checkpoints.

The config translation and the sharded read and write of each tensor live here; what sets
a family apart (its HF architecture, config.json fields and tensor table) lives in its
module in models/families (the `hf_*` fields of `families.base.Family`), written with the
table builders of models/hf_tables.py, so that an import and its export cannot drift apart.

  model = hf.load_model('/ckpt/Qwen3-8B', mesh=mesh)   # an nnx Transformer
  logits = model(tokens)                               # int32 [B, T] -> [B, T, V]
  hf.save_model(model, '/out', tokenizer=tok)          # loadable by transformers, vLLM

A checkpoint directory holds `config.json` and either `model.safetensors` or
`model-0000x-of-0000y.safetensors` shards listed in
`model.safetensors.index.json`. The directory may be local or `gs://...`
(`foundation.paths`): a remote weight file is copied to a local temporary file
while it is read, and a save to a remote directory is written locally, then
uploaded with config.json last. Tensors are read one at a time with
`safetensors.safe_open`, re-laid out on the host and placed straight into
their final sharding (`jax.make_array_from_callback`), so the host never holds
more than one tensor and no full unsharded copy of the model exists; a stacked
parameter (the dense blocks' [L, ...], the experts' [E, ...]) is filled one
layer or expert at a time.

Layouts (ours <- HF) are in models/hf_tables.py's docstring. The dense blocks' parameters
are stacked on a leading 'layers' axis [L, ...]: HF's `model.layers.{i}.*` tensors are read
into, and written from, layer i of them. A sublayer pattern's tables (Mamba, experts;
per-expert or fused, Nemotron-H's `backbone.` or `model.` prefix) are written per sublayer
and pointed at where the model keeps each (`hybrid.locate`); a save writes the hub's layout
(per-expert, `backbone.`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from typing import Any, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from foundation import paths
from foundation import tokenizer as tokenizer_lib
from models import config as config_lib
from models import families
from models import hf_tables
from models import hf_tokenizer
from models import hybrid
from models import rope as rope_lib
from models import sharding
from models import transformer



def architectures() -> dict[str, str]:
  """HF architecture name -> family name, for every registered family that has one."""
  return {f.hf_architecture: f.name for f in families.FAMILIES.values() if f.hf_architecture}


_DTYPES = ('float32', 'bfloat16', 'float16')
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_SHARD_RE = re.compile(r'^model-\d{5}-of-\d{5}\.safetensors$')
# Non-parameter buffers some older exports carry; they hold nothing we need.
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)


_require = hf_tables.require


def _rope(hf: Mapping[str, Any], max_positions: int
          ) -> tuple[float, rope_lib.RopeScaling | None]:
  """RoPE theta and scaling from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x).

  As transformers 5 does: a non-empty `rope_scaling` wins over `rope_parameters`,
  theta defaults to the top-level `rope_theta` (else 10000), and yarn / llama3
  without `original_max_position_embeddings` take `max_position_embeddings`.
  """
  params = hf.get('rope_scaling') or hf.get('rope_parameters') or {}
  if not isinstance(params, Mapping):
    raise ValueError(f'HF config: rope parameters {params!r} are not a dict')
  params = dict(params)
  theta = params.pop('rope_theta', None)
  theta = hf.get('rope_theta', 10_000.0) if theta is None else theta
  if theta is None:
    raise ValueError(f'HF config: rope parameters {params} have no rope_theta')
  if params.pop('partial_rotary_factor', 1.0) != 1.0:
    raise ValueError('HF config: partial_rotary_factor != 1 (partial RoPE) is not supported')
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind in ('yarn', 'llama3'):
    params.setdefault('original_max_position_embeddings', max_positions)
  try:
    scaling = rope_lib.RopeScaling.from_dict({'rope_type': kind, **params})
  except ValueError as e:
    raise ValueError(f'HF config: {e}') from None
  return float(theta), scaling


def _dtype_name(hf: Mapping[str, Any]) -> str:
  name = hf.get('dtype') or hf.get('torch_dtype') or 'float32'
  name = str(name).removeprefix('torch.')
  if name not in _DTYPES:
    raise ValueError(f'HF config: dtype {name!r} is not one of {_DTYPES}')
  return name


def config_from_hf(hf: Mapping[str, Any]) -> config_lib.ModelConfig:
  """Builds a ModelConfig from an HF `config.json` dict.

  Args:
    hf: the parsed config.json of a LlamaForCausalLM, Qwen2ForCausalLM,
      Qwen3ForCausalLM, Qwen3MoeForCausalLM or NemotronHForCausalLM checkpoint.

  Returns:
    The ModelConfig; param and compute dtype are the checkpoint's dtype.

  Raises:
    ValueError: an unsupported architecture or feature (a RoPE scaling other
      than linear / yarn / llama3, sliding window, o_proj / MLP biases, an
      activation other than silu; a family's own in its `hf_read`) or a
      missing required field.
  """
  archs = hf.get('architectures') or []
  known = architectures()
  if len(archs) != 1 or archs[0] not in known:
    raise ValueError(f'HF config: architectures={archs!r} is not supported; '
                     f'expected one of {sorted(known)}')
  family = known[archs[0]]
  spec = families.get(family)
  if spec.hf_read is not None:
    return config_lib.ModelConfig(**spec.hf_read(hf, _dtype_name(hf)))
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f"HF config: hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
  # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which we lack.
  # (A family whose HF class has q/k/v biases, Qwen2, has no o_proj bias and no such field.)
  if not spec.hf_switches[0] and hf.get('attention_bias'):
    raise ValueError(f'HF config: attention_bias=true ({archs[0]}) puts a bias on o_proj, '
                     'which is not supported')
  if hf.get('mlp_bias'):
    raise ValueError('HF config: mlp_bias=true is not supported')
  if hf.get('use_sliding_window') or any(
      t != 'full_attention' for t in hf.get('layer_types') or ()):
    raise ValueError('HF config: sliding-window attention (use_sliding_window / layer_types) '
                     'is not supported')
  d = int(_require(hf, 'hidden_size'))
  n = int(_require(hf, 'num_attention_heads'))
  head_dim = hf.get('head_dim')
  if head_dim is None:
    head_dim = spec.hf_head_dim or d // n  # transformers' defaults.
  dtype = _dtype_name(hf)
  max_positions = int(hf.get('max_position_embeddings') or spec.hf_max_positions)
  rope_theta, rope_scaling = _rope(hf, max_positions)
  num_layers = int(_require(hf, 'num_hidden_layers'))
  extra = {} if spec.hf_read_extra is None else spec.hf_read_extra(hf, num_layers)
  return config_lib.ModelConfig(
      family=family,
      vocab_size=int(_require(hf, 'vocab_size')),
      embed_dim=d,
      num_layers=num_layers,
      num_heads=n,
      num_kv_heads=int(hf.get('num_key_value_heads') or n),
      head_dim=int(head_dim),
      mlp_dim=int(_require(hf, 'intermediate_size')),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      qkv_bias=spec.hf_switches[0],
      qk_norm=spec.hf_switches[1],
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      max_seq_len=max_positions,
      param_dtype=dtype,
      dtype=dtype,
      **extra)


def config_to_hf(cfg: config_lib.ModelConfig) -> dict[str, Any]:
  """The HF `config.json` dict of a ModelConfig (readable by transformers 4.x and 5.x).

  Raises:
    ValueError: the config's switches do not match what its family's HF class
      computes (e.g. a 'llama' with q/k norm, a 'nemotron_h' with RoPE).
  """
  spec = cfg.spec
  if spec.hf_architecture is None:
    raise ValueError(f'ModelConfig.family={cfg.family!r} has no Hugging Face architecture')
  if spec.hf_write is not None:
    return spec.hf_write(cfg, cfg.param_dtype)
  want = spec.hf_switches
  if (cfg.qkv_bias, cfg.qk_norm) != want:
    raise ValueError(
        f'ModelConfig(family={cfg.family!r}, qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}) '
        f'has no HF equivalent; {spec.hf_architecture} needs qkv_bias='
        f'{want[0]}, qk_norm={want[1]}')
  if not cfg.use_rope or cfg.mlp_activation != 'swiglu':
    raise ValueError(
        f'ModelConfig(family={cfg.family!r}, use_rope={cfg.use_rope}, mlp_activation='
        f'{cfg.mlp_activation!r}) has no HF equivalent; {spec.hf_architecture} needs '
        "use_rope=True, mlp_activation='swiglu'")
  rope_scaling = (cfg.rope_scaling.to_dict() if cfg.rope_scaling is not None
                  else {'rope_type': 'default'})
  out = {
      'architectures': [spec.hf_architecture],
      'model_type': cfg.family,
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.embed_dim,
      'intermediate_size': cfg.mlp_dim,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': cfg.max_seq_len,
      'rms_norm_eps': cfg.norm_eps,
      # transformers 5 reads rope_parameters, 4.x reads rope_theta and rope_scaling.
      'rope_parameters': {**rope_scaling, 'rope_theta': cfg.rope_theta},
      'rope_theta': cfg.rope_theta,
      'tie_word_embeddings': cfg.tie_embeddings,
      'dtype': cfg.param_dtype,
      'torch_dtype': cfg.param_dtype,
  }
  if cfg.rope_scaling is not None:
    out['rope_scaling'] = rope_scaling
  out.update(spec.hf_constants)
  if spec.hf_write_extra is not None:
    out.update(spec.hf_write_extra(cfg))
  return out


def _tensors(cfg: config_lib.ModelConfig,
             names: Collection[str] | None = None) -> list[hf_tables.Tensor]:
  """Every parameter of `cfg`'s Transformer as HF tensors, in HF's order (its family's
  `hf_tensors`), following the layout of the checkpoint's tensor `names` (None: the hub
  layout an export writes); a sublayer's ('blocks', i, ...) parts pointed at where the model
  keeps sublayer i."""
  return [_relocate(cfg, t) for t in cfg.spec.hf_tensors(cfg, names)]


def _relocate(cfg: config_lib.ModelConfig, t: hf_tables.Tensor) -> hf_tables.Tensor:
  """`t` with its ('blocks', i, ...) parts pointed at where the model keeps sublayer i: a
  block of its own, or one repeat of a stacked segment (models/hybrid.py `locate`), the
  repeat prefixed to the part's index."""
  parts = []
  for part in t.parts:
    if part.path[0] == 'blocks':
      prefix, r = hybrid.locate(cfg, part.path[1])
      index = part.index
      if r is not None:
        index = (r,) if index is None else (r,) + (index if isinstance(index, tuple) else (index,))
      part = dataclasses.replace(part, path=prefix + part.path[2:], index=index)
    parts.append(part)
  return dataclasses.replace(t, parts=tuple(parts))


def _weight_files(ckpt: epath.Path) -> dict[str, epath.Path]:
  """Maps every tensor name in the checkpoint to the safetensors file holding it."""
  index = ckpt / INDEX_FILE
  if paths.exists(index):
    weight_map = json.loads(paths.read_text(index)).get('weight_map')
    if not isinstance(weight_map, dict):
      raise ValueError(f'{index}: no "weight_map" dict')
    files = {name: ckpt / fname for name, fname in weight_map.items()}
    for fname in sorted(set(files.values())):
      if not paths.exists(fname):
        raise FileNotFoundError(f'{index} lists shard {fname.name}, which does not exist in {ckpt}')
    return files
  single = ckpt / SINGLE_FILE
  if not paths.exists(single):
    raise FileNotFoundError(f'{ckpt}: neither {SINGLE_FILE} nor {INDEX_FILE} found')
  with _open(single) as fh:
    return {name: single for name in fh.keys()}


@contextlib.contextmanager
def _open(fname: epath.Path):
  """`safetensors.safe_open` of a local or remote file (remote: a local temporary copy)."""
  with paths.local_file(fname) as local, safetensors.safe_open(local, framework='numpy') as fh:
    yield fh


def _check_names(wanted: list[hf_tables.Tensor], files: Mapping[str, epath.Path],
                 cfg: config_lib.ModelConfig, ckpt: epath.Path):
  names = {t.name for t in wanted}
  note = (hf_tables.expert_count_note(cfg, files, cfg.spec.hf_experts_field)
          if cfg.num_experts else '')
  missing = [t.name for t in wanted if t.name not in files]
  if missing:
    raise ValueError(f'{ckpt}: {len(missing)} tensor(s) the config needs are missing, '
                     f'e.g. {missing[:5]}{note}')
  extra = sorted(x for x in files if x not in names and not x.endswith(_IGNORED_SUFFIXES)
                 and not cfg.spec.hf_ignored(x)
                 and not (cfg.tie_embeddings and x == 'lm_head.weight'))
  if extra:
    raise ValueError(f'{ckpt}: {len(extra)} unexpected tensor(s) the config does not use, '
                     f'e.g. {extra[:5]}{note}')


def _read(fh, name: str, fname: epath.Path) -> np.ndarray:
  if name not in fh.keys():
    raise ValueError(f'{fname}: tensor {name!r} listed in the index is not in the file')
  return fh.get_tensor(name)


def _check_tied_head(files: Mapping[str, epath.Path]):
  """A tied checkpoint may still carry lm_head.weight; it must equal the embedding."""
  def get(name):
    with _open(files[name]) as fh:
      return _read(fh, name, files[name])
  if not np.array_equal(get('lm_head.weight'), get('model.embed_tokens.weight')):
    raise ValueError('tie_word_embeddings=true, but lm_head.weight differs from '
                     'model.embed_tokens.weight')


def load_model(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
               dtype: Any = None, rules=None) -> transformer.Transformer:
  """Loads an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Nemotron-H checkpoint as an NNX Transformer.

  Args:
    path: directory (local or gs://) with config.json and model.safetensors (or
      sharded model-0000x-of-0000y.safetensors files plus model.safetensors.index.json);
      the experts' tensors may be per-expert or fused, and Nemotron-H's prefix
      `backbone.` or `model.` (its family's `hf_tensors`).
    mesh: place every parameter sharded on this ('data', 'fsdp', 'tensor') mesh
      (or ('data', 'fsdp', 'expert', 'tensor')) as it is read; None puts them on the
      default device.
    dtype: parameter and compute dtype (e.g. 'float32', jnp.bfloat16);
      default: the checkpoint's dtype.
    rules: logical-axis rules for the shardings (default: sharding.DEFAULT_RULES).

  Returns:
    The model; `model(tokens)` maps int32 [B, T] to float32 logits [B, T, V].

  Raises:
    FileNotFoundError: config.json, the weights or a listed shard file is missing.
    ValueError: an unsupported architecture or config feature, a missing or
      unexpected tensor, or a tensor whose shape does not match the config (an
      expert count that differs from the config's is one of these).
  """
  ckpt = paths.path(path)
  cfg_file = ckpt / 'config.json'
  if not paths.exists(cfg_file):
    raise FileNotFoundError(f'{ckpt}: no config.json')
  cfg = config_from_hf(json.loads(paths.read_text(cfg_file)))
  if dtype is not None:
    name = jnp.dtype(dtype).name
    cfg = cfg.replace(param_dtype=name, dtype=name)
  files = _weight_files(ckpt)
  wanted = _tensors(cfg, files)
  _check_names(wanted, files, cfg, ckpt)
  if cfg.tie_embeddings and 'lm_head.weight' in files:
    _check_tied_head(files)

  abstract = nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  abs_vars = dict(nnx.to_flat_state(abs_state))
  shards = (dict(nnx.to_flat_state(sharding.state_shardings(abs_state, mesh, rules)))
            if mesh is not None else None)
  table_paths = {part.path for t in wanted for part in t.parts}
  if set(abs_vars) != table_paths:  # Guards the tables against model drift.
    raise AssertionError(f'parameter paths drifted: {set(abs_vars) ^ table_paths}')

  by_file: dict[epath.Path, list[hf_tables.Tensor]] = {}
  for t in wanted:
    by_file.setdefault(files[t.name], []).append(t)
  loaded, stacks = {}, {}
  for fname, tensors in by_file.items():
    with _open(fname) as fh:
      for t in tensors:
        host = _read(fh, t.name, fname)
        if tuple(host.shape) != t.shape:
          raise ValueError(f'{fname.name}: tensor {t.name!r} has shape {tuple(host.shape)}, '
                           f'but the config needs {t.shape}')
        for part in t.parts:
          var = abs_vars[part.path]
          value = part.from_hf(host).astype(var.get_value().dtype, copy=False)
          sh = None if shards is None else shards[part.path].get_value()
          if part.index is None:
            loaded[part.path] = var.replace(_place(value, sh))
          else:
            if part.path not in stacks:
              stacks[part.path] = _Stack(var.get_value(), sh)
            stacks[part.path].set(part.index, value)
        del host  # At most one tensor is ever held on the host.
  loaded.update({path: abs_vars[path].replace(s.value) for path, s in stacks.items()})
  return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _place(host: np.ndarray, sharding_: jax.sharding.NamedSharding | None) -> jax.Array:
  """A host array on the default device, or split over `sharding_`'s mesh."""
  if sharding_ is None:
    return jax.device_put(np.ascontiguousarray(host))
  return jax.make_array_from_callback(host.shape, sharding_, lambda idx: host[idx])


class _Stack:
  """A stacked [L, ...] (or [E, ...], or a segment's [R, E, ...]) parameter on device, filled
  one slice (a layer, an expert, an expert of a repeat) at a time in place.

  The device holds the stack plus one slice and the host one slice, never L.
  """

  def __init__(self, abstract: jax.ShapeDtypeStruct,
               sharding_: jax.sharding.NamedSharding | None):
    zeros = lambda: jnp.zeros(abstract.shape, abstract.dtype)
    self._sharding, self._ndim, self._puts = sharding_, len(abstract.shape), {}
    if sharding_ is None:
      self.value = jax.jit(zeros)()
    else:
      self.value = jax.jit(zeros, out_shardings=sharding_)()

  def _put(self, depth: int):
    """(jitted in-place write of a slice `depth` leading indices deep, the slice's sharding)."""
    if depth not in self._puts:
      def put(stack, x, idx):
        x = x.reshape((1,) * depth + x.shape)
        return jax.lax.dynamic_update_slice(stack, x, tuple(idx) + (0,) * (stack.ndim - depth))
      if self._sharding is None:
        self._puts[depth] = (jax.jit(put, donate_argnums=0), None)
      else:  # A slice is split as the stack is, less its leading axes.
        spec = tuple(self._sharding.spec) + (None,) * (self._ndim - len(self._sharding.spec))
        self._puts[depth] = (
            jax.jit(put, donate_argnums=0, out_shardings=self._sharding),
            jax.sharding.NamedSharding(self._sharding.mesh,
                                       jax.sharding.PartitionSpec(*spec[depth:])))
    return self._puts[depth]

  def set(self, i: int | tuple[int, ...], host: np.ndarray):
    idx = i if isinstance(i, tuple) else (i,)
    put, slice_sharding = self._put(len(idx))
    self.value = put(self.value, _place(host, slice_sharding),
                     tuple(jnp.asarray(j, jnp.int32) for j in idx))


def _host_value(params: Mapping[tuple, nnx.Variable], part: hf_tables.Part) -> np.ndarray:
  """A part's parameter (or its slice) on the host; a multi-host one gathered, alone.

  Every process must call it, in the same order: the slice and the gather are collectives.
  """
  value = params[part.path].get_value()
  if part.index is not None:
    value = value[part.index]
  if value.is_fully_addressable:
    return np.asarray(value)
  return multihost_utils.process_allgather(value, tiled=True)


def _stale_files(out: str) -> list[str]:
  """The files of an earlier save in `out`: weights and tokenizer files."""
  return [paths.join(out, n) for n in paths.listdir(out)
          if n in (SINGLE_FILE, INDEX_FILE) + hf_tokenizer.FILES or _SHARD_RE.match(n)]


def save_model(model: transformer.Transformer, out_dir: str | os.PathLike, *,
               tokenizer: tokenizer_lib.Tokenizer | None = None,
               max_shard_size: int = 5_000_000_000) -> None:
  """Writes `model` as an HF checkpoint that `transformers` (and vLLM, SGLang) can load.

  Writes config.json and model.safetensors with HF tensor names and layouts in
  the parameters' own dtype (experts per expert, Nemotron-H under `backbone.`, as
  the hub's checkpoints are); when the weights exceed `max_shard_size` bytes
  they go into model-0000x-of-0000y.safetensors files with an index. With a
  `tokenizer`, its files and our chat template too (models/hf_tokenizer.py), so
  `AutoTokenizer.from_pretrained(out_dir).apply_chat_template` gives our prompts'
  tokens. Files of an earlier save in `out_dir` are replaced.

  Process 0 writes. With several processes every one must call it: a parameter
  that spans hosts is gathered one HF tensor at a time (a collective), so no host
  ever holds more of the model than one shard file's tensors (process 0) or one
  tensor (the others).

  Args:
    model: a Transformer, on one host or sharded over several.
    out_dir: the directory to write (created if needed), local or gs:// (written locally,
      then uploaded with config.json last, so a whole export is one with a config.json).
    tokenizer: the tokenizer the model was trained with; None writes no tokenizer files.
    max_shard_size: the largest weight file in bytes (a single larger tensor
      gets a file of its own).

  Raises:
    ValueError: the config has no HF equivalent, or the tokenizer has no HF
      equivalent (models/hf_tokenizer.py), both before anything is written.
  """
  cfg = model.cfg
  hf_config = config_to_hf(cfg)
  tokenizer_files = {} if tokenizer is None else hf_tokenizer.files(tokenizer)
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  tensors = _tensors(cfg)

  groups: list[list[hf_tables.Tensor]] = [[]]
  size = 0
  for t in tensors:
    nbytes = math.prod(t.shape) * params[t.parts[0].path].get_value().dtype.itemsize
    if groups[-1] and size + nbytes > max_shard_size:
      groups.append([])
      size = 0
    groups[-1].append(t)
    size += nbytes

  writer = jax.process_index() == 0
  out = os.fspath(out_dir)
  if writer:
    paths.makedirs(out)
    # config.json marks a whole export: it goes first and comes back last.
    for stale in [paths.join(out, 'config.json')] + _stale_files(out):
      paths.remove(stale)
  weight_map, total = {}, 0
  for i, group in enumerate(groups):
    fname = (SINGLE_FILE if len(groups) == 1
             else f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors')
    host = {}
    for t in group:
      parts = [_host_value(params, part) for part in t.parts]
      if writer:
        host[t.name] = np.ascontiguousarray(t.to_hf(*parts))
      del parts
    if not writer:
      continue
    total += sum(x.nbytes for x in host.values())
    weight_map.update({name: fname for name in host})
    # transformers expects the 'format' metadata of torch-written files.
    with paths.local_target(paths.join(out, fname)) as local:
      safetensors.numpy.save_file(host, local, metadata={'format': 'pt'})
    del host
  if not writer:
    return
  if len(groups) > 1:
    paths.write_text(paths.join(out, INDEX_FILE), json.dumps(
        {'metadata': {'total_size': total}, 'weight_map': weight_map}, indent=2))
  for name, text in tokenizer_files.items():
    paths.write_text(paths.join(out, name), text)
  paths.write_text(paths.join(out, 'config.json'), json.dumps(hf_config, indent=2))
