"""The README stays true: its quick start runs as written (16 CPU ranks, each as torchrun would start it) and
is the shipped examples/quickstart.py."""

import re
import subprocess
import sys
from pathlib import Path

from tessera.launching.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _as_a_torchrun_rank(code: str) -> str:
    """Run a script's code as written on this rank, whose process group the launcher has already started
    (RANK, WORLD_SIZE set as torchrun sets them): its own init_process_group and destroy_process_group
    calls find it so. What it prints is returned."""
    import contextlib
    import io

    import torch.distributed as dist

    started, ended = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "quickstart.py", "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = started, ended
    return printed.getvalue()


def test_the_quick_start_is_the_example_and_runs_as_written():
    """The code as written on 16 ranks. They are forked by tessera's launcher rather than started by torchrun
    (16 fresh interpreters cost ~20 s of imports here); tests/test_cli_train.py runs tessera under torchrun."""
    code = _quick_start()
    example = (ROOT / "examples" / "quickstart.py").read_text()
    assert code.strip() in example, "README quick start and examples/quickstart.py differ"
    assert "torchrun --standalone --nproc_per_node 16 examples/quickstart.py" in example
    printed = run_ranks(_as_a_torchrun_rank, 16, code, timeout=300)
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", printed[0])]
    assert len(losses) == 5 and losses[-1] < losses[0], printed[0]
    assert not any(printed[1:]), "only rank 0 prints"


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
    from tessera.topology.schedules.simulator import render, simulate

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
