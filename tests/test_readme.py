"""The README stays true: its quick start runs as written (under torchrun, 16 CPU ranks) and is the
shipped examples/quickstart.py."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quick_start_is_the_example_and_runs_as_written(tmp_path):
    code = _quick_start()
    example = (ROOT / "examples" / "quickstart.py").read_text()
    assert code.strip() in example, "README quick start and examples/quickstart.py differ"
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "16", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], out.stdout


def test_readme_commands_use_the_namespace():
    readme = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for bare in ("from topology", "from models", "from parallel", "from kernels", "parallel.cli"):
        assert bare not in readme, bare


def test_the_schedule_snippet_runs_and_draws_the_timeline_shown():
    import contextlib
    import io

    readme = (ROOT / "docs" / "pipelines.md").read_text()
    section = readme.split("Pipeline schedules are plain values", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```\n(.*?)```", section.split("```python", 1)[1].split("```", 1)[1], re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README schedule snippet", "exec"), {})
    drawn = out.getvalue().splitlines()
    assert len(drawn) == 4 and all(line in shown.splitlines() for line in drawn), out.getvalue()
    from tessera.parallel.pipeline import build_schedule
    from tessera.parallel.schedule import render, simulate

    one_f_one_b = render(simulate(build_schedule("1f1b", 4, 8)), width=3).splitlines()
    assert all(line in shown.splitlines() for line in one_f_one_b)


def test_the_property_testing_example_runs_as_written_through_the_plugin(tmp_path):
    """The README's test file for a user's model, run by pytest in a fresh directory: the fixtures come
    from the installed plugin (the pytest11 entry point), 20 hypothesis layouts pass."""
    section = (ROOT / "docs" / "property-testing.md").read_text().split("## Property-testing your own model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "max_examples=20" in code
    (tmp_path / "test_my_model.py").write_text(code)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--hypothesis-show-statistics",
            "test_my_model.py",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
    passing = re.search(r"(\d+) passing, 0 failing", out.stdout)
    assert passing and int(passing.group(1)) >= 20, out.stdout[-2000:]
