"""Contract rows of one world size trained one after the other in one spawn of ranks.

A contract row alone is ~1 s of ranks' work here, and as much again of starting them: forking, the
process group, the first step's one-time costs in every process (DTensor's sharding caches, the
allocator). Rows that share a world size share those. Each row still builds its own Trainer (its own
meshes and model) and is compared alone, by its own name.

Only the rows the session selected run (`pytest -k` picks a row, not its whole group). If a shared spawn
fails (a rank raised, a deadline passed), its rows fall back to a spawn each, so the failure is reported
by the row that has it, with that rank's traceback, not by every row that happened to share its ranks.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Callable

import pytest

from tessera.parallel.launch import run_ranks
from tessera.topology.errors import RankFailure, RankTimeout


def each_in_turn(cases: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Rank function: fn(*args) for every (fn, args), in order, on this spawn's ranks (rank 0's results)."""
    return [fn(*args) for fn, args in cases]


Row = tuple[Callable[..., Any], int, tuple]  # (rank function, world size, its arguments)


class SharedSpawns:
    """The results of each row's `fn(*args)` by row key, computed one world size at a time on first request.

    `rows`: key -> (fn, world size, args). `selected`: the keys this session runs (others never run).
    A result is rank 0's, or with `every_rank` the list of every rank's in rank order.
    """

    def __init__(
        self, rows: dict[Any, Row], selected: set, timeout_per_row: float = 60.0, every_rank: bool = False
    ) -> None:
        self.rows = rows
        self.every_rank = every_rank
        self.selected = selected
        self.timeout_per_row = timeout_per_row
        self.results: dict[Any, Any] = {}
        self.ran_worlds: set[int] = set()

    def result(self, key: Any) -> Any:
        fn, world, args = self.rows[key]
        if world not in self.ran_worlds:
            self.ran_worlds.add(world)
            keys = [k for k, (_, w, _) in self.rows.items() if w == world and (k in self.selected or k == key)]
            cases = [(self.rows[k][0], self.rows[k][2]) for k in keys]
            try:
                by_rank = run_ranks(each_in_turn, world, cases, timeout=60.0 + self.timeout_per_row * len(keys))
                outs = [list(per_case) for per_case in zip(*by_rank)] if self.every_rank else by_rank[0]
                self.results.update(zip(keys, outs))
            except (RankFailure, RankTimeout):
                pass  # each row of this world size runs alone below, and fails by its own name
        if key in self.results:
            return self.results[key]
        alone = run_ranks(fn, world, *args, timeout=180)
        return alone if self.every_rank else alone[0]


def selected_keys(request: pytest.FixtureRequest, param: str = "case") -> set:
    """(test function name, parameter value) of every item this session runs from the requesting module; a
    value that cannot be a key (a dict of layout options) as its str()."""
    keys = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None and param in callspec.params:
            value = callspec.params[param]
            keys.add((item.originalname, value if isinstance(value, Hashable) else str(value)))
    return keys
