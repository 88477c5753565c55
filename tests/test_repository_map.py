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
