"""The tiny multi-domain world: generated tasks for a CPU-sized Cascade RL demo.

Five domains (chat/RLHF, instruction following, math, code, SWE), each with a
train split and a disjoint held-out split, gold answers for thinking and
instruct modes, and a SentencePiece tokenizer trained on the world's text.
Nothing is downloaded; everything follows from a seed.

  from tiny_world import build as world_build
  world_build.build(seed=0, root='runs/tiny_world')   # the demo's world, cached per seed
  from tiny_world import world
  paths = world.write('/tmp/w', seed=0, sft=100)       # any sizes, written as asked

The world is a user of the framework, like a user's own package: the framework
never imports it. Importing the package registers what the world adds to the
framework's registries, through their public `register`: the verifier
'tiny_chat_quality' (chat.QualityVerifier, the chat domain's true quality
score) and the evaluation suites of suites.py (tiny_chat, tiny_if, tiny_math,
tiny_code, tiny_swe: each domain's held-out prompts under the papers' protocol
machinery). So a config that names them imports `tiny_world` first (the tiny
configs do); its tool-use and SWE-agent tasks run in the built-in environments.

build.py is what the demo configs name as their `prepare` step; world.py
writes the files, common.py has the record formats, one module per domain
generates its problems. Importing the package imports chat.py (for its
verifier, which needs no tokenizer library) and suites.py, and no other of them.
"""

from cascade import suites as suites_lib
from tiny_world import chat
from tiny_world import suites
import verifiers

verifiers.register(chat.VERIFIER_NAME, chat.QualityVerifier)
for _suite in suites.SUITES:
  suites_lib.register(_suite)
