"""The users' testing API: a model trained on several layouts over CPU ranks against one process.

    from tessera.testing import assert_layouts_equivalent
    assert_layouts_equivalent(build_model, [Layout(tp=2), Layout(dp_shard=2)], batch=(inputs, targets), steps=2)

equivalence.py holds the runner and the comparison (its docstring says how a run is judged);
simulated_world.py `prove_layout`, a layout proved at its real world size in one process (`tessera check`);
pytest_plugin.py the fixtures `tessera_run_ranks` and `tessera_equivalence` (pytest's entry point
`tessera`, so a user's suite has them once tessera is installed). The property-testing strategies of layouts
and placements live beside what they draw, in tessera.topology.strategies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations and type checkers; at run time the names load on first use (below)
    from .equivalence import (
        LayoutsDiverge,
        RunSpec,
        assert_layouts_equivalent,
        compare_runs,
        drift_envelope,
        judge_drift,
        train_on_layout,
        train_spec_on_layout,
    )
    from .simulated_world import prove_layout

__all__ = [
    "LayoutsDiverge",
    "RunSpec",
    "assert_layouts_equivalent",
    "compare_runs",
    "drift_envelope",
    "judge_drift",
    "prove_layout",
    "train_on_layout",
    "train_spec_on_layout",
]


def __getattr__(name: str) -> Any:
    # pytest loads pytest_plugin (this package's child) in every session once tessera is installed, and a
    # package's __init__ runs first: the runner, which imports torch, loads when a test asks for it
    if name == "prove_layout":
        from . import simulated_world  # lazy: (as below)

        return simulated_world.prove_layout
    if name in __all__:
        from . import equivalence  # lazy: torch stays out of every pytest session that never asks

        return getattr(equivalence, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
