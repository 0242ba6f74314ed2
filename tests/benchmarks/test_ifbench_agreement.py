"""benchmarks.ifbench_agreement end to end against stand-in references (our own checks behind
the registry interfaces of allenai/IFBench and open-instruct's IFEvalG): every id of both
families is generated, scored on both sides and written up. The real references need their own
venv (the benchmark's docstring); docs/ifbench_agreement.md is that run."""

import json
import pathlib
import subprocess
import sys

from verifiers import ifbench
from verifiers import iftrain

ROOT = pathlib.Path(__file__).resolve().parents[2]

_REGISTRY = '''
import sys
sys.path.insert(0, {root!r})
from verifiers import ifbench

class _Check:
  def __init__(self, instruction_id):
    self.id = instruction_id
  def build_description(self, **kwargs):
    self.kwargs = kwargs
  def check_following(self, value):
    return ifbench.follows([self.id], [self.kwargs], value)[0]

INSTRUCTION_DICT = {{i: _Check for i in {ids}}}
'''


def _stand_in(root: pathlib.Path) -> pathlib.Path:
  from tests.verifiers import test_ifbench  # pylint: disable=g-import-not-at-top
  src = root / 'src'
  (src / 'ifbench').mkdir(parents=True)
  (src / 'ifbench' / '__init__.py').write_text('')
  (src / 'ifbench' / 'instructions_registry.py').write_text(
      _REGISTRY.format(root=str(ROOT), ids='ifbench.INSTRUCTIONS'))
  # open-instruct's layout: open_instruct/IFEvalG/instructions_registry.py (namespace packages).
  evalg = root / 'open_instruct' / 'open_instruct' / 'IFEvalG'
  evalg.mkdir(parents=True)
  (evalg / 'instructions_registry.py').write_text(
      _REGISTRY.format(root=str(ROOT), ids='iftrain.INSTRUCTIONS').replace(
          'from verifiers import ifbench', 'from verifiers import ifbench, iftrain'))
  (src / 'data').mkdir()
  rows = [{'key': k, 'prompt': 'p', 'instruction_id_list': [iid], 'kwargs': [kwargs]}
          for k, (iid, (kwargs, _, _)) in enumerate(sorted(test_ifbench.CASES.items()))]
  (src / 'data' / 'IFBench_test.jsonl').write_text('\n'.join(map(json.dumps, rows)) + '\n')
  return src


def test_agreement_benchmark_runs_and_writes_its_page(tmp_path):
  src = _stand_in(tmp_path)
  doc = tmp_path / 'ifbench_agreement.md'
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.ifbench_agreement', f'--ref_python={sys.executable}',
       f'--ref_src={src}', f'--iftrain_src={tmp_path / "open_instruct"}',
       f'--nltk_data={tmp_path / "nltk"}', '--per_id=6', f'--doc={doc}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  totals = [line.split()[:3] for line in out.splitlines() if line.startswith('all ')]
  assert totals == [['all', str(58 * (6 + 21)), '0'], ['all', str(29 * (6 + 21)), '0']]
  page = doc.read_text()
  for iid in [*ifbench.INSTRUCTIONS, *iftrain.INSTRUCTIONS]:
    assert f'\n{iid} ' in page
  # The stand-in is our check itself: full agreement, nothing to explain.
  assert '100.0' in page and 'UNEXPLAINED' not in page and '### Why they disagree' in page
