"""The tiny multi-domain world: generated tasks for a CPU-sized Cascade RL demo.

Five domains (chat/RLHF, instruction following, math, code, SWE), each with a
train split and a disjoint held-out split, gold answers for thinking and
instruct modes, and a SentencePiece tokenizer trained on the world's text.
Nothing is downloaded; everything follows from a seed.

  from cascade.tiny_world import build as world_build
  world_build.build(seed=0, root='runs/tiny_world')   # the demo's world, cached per seed
  from cascade.tiny_world import world
  paths = world.write('/tmp/w', seed=0, sft=100)       # any sizes, written as asked

build.py is what the demo configs name as their `prepare` step; world.py
writes the files, common.py has the record formats, one module per domain
generates its problems. Importing the package imports none of them.
"""
