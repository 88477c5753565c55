"""The README and the pages of docs/ stay true and runnable.

Every ```bash and ```python block of every page either runs here (a bash block's lines are `tessera`
commands, each run in a fresh directory with a short timeout; a plain block marked `<!-- output: ... -->`
right after it holds lines the command must print), or carries, on the line before it, why it does not:
`<!-- not run: REASON -->`, or `<!-- run by tests/test_x.py -->` for a block another test already runs (that
test must read the page). Beside them: the README stays short and links every page, every relative link
and anchor resolves, and docs/cli.md is what docs/gen_cli.py renders from the command's --help now."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_here

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUNNABLE = ("bash", "python")
MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")
README_MAX_LINES = 250


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the HTML comment on the line before the fence, if any
    output: list[str] | None = None  # the lines of a following `<!-- output -->` block

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, in order, each with the comment just before it."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            i += 1
            continue
        before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = MARKER.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(lines[i]) - len(lines[i].lstrip())
        code = "\n".join(ln[indent:] for ln in lines[i + 1 : end]) + "\n"
        found.append(Block(page, i + 1, stripped[3:].strip(), code, marker.group(1) if marker else None))
        i = end + 1
    for prev, block in zip(found, found[1:]):
        if block.marker is not None and block.marker.startswith("output") and prev.lang in RUNNABLE:
            prev.output = [ln.rstrip() for ln in block.code.splitlines() if ln.strip()]
    return found


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def _run_by(marker: str) -> list[str]:
    return re.findall(r"tests/test_\w+\.py", marker) if marker.startswith("run by ") else []


def _to_run() -> list[Block]:
    return [b for b in _all_blocks() if b.lang in RUNNABLE and b.marker is None]


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is the front door: move detail to docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert {p.name for p in DOCS.glob("*.md")} <= linked, "a page of docs/ that the README does not link"


def test_every_code_block_runs_here_or_says_why_not():
    problems = []
    for b in _all_blocks():
        if b.lang not in RUNNABLE:
            if b.marker is not None and not b.marker.startswith("output"):
                problems.append(f"{b.name}: a marker on a ```{b.lang or ''} block, which nothing runs")
            continue
        if b.marker is None:
            commands = [ln for ln in b.code.splitlines() if ln.strip()]
            if b.lang == "bash" and not all(ln.startswith("tessera ") for ln in commands):
                problems.append(f"{b.name}: a bash block runs here only if every line is a tessera command")
            continue
        if b.marker.startswith("not run:"):
            if len(b.marker.removeprefix("not run:").strip()) < 10:
                problems.append(f"{b.name}: 'not run' needs its reason")
            continue
        tests = _run_by(b.marker)
        if not tests:
            problems.append(f"{b.name}: marker {b.marker!r} is neither 'not run: REASON' nor 'run by tests/...'")
        page_name = b.page.name
        for test in tests:
            path = ROOT / test
            if not path.is_file():
                problems.append(f"{b.name}: {test} does not exist")
            elif page_name not in path.read_text():
                problems.append(f"{b.name}: {test} does not read {page_name}")
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_\[\]]|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.name}: {target}: no such heading in {dest.name}")
    assert not problems, "\n".join(problems)


REPO_FOLDERS = ("topology/", "parallel/", "kernels/", "models/", "runtime/", "tests/", "benchmarks/", "docs/", ".ci/")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)[\w.*/-]*[\w*/])" % "|".join(re.escape(f) for f in REPO_FOLDERS))


def test_every_repository_path_a_page_or_a_help_text_names_exists():
    """A path into the repository named in the README, a docs page or a flag's help (the config's sections) is
    there (a `*` in it: something matches); a page's anchor after `#` is one of its headings. Code blocks are
    left out: they run (above), and their paths may be a user's (`tessera tokenize ... docs/*.txt`)."""
    sources = [*PAGES, ROOT / "runtime" / "training" / "sections.py"]
    problems = []
    for source in sources:
        text = source.read_text()
        if source.suffix == ".md":
            text = re.sub(r"```.*?```", "", text, flags=re.S)
        for named in REPO_PATH.findall(text):
            path, _, anchor = named.rstrip(".").partition("#")
            if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                problems.append(f"{source.name}: {named}: no such path")
            elif anchor and path.endswith(".md") and anchor not in _anchors(ROOT / path):
                problems.append(f"{source.name}: {named}: no such heading in {path}")
    assert not problems, "\n".join(problems)


def test_the_cli_reference_is_what_the_command_prints_now():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_cli
    finally:
        sys.path.remove(str(DOCS))
    assert (DOCS / "cli.md").read_text() == gen_cli.render(), "docs/cli.md is stale: run python docs/gen_cli.py"
    written = {cmd for cmd, _ in gen_cli.pages()}
    assert {"tessera train", "tessera plan", "tessera memory", "tessera bench"} <= written


@pytest.mark.slow
@pytest.mark.parametrize("block", _to_run(), ids=lambda b: b.name)
def test_the_block_runs_as_written(block, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CALIBRATION", str(tmp_path / "calibration.json"))
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert out.returncode == 0, (block.name, out.stderr[-3000:])
    # a `tessera ...` line: the command's own main() in this process (tests/helpers.py: cli_here)
    for line in [ln for ln in block.code.splitlines() if ln.strip()] if block.lang != "python" else []:
        out = cli_here(*shlex.split(line)[1:], cwd=tmp_path)
        assert out.returncode == 0, (block.name, line, out.stderr[-3000:])
    if block.output:
        printed = [ln.rstrip() for ln in out.stdout.splitlines()]
        missing = [ln for ln in block.output if ln not in printed]
        assert not missing, (f"{block.name} shows lines its command no longer prints", missing, out.stdout)


def test_no_page_or_message_offers_an_install_that_fails():
    """Issue 65 item 13: `pip install "tessera-4d[data]"` fails in a fresh environment (the distribution is not on
    the package index); pages and messages give the form that works from a clone, pip install -e ".[data]"."""
    sources = [*PAGES, *(p for folder in ("runtime", "models", "parallel", "topology", "kernels", "benchmarks")
                         for p in (ROOT / folder).rglob("*.py"))]  # fmt: skip
    offered = [str(p.relative_to(ROOT)) for p in sources if "tessera-4d[" in p.read_text()]
    assert not offered, offered
