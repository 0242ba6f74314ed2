"""README's "Bring your own" recipes, run as a new user would: the files its code blocks
name are written as they stand, the commands its bash blocks show are run as they stand.

The verifier-and-dataset recipe is checked in two tiers: the default one writes the files,
runs the data script and checks the config and the verifier without training (seconds); the
heavy one runs both README commands end to end, then the model recipe's command, which starts
RL from the first run's exported SFT policy (a few minutes on 2 CPU cores).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import readme_numbers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERIFIER_SECTION = 'Your own verifier and dataset'
MODEL_SECTION = 'Your own model'
# '# make_data.py: ...' on a block's first line names the file the block is.
_FILE_LINE = re.compile(r'#\s*([\w.-]+\.py):')


def _readme():
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    return f.read()


def _section(heading):
  """The text under README's `### heading` (benchmarks.readme_numbers reads it the same way)."""
  return readme_numbers.section(_readme(), heading)


def _blocks(section, lang):
  return readme_numbers.code_blocks(section, lang)


def _files(section):
  """{file name: contents} of the section's python blocks, each named on its first line."""
  out = {}
  for block in _blocks(section, 'python'):
    m = _FILE_LINE.match(block)
    assert m, f'README, {section.splitlines()[0]!r}: a python block names no file: {block[:80]!r}'
    out[m.group(1)] = block
  return out


def _commands(section):
  return [line.strip() for block in _blocks(section, 'bash') for line in block.splitlines()
          if line.strip() and not line.strip().startswith('#')]


def _env():
  """A user's shell with the venv active: its `python` first on PATH, one CPU device."""
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _run(command, cwd, timeout):
  p = subprocess.run(command, shell=True, cwd=cwd, env=_env(), capture_output=True, text=True,
                     timeout=timeout)
  assert p.returncode == 0, f'{command}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}'
  return p


def _write_recipe(tmp_path):
  files = _files(_section(VERIFIER_SECTION))
  assert set(files) == {'make_data.py', 'reverse_verifier.py', 'my_config.py'}, sorted(files)
  for name, text in files.items():
    (tmp_path / name).write_text(text)


def test_the_readme_is_a_short_guide_whose_python_blocks_are_all_run():
  text = _readme()
  assert len(text.splitlines()) <= 300
  blocks = _blocks(text, 'python')
  recipe = _blocks(_section(VERIFIER_SECTION), 'python')
  # The recipe's files run here; the `Dice` environment in tests/cascade/test_episodes.py.
  others = [b for b in blocks if b not in recipe]
  assert len(recipe) == 3 and len(others) == 1 and 'class Dice(base.Environment)' in others[0]


def test_the_verifier_recipe_writes_its_data_and_its_config_and_verifier_check_out(tmp_path):
  """`python make_data.py` as README shows it, then the config validated and the verifier
  scoring by its rule, in a fresh process (the config registers 'reverse' on import)."""
  _write_recipe(tmp_path)
  commands = _commands(_section(VERIFIER_SECTION))
  assert commands[0] == 'python make_data.py'
  _run(commands[0], tmp_path, timeout=300)
  rows = [json.loads(l) for l in (tmp_path / 'data' / 'train.jsonl').read_text().splitlines()]
  assert len(rows) == 200 and all(
      r['metadata']['answer'] == re.search(r'Reverse (\d{3})\.', r['messages'][0]['content'])
      .group(1)[::-1] for r in rows)
  assert (tmp_path / 'data' / 'tok.model').stat().st_size > 0
  check = '''
import json
import my_config
import verifiers
from cascade import config as config_lib

plan = config_lib.validate(my_config.get_config())
v = verifiers.get('reverse')
got = [r.reward for r in v.score([verifiers.Sample('p', '321', {'answer': '321'}),
                                  verifiers.Sample('p', ' 321\\n', {'answer': '321'}),
                                  verifiers.Sample('p', '123', {'answer': '321'}),
                                  verifiers.Sample('p', '<think>321', {'answer': '321'})])]
try:
  verifiers.validate('reverse', {'answer': 321}, 'data/train.jsonl:7')
  bad = None
except ValueError as e:
  bad = str(e)
print(json.dumps(dict(domains=sorted(plan.domains), stages=[s.name for s in plan.stages],
                      kinds=[s.kind for s in plan.stages], rewards=got, bad=bad)))
'''
  (tmp_path / 'check.py').write_text(check)
  p = _run('python check.py', tmp_path, timeout=300)
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out['domains'] == ['reverse']
  assert out['stages'] == ['sft', 'reverse_rl'] and out['kinds'] == ['sft', 'grpo']
  assert out['rewards'] == [1.0, 1.0, 0.0, 0.0]
  assert out['bad'] == "data/train.jsonl:7: metadata['answer'] must be a string"


def _rule(sample):
  """The recipe verifier's reward, recomputed from a logged rollout."""
  digits = re.search(r'Reverse (\d{3})\.', sample['prompt']).group(1)
  answer = sample['completion'].replace('<|im_end|>', '')
  return float(answer.strip() == digits[::-1])


@pytest.mark.heavy
def test_the_verifier_and_model_recipes_run_as_written(tmp_path):
  """README's commands end to end: SFT then GRPO scored by the new verifier, whose reward the
  rollouts carry, and RL gains what README's target says; then RL only, from the first run's
  exported SFT policy, which gains as much (about 4 minutes on 2 loaded cores)."""
  _write_recipe(tmp_path)
  commands = _commands(_section(VERIFIER_SECTION))
  assert commands == ['python make_data.py',
                      'python -m cascade.main --config=my_config.py --workdir=runs/reverse']
  for command in commands:
    p = _run(command, tmp_path, timeout=900)
  assert '| reverse_rl | reverse |' in p.stdout
  res = json.loads((tmp_path / 'runs' / 'reverse' / 'results.json').read_text())
  assert res['domains'] == ['reverse'] and res['stages'] == ['sft', 'reverse_rl']
  (sft,), (rl,) = res['scores']
  assert 0 <= sft <= 100 and 0 <= rl <= 100
  # README states this target for every seed (benchmarks/readme_numbers.py checks it over 3).
  assert rl - sft >= readme_numbers.RECIPE_GAIN, (sft, rl)
  samples = [json.loads(l) for l in
             (tmp_path / 'runs' / 'reverse' / 'samples.jsonl').read_text().splitlines()]
  assert samples and {s['domain'] for s in samples} == {'reverse'}
  for s in samples:     # the logged reward is the recipe's rule, with its reason
    assert s['reward'] == _rule(s), s
    assert s['info']['reason'] == ('reversed' if s['reward'] else 'not reversed'), s
  assert any(s['reward'] == 1.0 for s in samples)

  [command] = _commands(_section(MODEL_SECTION))
  assert command.startswith('python -m cascade.main --config=my_config.py:runs/reverse/stages/')
  p = _run(command, tmp_path, timeout=900)
  workdir = tmp_path / re.search(r'--workdir=(\S+)', command).group(1)
  res2 = json.loads((workdir / 'results.json').read_text())
  assert res2['stages'] == ['init', 'reverse_rl']
  (init,), (rl2,) = res2['scores']
  # The loaded checkpoint is the trained SFT policy (a fresh model scores about 0).
  assert init >= 20 and abs(init - sft) <= 5, (init, sft)
  assert rl2 - init >= readme_numbers.RECIPE_GAIN, (init, rl2)
