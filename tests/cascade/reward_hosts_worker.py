"""One process of test_reward_hosts' two-process test: RL draws scored across two JAX processes.

  python tests/cascade/reward_hosts_worker.py COORDINATOR PROCESS_ID OUT

Joins a 2-process JAX runtime on CPU (gloo), then runs three steps of a
dynamically filtered GRPO stage's draws (`cascade.kinds.rl.Draws.collect`)
with the stand-in sampler of tests/cascade/conftest.py. The verifiers differ
by process, as a flaky host's would: process 0's pays each right answer its
record's value; process 1's takes half a second per batch and then "times
out" on every sample (reward 0). A fourth step follows in which process 1's
verifier raises. Writes what each step decided, the rows each host scored
and the fourth step's error to OUT/<process id>.json.
"""

import importlib.util
import json
import os
import sys
import time
import types

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)

import jax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _fakes():
  spec = importlib.util.spec_from_file_location('reward_hosts_fakes',
                                                os.path.join(HERE, 'conftest.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class FlakyVerifier:
  """Process 1's verifier: slow and timing out, or (`failing`) unable to score at all."""

  def __init__(self):
    self.failing, self.seen = False, []

  def score(self, samples):
    if self.failing:
      raise RuntimeError('verifier workers could not start')
    self.seen += samples
    time.sleep(0.5)
    return [types.SimpleNamespace(reward=0.0, info={'reason': 'timed out after 1 s',
                                                    'id': s.metadata['id']}) for s in samples]


def main(coordinator, process_id, out_dir):
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, 2, int(process_id))
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from cascade.kinds import rl  # pylint: disable=g-import-not-at-top
  fakes = _fakes()
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a', 'b'], group_size=4, dynamic_filter=True,
                                          refill_cap=3)])
  st = plan.stages[0]
  recs = [fakes.record(d, i, (10 if d == 'a' else 30) + i) for d in 'ab' for i in range(8)]
  if jax.process_index() == 0:
    vs = {d: fakes.ValueVerifier(d) for d in plan.domains}
  else:
    vs = {d: FlakyVerifier() for d in plan.domains}
  ctx = types.SimpleNamespace(
      plan=plan, sample_cls=fakes.Sample, tokenizer=fakes.CharTokenizer(),
      sampler=fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                     right=lambda n, g: (n + g) % 3 != 0),
      verifiers=types.SimpleNamespace(train_verifier=vs.__getitem__),
      domain_index={'a': 0, 'b': 1})
  loader = readers.Loader(recs, 0, st.prompts_per_step)
  steps = []
  for step in range(3):
    draws = rl.Draws(ctx, st, loader, step, jax.random.key(step), None)
    _, rewards, valid, fill = draws.collect()
    m = {k: v for k, v in draws.metrics().items() if not k.endswith('_s')}
    steps.append({'rewards': rewards.tolist(), 'valid': valid.tolist(), 'fill': fill,
                  'metrics': m})
  out = {'steps': steps,
         'scored_here': sorted(s.metadata['id'] for v in vs.values() for s in v.seen)}
  for v in vs.values():
    v.failing = True
  try:
    rl.Draws(ctx, st, loader, 3, jax.random.key(3), None).collect()
  except RuntimeError as e:
    out['error'] = str(e)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f'{process_id}.json'), 'w') as f:
    json.dump(out, f)


if __name__ == '__main__':
  main(*sys.argv[1:])
