"""A pytest plugin for finding where the suite's time goes: each test's machine-wide CPU seconds and wall.

    python -m pytest -n 0 --cpu-report cpu.tsv tests/test_contract.py

writes one line per test (tests/conftest.py takes this plugin's hooks in; elsewhere, `-p cpu_report` with this
folder on PYTHONPATH): busy CPU seconds of the whole machine (/proc/stat: user, nice, system, irq, softirq,
steal) over the test, its wall seconds, its node id. Machine-wide because a test's work mostly runs outside its
own process: ranks forked by a forkserver (not the test's children), torch.compile's workers and C++ compiler,
the interpreters a CLI test starts. So run it with `-n 0` on an otherwise quiet machine; the suite is CPU-bound
on 2 cores (a whole run measured 2.4% of its core-seconds idle), so these seconds, not the wall times that
`--durations` reports under two workers, say what a change saves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def busy_cpu_seconds() -> float:
    """The machine's busy CPU time since boot, every core together (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="PATH", help="append each test's machine-wide CPU s, wall s, node id")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-report")
    if path is None:
        return
    if not Path("/proc/stat").exists():
        raise pytest.UsageError("--cpu-report reads /proc/stat, which this machine lacks (Linux only)")
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            f"--cpu-report measures the whole machine: run it with -n 0, not -n {config.option.numprocesses}"
        )
    config.pluginmanager.register(_Report(Path(path)), "cpu_report_writer")


class _Report:
    def __init__(self, path: Path) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        cpu, wall = busy_cpu_seconds(), time.perf_counter()
        yield
        with self.path.open("a") as f:
            f.write(f"{busy_cpu_seconds() - cpu:.2f}\t{time.perf_counter() - wall:.2f}\t{item.nodeid}\n")
