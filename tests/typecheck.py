"""The type check CI runs: mypy over the tessera package, with pyproject.toml's [tool.mypy].

mypy finds a package's modules on disk under their import names, as lint-imports does. The folders install
as one namespace (runtime/ -> tessera, topology/ -> tessera.topology, ...: pyproject's
[tool.setuptools.package-dir]), which an editable install maps in an import hook only, so mypy run in the
checkout would see `runtime` and `topology`, not `tessera` and `tessera.topology`: the imports between them
would not resolve. So this script lays the installed layout out in a temporary directory with
tests/test_layering.py's `link_tree` (real folders, each file a symlink to its source) and runs
`mypy -p tessera` there. CI runs it after the layering contracts: `python tests/typecheck.py`, whose exit
status is mypy's. Not a pytest module (its name does not start with test_): a full mypy run takes tens of
seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_layering import ROOT, link_tree  # noqa: E402  (beside this file, not a package)


def typecheck(tree: Path, config: Path = ROOT / "pyproject.toml", *args: str) -> subprocess.CompletedProcess:
    """mypy over the package `tessera` laid out in `tree` (its working directory and MYPYPATH: mypy reads
    the modules there, not through the editable install's import hook)."""
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config), "-p", "tessera", *args]
    env = {**os.environ, "MYPYPATH": str(tree)}
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = typecheck(link_tree(Path(tmp)), ROOT / "pyproject.toml", *argv)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.returncode


if __name__ == "__main__":  # CI: mypy's report, and its exit status
    sys.exit(main(sys.argv[1:]))
