"""The path layer on local paths: whole-file writes, copies, moves, append files, clear errors.

The same operations against a Cloud Storage emulator: tests/cascade/test_gcs.py.
"""

import os
import subprocess
import sys

import pytest

from foundation import paths


def test_join_parent_and_scheme():
  assert paths.join('gs://b/run', 'stages', 'x') == 'gs://b/run/stages/x'
  assert paths.join('runs/a', 'b') == os.path.join('runs/a', 'b')
  assert paths.parent('gs://b/run/ckpt') == 'gs://b/run'
  assert paths.parent('/tmp/x/ckpt') == '/tmp/x'
  assert paths.is_remote('gs://b/x') and not paths.is_remote('/tmp/gs:/b')
  # A local path is made absolute for Orbax; a remote one is kept as given (not ./gs:/b/x).
  assert os.fspath(paths.absolute('gs://b/x')) == 'gs://b/x'
  assert os.fspath(paths.absolute('rel/x')) == os.path.abspath('rel/x')


def test_unsupported_scheme_is_one_clear_line():
  with pytest.raises(paths.PathError, match=r'^s3://b/x: unsupported scheme s3://'):
    paths.write_text('s3://b/x', 'hi')
  with pytest.raises(paths.PathError, match=r'^gcs://b/x: unsupported scheme'):
    paths.exists('gcs://b/x')


def test_write_is_whole_and_leaves_no_temporary_file(tmp_path):
  p = tmp_path / 'a' / 'b.json'
  paths.write_json(p, {'x': 1})
  assert paths.read_json(p) == {'x': 1}
  paths.write_text(p, 'new')
  assert p.read_text() == 'new'
  assert os.listdir(p.parent) == ['b.json']
  assert paths.read_json(tmp_path / 'missing.json', 'dflt') == 'dflt'


def test_copy_move_remove_and_list(tmp_path):
  src = tmp_path / 'src'
  paths.write_text(src / 'config.json', '{}')
  paths.write_bytes(src / 'sub' / 'w.bin', b'\0\1')
  paths.copy_tree(src, tmp_path / 'dst', last=('config.json',))
  assert (tmp_path / 'dst' / 'sub' / 'w.bin').read_bytes() == b'\0\1'
  assert paths.listdir(tmp_path / 'dst') == ['config.json', 'sub']
  assert paths.listdir(tmp_path / 'none') == []
  paths.move_tree(tmp_path / 'dst', tmp_path / 'moved' / 'here')
  assert not (tmp_path / 'dst').exists()
  assert (tmp_path / 'moved' / 'here' / 'config.json').read_text() == '{}'
  paths.remove(tmp_path / 'moved' / 'here' / 'config.json')
  paths.remove(tmp_path / 'moved' / 'here' / 'config.json')        # gone already: fine
  paths.rmtree(tmp_path / 'moved')
  assert not (tmp_path / 'moved').exists()


def test_local_file_and_target_are_the_path_itself(tmp_path):
  p = tmp_path / 'f.bin'
  with paths.local_target(p) as local:
    assert local == os.fspath(p)
    with open(local, 'wb') as f:
      f.write(b'abc')
  with paths.local_file(p) as local:
    assert local == os.fspath(p) and open(local, 'rb').read() == b'abc'


def test_append_file_appends_across_opens(tmp_path):
  p = tmp_path / 'm.jsonl'
  f = paths.AppendFile(p)
  f.write('1\n')
  assert p.read_text() == '1\n'            # local: durable at once
  f.close()
  f = paths.AppendFile(p)
  f.write('2\n')
  f.close()
  assert p.read_text() == '1\n2\n'


def test_gs_without_gcsfs_says_what_to_install():
  code = ("import sys; sys.modules['gcsfs'] = None\n"
          "from foundation import paths\n"
          "try:\n  paths.write_text('gs://b/x', 'a')\n"
          "except paths.PathError as e:\n  print(e)\n")
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=repo,
                       env=dict(os.environ, PYTHONPATH=repo), timeout=120).stdout
  assert out.strip() == "gs://b/x: cannot write it: gs:// paths need gcsfs: pip install -e '.[gcs]'"
