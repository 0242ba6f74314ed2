"""notebooks/quickstart.ipynb's install cell provides the sandbox: where `bwrap` is missing it
installs Debian's bubblewrap as root with apt-get (Colab), else prints how. The cell runs here in
a plain Python process (its IPython `%pip` line stubbed out: that branch is Colab's) against a
stand-in apt-get, on a PATH without bwrap."""

import os
import re
import subprocess
import sys

import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, 'notebooks', 'quickstart.ipynb')
HINT = 'bubblewrap (bwrap) is missing: `sudo apt-get install bubblewrap`'


def _install_cell() -> str:
  nb = nbformat.read(NOTEBOOK, as_version=4)
  [cell] = [c for c in nb.cells if c.cell_type == 'code' and 'find_root' in c.source]
  # IPython magics are not Python: each becomes `pass` at its indentation.
  return re.sub(r'(?m)^(\s*)%.*$', r'\1pass', cell.source)


def _run(tmp_path, with_apt: bool):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  log = tmp_path / 'apt.log'
  if with_apt:
    # Records its arguments; `install` puts a bwrap on the PATH, as the package would.
    (bin_dir / 'apt-get').write_text(
        '#!/bin/sh\n'
        f'echo "$DEBIAN_FRONTEND $*" >> {log}\n'
        f'case "$*" in *install*) printf "#!/bin/sh\\n" > {bin_dir}/bwrap; '
        f'/bin/chmod +x {bin_dir}/bwrap;; esac\n')
    (bin_dir / 'apt-get').chmod(0o755)
  env = dict(os.environ, PATH=str(bin_dir))          # no /usr/bin: no bwrap, no real apt-get
  env.pop('DEBIAN_FRONTEND', None)
  proc = subprocess.run([sys.executable, '-c', _install_cell()], cwd=os.path.join(REPO, 'notebooks'),
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout, (log.read_text().splitlines() if log.exists() else [])


@pytest.mark.skipif(os.geteuid() != 0, reason='the install branch is the root one')
def test_as_root_with_apt_get_the_cell_installs_bubblewrap(tmp_path):
  out, calls = _run(tmp_path, with_apt=True)
  assert calls == [' update -qq', 'noninteractive install -y -qq bubblewrap']
  assert HINT not in out and f'cascade checkout: {REPO}' in out


def test_without_apt_get_the_cell_says_how(tmp_path):
  out, calls = _run(tmp_path, with_apt=False)
  assert calls == [] and HINT in out and f'cascade checkout: {REPO}' in out
