"""launch.plan's rooms: the package's docstring lists every one, each imports only the rooms listed
before it (so the planner reads top to bottom), and `python -m launch.plan --help` still shows
the command's own docstring and flags."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from launch import plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAN = ROOT / 'launch' / 'plan'


def listed_rooms() -> list[str]:
  """The rooms in the order the package's docstring lists them."""
  return re.findall(r'^  (\w+)\.py ', plan.__doc__, re.M)


def room_imports(room: str) -> set[str]:
  """The launch.plan rooms `room` imports, at module level or inside a function."""
  out = set()
  for node in ast.walk(ast.parse((PLAN / f'{room}.py').read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == 'launch.plan':
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('launch.plan.'):
      out.add(node.module.split('.')[2])
    elif isinstance(node, ast.Import):
      out.update(a.name.split('.')[2] for a in node.names if a.name.startswith('launch.plan.'))
  return out


def test_the_docstring_lists_every_room():
  rooms = {p.stem for p in PLAN.glob('*.py')} - {'__init__', '__main__'}
  assert sorted(listed_rooms()) == sorted(rooms)


def test_each_room_imports_only_the_rooms_before_it():
  order = listed_rooms()
  for i, room in enumerate(order):
    later = room_imports(room) - set(order[:i])
    assert not later, f'launch/plan/{room}.py imports {sorted(later)}, listed after it'


def test_the_check_sees_an_import_of_a_later_room(tmp_path, monkeypatch):
  (tmp_path / 'results.py').write_text('def f():\n  from launch.plan import cli\n')
  monkeypatch.setattr(sys.modules[__name__], 'PLAN', tmp_path)
  assert room_imports('results') == {'cli'}


@pytest.mark.heavy
def test_help_shows_the_commands_docstring_and_flags():
  # (absl exits with status 1 after --help.)
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  proc = subprocess.run([sys.executable, '-m', 'launch.plan', '--help'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.stdout.startswith(plan.__doc__.splitlines()[0])
  for flag in ('--backend', '--device_memory_gib', '--[no]eval', '--report', '--[no]sampler',
               '--stages', '--[no]time_only', '--[no]train'):
    assert f'  {flag}:' in proc.stdout, flag
