"""docs/repository.md, the repository map, names every module of the package, so a newcomer walking it finds
each file where the page says it lives."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = [
    "runtime",
    "runtime/training",
    "runtime/commands",
    "runtime/metrics",
    "runtime/testing",
    "topology",
    "parallel",
    "kernels",
    "models",
]


def test_the_map_names_every_module():
    page = (ROOT / "docs" / "repository.md").read_text()
    modules = [f for folder in FOLDERS for f in sorted((ROOT / folder).glob("*.py")) if f.name != "__init__.py"]
    assert len(modules) > 80
    missing = [str(f.relative_to(ROOT)) for f in modules if f"`{f.name}`" not in page]
    assert not missing, f"docs/repository.md does not name: {missing}"


def test_the_suites_lists_of_modules_name_test_files_that_exist():
    """tests/conftest.py's module lists (the slow tier, the longest-first order, the rank-heavy modules one
    worker runs) name files that exist: a stale name would leave its file in the wrong tier or place silently."""
    import conftest

    files = {f.stem for f in (ROOT / "tests").glob("test_*.py")}
    for name in ("SLOW_MODULES", "LONGEST_FIRST", "RANK_HEAVY"):
        stale = sorted(set(getattr(conftest, name)) - files)
        assert not stale, f"tests/conftest.py {name} names no test file: {stale}"
