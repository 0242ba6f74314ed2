"""The tiny world's evaluation suites: each domain's held-out prompts under one protocol.

`tiny_chat`, `tiny_if`, `tiny_math`, `tiny_code` and `tiny_swe` read
`<world>/<domain>/heldout.jsonl` (the world's directory is their data root, e.g.
runs/tiny_world/seed0) and grade with the domain's evaluation verifier, as the
matrix's held-out columns do; what they add is the papers' protocol machinery:
SAMPLES samples per prompt, avg@k with its standard error, pass@k, maj@k for math.
Importing `tiny_world` registers them (`cascade.suites.register`), as it registers
the chat verifier; configs/tiny.py scores them after every stage
(config.eval.suites), and

  python -m cascade.evaluate --imports=tiny_world --checkpoint=runs/tiny \
      --suites=tiny_chat,tiny_if,tiny_math,tiny_code,tiny_swe --data_dir=runs/tiny_world/seed0

scores a finished run's last policy on them.

The protocol is the matrix's sampling (the paper's temperature 0.6 and top-p 0.95,
instruct mode, 48 new tokens: every domain's longest gold answer fits) with four
samples per prompt instead of two, so pass@4 says how often a domain is solved
at all.
"""

from cascade.suites import base
from cascade.suites import tiny
from tiny_world import chat

SAMPLES = 4
# launch.plan's bound on a rendered prompt where it does not measure the world's files: the
# longest instruct-mode prompt of any domain is 82 tokens (swe), in its 96-token bucket.
PROMPT_TOKENS = 96
PROTOCOL = base.Protocol(samples=SAMPLES, temperature=0.6, top_p=0.95, max_new_tokens=48,
                         thinking=False, pass_ks=(SAMPLES,))


def _suite(name: str, title: str, domain: str, verifier: str, **kw) -> tiny.WorldSuite:
  return tiny.WorldSuite(
      name=name, title=title, domain=domain, verifier=verifier,
      source=f'the tiny world (tiny_world/world.py), {domain}/heldout.jsonl',
      files=(f'{domain}/heldout.jsonl',), protocol=PROTOCOL, prompt_tokens=PROMPT_TOKENS,
      metric=f'avg@{SAMPLES}', **kw)


SUITES = (
    _suite('tiny_chat', 'Tiny chat (hidden quality rule)', 'chat', chat.VERIFIER_NAME),
    _suite('tiny_if', 'Tiny instruction following', 'instruction_following',
           'instruction_following'),
    _suite('tiny_math', 'Tiny math', 'math', 'math', answer_info='pred'),
    _suite('tiny_code', 'Tiny code', 'code', 'code'),
    _suite('tiny_swe', 'Tiny SWE', 'swe', 'swe'),
)
