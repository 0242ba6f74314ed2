"""The tiny multi-domain world: generated tasks for a CPU-sized Cascade RL demo.

Five domains (chat/RLHF, instruction following, math, code, SWE), each with a
train split and a disjoint held-out split, gold answers for thinking and
instruct modes, and a SentencePiece tokenizer trained on the world's text.
Nothing is downloaded; everything follows from a seed.

  from cascade import tiny_world
  paths = tiny_world.build('runs/tiny/world', seed=0)

See world.py for the files and common.py for the record formats.
"""

from cascade.tiny_world.world import build, DOMAINS  # noqa: F401  (the package's API)
