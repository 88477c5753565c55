"""tessera's pytest plugin (registered through the `pytest11` entry point when tessera is installed):
fixtures that give a test suite tessera's multi-rank harness and the equivalence runner.

    def test_my_model(tessera_run_ranks, tessera_equivalence):
        results = tessera_run_ranks(my_rank_fn, 4, arg)        # my_rank_fn: a module-level function
        tessera_equivalence(build_model, [Layout(tp=2)], batch, plan=plan)

The harness starts CPU ranks over gloo (forkserver), with a deadline (`--tessera-timeout`, default 120 s)
after which every rank's stack is reported instead of hanging the suite.
"""

from __future__ import annotations

import functools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("tessera")
    group.addoption(
        "--tessera-timeout",
        type=float,
        default=120.0,
        help="seconds a tessera_run_ranks / tessera_equivalence call may take before its ranks' stacks are reported",
    )


@pytest.fixture
def tessera_run_ranks(request):
    """run_ranks(fn, world_size, *args, **kwargs) -> per-rank results, with the suite's deadline."""
    # lazy: pytest loads this plugin in every session once tessera is installed; torch only when a test asks
    from tessera.launching.launch import run_ranks

    return functools.partial(run_ranks, timeout=request.config.getoption("--tessera-timeout"))


@pytest.fixture
def tessera_equivalence(request):
    """assert_layouts_equivalent(build_model, layouts, batch, steps=2, rtol=1e-5, plan=None, ...)."""
    from tessera.testing import assert_layouts_equivalent  # lazy: (as above) torch only when a test asks

    return functools.partial(assert_layouts_equivalent, timeout=request.config.getoption("--tessera-timeout"))
