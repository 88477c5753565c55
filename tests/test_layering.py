"""The layering of docs/repository.md ("What may import what"), checked by the import-linter contracts in
pyproject.toml ([tool.importlinter]): the runtime > parallel > models > kernels | topology; parallel sees specs,
never a family's file; topology imports no torch (but for the DeviceMesh side); no import cycles.

lint-imports finds a package's modules on disk under its import name. The folders install as one namespace
(runtime/ -> tessera, topology/ -> tessera.topology, ...: pyproject's [tool.setuptools.package-dir]), which
an editable install maps in an import hook only, so lint-imports run in the checkout would see runtime/
alone. `link_tree` lays the installed layout out in a temporary directory (real folders, each file a
symlink to its source) and `lint` runs lint-imports there with pyproject.toml. CI runs this file before
pytest: `python tests/test_layering.py`, whose exit status is lint-imports'.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> source folder, from pyproject's [tool.setuptools.package-dir]."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def link_tree(dest: Path, root: Path = ROOT) -> Path:
    """The installed layout of the packages under `dest` (tessera/, tessera/topology/, ...), each .py file a
    symlink to its source; returns `dest`."""
    for name, folder in package_dirs(root).items():
        for source in folder.rglob("*.py"):
            if "__pycache__" in source.parts:
                continue
            target = dest.joinpath(*name.split("."), source.relative_to(folder))
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(source)
    return dest


def lint(tree: Path, config: Path = ROOT / "pyproject.toml", *args: str) -> subprocess.CompletedProcess:
    """lint-imports over the layout in `tree` (it puts its working directory first on sys.path, ahead of the
    editable install's import hook)."""
    cmd = [
        sys.executable,
        "-c",
        "from importlinter.cli import lint_imports_command; lint_imports_command()",
        "--config",
        str(config),
        "--no-cache",
        "--no-logo",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


_CYCLES = """
import itertools, grimp
g = grimp.build_graph("tessera", cache_dir=None, exclude_type_checking_imports=True)
for package in sorted(m for m in g.modules if g.find_children(m)):
    for a, b in itertools.combinations(sorted(g.find_children(package)), 2):
        there = g.find_shortest_chain(a, b, as_packages=True)
        back = there and g.find_shortest_chain(b, a, as_packages=True)
        if there and back:
            print(f"  {a} <-> {b}: " + " -> ".join(there) + "; " + " -> ".join(back))
"""


def cycles(tree: Path) -> str:
    """Each pair of sibling modules that import each other (directly or not), with the two chains: the
    acyclic_siblings contract names only the imports that would break its cycles."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", _CYCLES], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    return out.stdout + out.stderr[-2000:]


# ----------------------------------------------------------------------------- tests
def test_the_layering_contracts_hold(tmp_path):
    import pytest

    pytest.importorskip("importlinter")
    tree = link_tree(tmp_path)
    out = lint(tree)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:] + "\ncycles:\n" + cycles(tree)


def test_the_contracts_catch_a_torch_import_in_topology_and_an_upward_import(tmp_path):
    """The check sees the real layout: a topology module importing torch, and one importing the runtime,
    break the contracts (each by name)."""
    import pytest

    pytest.importorskip("importlinter")
    tree = link_tree(tmp_path)
    (tree / "tessera" / "topology" / "_probe.py").write_text("import torch\nfrom tessera import config\n")
    out = lint(tree, ROOT / "pyproject.toml", "--contract", "layers", "--contract", "topology-torch-free")
    assert out.returncode != 0
    assert "tessera.topology._probe -> torch" in out.stdout, out.stdout[-4000:]
    assert "tessera.topology._probe -> tessera.config" in out.stdout, out.stdout[-4000:]


def library_files(root: Path = ROOT) -> list[Path]:
    """Every module of the installed package, from the folders pyproject maps into it (their subpackages too)."""
    return sorted({f for folder in package_dirs(root).values() for f in folder.rglob("*.py")})


def test_no_two_library_files_share_a_name_and_none_is_over_600_lines():
    """A file's name says what it holds: no second config.py, data.py, plan.py ... in another folder (an
    __init__.py aside), so a name in a traceback or a review is one file; and none grows past 600 lines."""
    seen: dict[str, Path] = {}
    for f in library_files():
        if f.name == "__init__.py":
            continue
        assert f.name not in seen, f"{f.relative_to(ROOT)} and {seen[f.name].relative_to(ROOT)} share a name"
        seen[f.name] = f
        lines = len(f.read_text().splitlines())
        assert lines <= 600, f"{f.relative_to(ROOT)} has {lines} lines; split it by what it does"
    assert len(seen) > 100  # the walk saw the library


def module_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Every library module -> the library modules it imports anywhere in its file: at the top, inside a
    function (a lazy import) or under `if TYPE_CHECKING:` (annotations), each read from the source's syntax."""
    files: dict[str, Path] = {}
    for name, folder in package_dirs(root).items():
        for f in folder.rglob("*.py"):
            if "__pycache__" not in f.parts:
                parts = list(f.relative_to(folder).with_suffix("").parts)
                files[".".join([name] + (parts[:-1] if parts[-1] == "__init__" else parts))] = f

    def known(name: str) -> str | None:  # a module, or the nearest enclosing one (`from pkg import name`)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, f in files.items():
        package = module if f.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets.update(known(f"{base}.{a.name}") for a in node.names)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_back_even_lazily_or_for_annotations():
    """import-linter's contract reads run-time imports (TYPE_CHECKING ones excluded) between siblings; a
    circle closed by an annotation-only import and a function-level one is still a circle a reader follows:
    none, at module level, counting every import written."""
    graph = module_imports()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk saw the library's imports
    assert import_cycles(graph) == []
    # the finder finds one: the layout importing back the module that annotates it
    planted = {**graph, "tessera.topology.layout": graph["tessera.topology.layout"] | {"tessera.topology.mesh"}}
    assert ["tessera.topology.layout", "tessera.topology.mesh"] in import_cycles(planted)


if __name__ == "__main__":  # CI: the contracts' report, and lint-imports' exit status
    with tempfile.TemporaryDirectory() as tmp:
        tree = link_tree(Path(tmp))
        result = lint(tree, ROOT / "pyproject.toml", *sys.argv[1:])
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.returncode:
            found = cycles(tree)
            sys.stdout.write(f"Sibling modules that import each other:\n{found}" if found.strip() else "")
        sys.exit(result.returncode)
