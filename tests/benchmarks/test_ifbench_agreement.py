"""benchmarks.ifbench_agreement end to end against a stand-in reference (our own checks behind
the reference's registry interface): every id is generated, scored on both sides and written up.
The real reference needs its own venv (the benchmark's docstring); docs/ifbench_agreement.md
is that run."""

import json
import pathlib
import subprocess
import sys

from verifiers import ifbench

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

INSTRUCTION_DICT = {{i: _Check for i in ifbench.INSTRUCTIONS}}
'''


def _stand_in(root: pathlib.Path) -> pathlib.Path:
  from tests.verifiers import test_ifbench  # pylint: disable=g-import-not-at-top
  src = root / 'src'
  (src / 'ifbench').mkdir(parents=True)
  (src / 'ifbench' / '__init__.py').write_text('')
  (src / 'ifbench' / 'instructions_registry.py').write_text(_REGISTRY.format(root=str(ROOT)))
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
       f'--ref_src={src}', f'--nltk_data={tmp_path / "nltk"}', '--per_id=6', f'--doc={doc}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  assert out.strip().splitlines()[-1].split()[:3] == ['all', str(58 * (6 + 21)), '0']
  page = doc.read_text()
  for iid in ifbench.INSTRUCTIONS:
    assert f'\n{iid} ' in page
  # The stand-in is our check itself: full agreement, nothing to explain.
  assert '100.0' in page and 'UNEXPLAINED' not in page and '## Why they disagree' in page
