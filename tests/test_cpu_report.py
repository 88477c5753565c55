"""tests/cpu_report.py, the plugin that measures each test's machine-wide CPU: a test's work done in a process it
did not wait for (here a detached grandchild, as a forked rank is) is counted; a run under xdist workers is
refused."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

BURN = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path

    # a detached grandchild burns 0.5 CPU-s, then writes done: its parent has exited by then, so no os.times()
    # of this process sees that CPU (as none sees a rank forked by a forkserver)
    SPIN = "import time; t = time.process_time()\\nwhile time.process_time() - t < 0.5: pass\\nopen('done', 'w')"
    LAUNCH = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SPIN!r}])"

    def test_burns_in_a_grandchild():
        subprocess.run([sys.executable, "-c", LAUNCH], check=True)
        end = time.monotonic() + 60
        while not Path("done").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert Path("done").exists()

    def test_idle():
        pass
    """
)


def test_each_test_gets_the_machines_cpu_including_processes_it_did_not_wait_for(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURN)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "cpu_report", "-p", "no:cacheprovider"]
        + ["--cpu-report", "cpu.tsv", "test_burn.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split("\t") for line in (tmp_path / "cpu.tsv").read_text().splitlines()]
    assert [r[2] for r in rows] == ["test_burn.py::test_burns_in_a_grandchild", "test_burn.py::test_idle"]
    assert float(rows[0][0]) >= 0.45, rows  # the grandchild's 0.5 s, counted whatever else the machine did


def test_the_suites_own_option_refuses_xdist_workers_in_one_line(tmp_path):
    """Through tests/conftest.py, as docs/repository.md gives it: refused before any test runs under -n 2."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--cpu-report",
            str(tmp_path / "cpu.tsv"),
            "tests/test_axes.py",
        ],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "run it with -n 0, not -n 2" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "cpu.tsv").exists()
