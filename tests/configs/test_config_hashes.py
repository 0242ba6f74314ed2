"""The config hash of every shipped config is pinned: a workdir made by an earlier version of the
code resumes only if its config hashes the same (`checkpoint.guard_config`), so a change to how
configs are read, validated or converted must leave these values as they are."""

import importlib

import pytest

from cascade import checkpoint
from cascade import config as config_lib

_ROOT = 'root=/pinned/world'       # the tiny configs name files under their world's root
PINNED = {
    # The paper configs' values changed on purpose when their datasets became the released
    # files as downloaded (issue #39, cascade/data/released.py): they name other data, so a workdir
    # of the earlier hand-converted layout must not resume under them; Cascade 2's MOPD stage
    # also trains the subset's workplace (tool-calling) prompts. (They also take in
    # 4b8b1df's sampler buckets up to 262,144 tokens, which left the old values stale.)
    # Changed again on purpose when the recipes moved to the rollout fast path (issue #36,
    # configs/_recipes.py `fast_path`: the paged engine, stream_filter, pack_tokens): the
    # update's batches and the draw of prompts differ, so an earlier workdir must not resume.
    # Cascade 2 on the v5p slice changed again on purpose at the papers' lengths (issue #37:
    # 256K SFT rows, 98K MOPD and 118K code RL responses on a mesh with a sequence axis);
    # its h200x8 value did not (the node keeps its mesh and capped lengths). The three h200x8
    # values changed on purpose when the node took 2 prompts per prefill call (configs/_recipes.py
    # PREFILL_PROMPTS: the SWE prefill of 8 x 16K prompts did not fit one H200).
    # Cascade 2 on the v5p slice changed again when its weights outside the experts moved from
    # 64 shards of their embed dim to 8 (configs/_recipes.py SEQUENCE_MESH: 42-row shards are
    # not whole TPU tiles); the math is the same, the sharding rules are part of the config.
    # The tiny configs (but tiny_agentic) changed on purpose when the tiny world's evaluation
    # suites became columns of their matrix (issue #55, config.eval.suites and suite_*): with
    # those fields removed they hash to their earlier values (checked when re-pinning).
    # Both Cascade 2 values changed on purpose when MOPD's chat teacher got prompts (issue #56:
    # the released MOPD subset holds no chat row, so the stage also reads rlhf_train, and
    # cascade.config refuses a stage domain none of its datasets can hold).
    # All six paper values changed on purpose with the papers' reward defaults (issue #56):
    # Cascade 1's RLHF reward carries the mixed-language penalty, Cascade 2's IF domain is
    # scored by verifiers.ifbench (every instruction id of the release), and each recipe names
    # the rewards that stand in for the paper's (config.domains.<d>.stand_in): the rewards,
    # hence the runs, differ, so an earlier workdir must not resume under them.
    # All six changed again on purpose with MoE RL stability on the fast path (issue #56):
    # every GRPO and agentic stage corrects the sampler/trainer gap with TIS at cap 2
    # (configs/_recipes.py correct_mismatch), and Cascade 2's RL stages replay the rollouts'
    # routing (replay_routing): the updates differ, so an earlier workdir must not resume.
    # Cascade 2 on H200 nodes changed on purpose too when GPU meshes got a sequence axis
    # ((1, H, 1, 8, 1), the experts over 'sequence', the papers' 256K / 98K / 118K lengths
    # instead of the node's caps); 2xh200x8 and 4xh200x8 are new presets.
    # All four Cascade 2 values changed on purpose at the paper's RL lengths (issue #56: "responses
    # up to ~49K tokens"): IF-RL, the side and main RLHF runs and long-context RL generate 49,152
    # tokens instead of our 16,384, so an earlier workdir must not resume under them.
    ('nemotron_cascade2', None): 'a4d9d979b59b56da',
    ('nemotron_cascade2', 'hardware=h200x8'): 'daad73bacef5e666',
    ('nemotron_cascade2', 'hardware=2xh200x8'): 'c10920defdf5b558',
    ('nemotron_cascade2', 'hardware=4xh200x8'): '889f08c42ab7d41b',
    ('nemotron_cascade_14b', None): 'ebce306388ed5743',
    ('nemotron_cascade_14b', 'hardware=h200x8'): '2d33d15bb6852754',
    ('nemotron_cascade_8b', None): '2ef78b3c6c2b3864',
    ('nemotron_cascade_8b', 'hardware=h200x8'): '8c40baf5b5c88b9f',
    ('tiny', f'drop=if_rl,{_ROOT}'): 'e7879f2d6a23fae4',
    ('tiny', f'order=cascade2,{_ROOT}'): '02884f4ad58c7955',
    ('tiny', _ROOT): '1fa02c65dc24423e',
    ('tiny', f'smoke,{_ROOT}'): '41d6498efc277b7c',
    ('tiny', f'smoke,seed=3,eval_every=2,{_ROOT}'): '7ad2a1f40c3513ec',
    ('tiny_agentic', _ROOT): 'fe628a1796b90de3',
    ('tiny_agentic', f'smoke,{_ROOT}'): '8a487a93b5f81e5e',
    ('tiny_blended', _ROOT): '764944f03c398c26',
    ('tiny_blended', f'smoke,{_ROOT}'): 'd5a3286241fbacb0',
    ('tiny_mopd', _ROOT): '26317ca6f6ba6ce8',
    ('tiny_mopd', f'smoke,{_ROOT}'): '97564c57e5a48810',
}


@pytest.mark.parametrize('name,arg', sorted(PINNED, key=str), ids=lambda x: str(x))
def test_shipped_config_hashes_are_pinned(name, arg):
  config = importlib.import_module(f'configs.{name}').get_config(arg)
  assert checkpoint.config_hash(config) == PINNED[(name, arg)]
  # The run hashes the plan's plain-dict form of the config (it never reads the ConfigDict
  # after validating it): the same value.
  plan = config_lib.validate(config)
  assert checkpoint.config_hash(plan.source) == PINNED[(name, arg)]
  assert checkpoint.config_for_hash(plan.source) == checkpoint.config_for_hash(config)
