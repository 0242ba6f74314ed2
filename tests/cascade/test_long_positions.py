"""Lengths past 64K in a config: a YaRN model's positions, and stages asking for more."""

import importlib.util
import os

import pytest

from cascade import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN3_128K = dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=32_768)


def _tiny(max_seq_len, rope_scaling=QWEN3_128K, rl_len=None):
  """configs/tiny.py with a tiny Qwen3-like model under Qwen3's 128K YaRN setting."""
  spec = importlib.util.spec_from_file_location('tiny_cfg', os.path.join(ROOT, 'configs/tiny.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('smoke')
  config.model.overrides.update(max_seq_len=max_seq_len, rope_scaling=rope_scaling,
                                rope_theta=1_000_000.0)
  if rl_len is not None:
    stage = next(s for s in config.stages if s['name'] == 'math_rl')
    stage['max_response_len'] = rl_len - stage['max_prompt_len']
    stage.pop('phases', None)
  return config


def test_a_128k_stage_fits_131072_positions():
  plan = config_lib.validate(_tiny(131_072, rl_len=131_072))
  assert plan.model.max_seq_len == 131_072
  assert plan.model.rope_scaling.covered_positions() == 131_072
  assert max(s.max_prompt_len + s.max_response_len for s in plan.stages
             if s.kind == 'grpo') == 131_072


def test_a_stage_longer_than_the_positions_is_refused():
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(_tiny(131_072, rl_len=131_073))
  msg = str(e.value)
  assert '\n' not in msg and msg.endswith(
      "max_prompt_len + max_response_len = 131073 exceeds the model's max_seq_len=131072")


@pytest.mark.parametrize('scaling', [QWEN3_128K, dict(QWEN3_128K, factor=2.0)])
def test_max_seq_len_past_the_yarn_positions_is_refused(scaling):
  covered = int(32_768 * scaling['factor'])
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(_tiny(covered + 1, scaling))
  assert str(e.value) == (
      f'config.model: max_seq_len={covered + 1} exceeds the {covered} positions its YaRN '
      f"scaling covers (original_max_position_embeddings=32768 x factor={scaling['factor']:g}): "
      'raise rope_scaling.factor or lower max_seq_len')
  # Plain RoPE and Llama-3's scaling name no such bound (Llama-3.1: 8,192 x 8 < 131,072).
  config_lib.validate(_tiny(covered + 1, None))


def test_overrides_beside_an_hf_checkpoint_are_refused(tmp_path):
  """They never reached the model (its config.json is the architecture): one line, not silence."""
  config = _tiny(131_072)
  config.model = dict(hf_path=str(tmp_path), overrides=dict(max_seq_len=131_072))
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert str(e.value).startswith("config.model.overrides: ['max_seq_len'] would not reach the "
                                 "model: with 'hf_path' its config.json is the architecture")
  assert '\n' not in str(e.value)
