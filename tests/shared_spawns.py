"""Contract rows of one world size trained one after the other in one spawn of ranks, across test files.

A contract row alone is ~1 s of ranks' work here, and as much again of starting them: forking, the
process group, the first step's one-time costs in every process (DTensor's sharding caches, the
allocator). Rows that share a world size share those. Each row still builds its own Trainer (its own
meshes and model) and is compared alone, by its own name.

A test file declares its rows in a module-level `spawned_rows(session) -> SharedSpawns` and gets them through the
`runs` fixture (tests/conftest.py: the session's `spawn_pool`, asked for that file's rows). Where the files run in
one process (the suite's rank-heavy files, which one xdist worker takes together, or a run without xdist), the pool
trains the selected rows of one world size of every such file in one spawn: the fp32, bf16 and Qwen3 contract rows
on 16 ranks together, not a spawn per file (three 16-rank rows: 40 busy CPU-s in three spawns, 30 in one). Otherwise
each file's rows of one world size share a spawn.

Only the rows the session selected run (`pytest -k` picks a row, not its whole group). If a shared spawn
fails (a rank raised, a deadline passed), its rows fall back to a spawn per file and then per row, so the
failure is reported by the row that has it, with that rank's traceback, not by every row that happened to
share its ranks.
"""

from __future__ import annotations

from collections.abc import Hashable
from types import ModuleType
from typing import Any, Callable

import pytest
import torch.distributed as dist

from tessera.launching.launch import run_ranks
from tessera.topology.errors import RankFailure, RankTimeout


def each_in_turn(cases: list[tuple[Callable[..., Any], tuple]], every_rank: list[bool] | None = None) -> list[Any]:
    """Rank function: fn(*args) for every (fn, args), in order, on this spawn's ranks. Rank 0 returns every
    result; another rank only those `every_rank` asks for (None for the rest: nothing to send back)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = every_rank or [True] * len(cases)
    return [out if rank == 0 or kept else None for out, kept in zip((fn(*args) for fn, args in cases), keep)]


Row = tuple[Callable[..., Any], int, tuple]  # (rank function, world size, its arguments)

# A shared spawn's deadline grows with its rows (a minute each: a pooled spawn may hold a hundred), so a collective
# that never completes is bounded on its own: gloo raises in the rank, naming it, after 5 minutes instead of after
# the spawn's deadline (run_ranks' default), and the rows fall back to smaller spawns that find the culprit
COLLECTIVE_TIMEOUT = 300.0


class SharedSpawns:
    """The results of each row's `fn(*args)` by row key, computed one world size at a time on first request.

    `rows`: key -> (fn, world size, args). `selected`: the keys this session runs (others never run).
    A result is rank 0's, or with `every_rank` the list of every rank's in rank order. `pool`: the
    SpawnPool that trains this file's rows with other files' (None: this file's alone).
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
        self.pool: SpawnPool | None = None

    def pending(self, world: int) -> list[Any]:
        """The selected keys of `world` ranks that have no result yet."""
        return [k for k, (_, w, _) in self.rows.items() if w == world and k in self.selected and k not in self.results]

    def take(self, keys: list[Any], by_rank: list[list[Any]]) -> None:
        """Keep the results of `keys` from a spawn's per-rank lists (each_in_turn's, in the keys' order)."""
        outs = [list(per_case) for per_case in zip(*by_rank)] if self.every_rank else by_rank[0]
        self.results.update(zip(keys, outs))

    def result(self, key: Any) -> Any:
        fn, world, args = self.rows[key]
        if key not in self.results and world not in self.ran_worlds:
            if self.pool is not None:
                self.pool.train(world)  # every pooled file's rows of this world size, this file's among them
            if key not in self.results:  # no pool, or its spawn failed: this file's rows of the world size
                self.ran_worlds.add(world)
                keys = [*self.pending(world), *([] if key in self.selected else [key])]
                spawn_together(world, [(self, keys)])  # if it fails, each row runs alone below, by its own name
        if key in self.results:
            return self.results[key]
        alone = run_ranks(fn, world, *args, timeout=180)
        return alone if self.every_rank else alone[0]


class SpawnPool:
    """The SharedSpawns of the test files this session runs, by module name. The rows of the files named in
    `pooled` (those this process runs all of) train together: one spawn per world size for all of them, in the
    files' order; another file's rows train by themselves."""

    def __init__(self, session: pytest.Session, pooled: set[str]) -> None:
        self.session = session
        self.pooled = pooled
        self.members: dict[str, SharedSpawns] = {}
        self.ran_worlds: set[int] = set()
        # every pooled file's rows known before the first spawn, whichever file asks first
        for module in dict.fromkeys(getattr(item, "module", None) for item in session.items):
            if module is not None and module.__name__ in pooled and hasattr(module, "spawned_rows"):
                self.spawns_of(module)

    def spawns_of(self, module: ModuleType) -> SharedSpawns:
        if module.__name__ not in self.members:
            spawns = module.spawned_rows(self.session)
            spawns.pool = self if module.__name__ in self.pooled else None
            self.members[module.__name__] = spawns
        return self.members[module.__name__]

    def train(self, world: int) -> None:
        """The pending rows of `world` ranks of every member, in one spawn (once a world size). If it fails,
        nothing is kept: each member then trains its own rows."""
        if world in self.ran_worlds:
            return
        self.ran_worlds.add(world)
        parts = [(m, m.pending(world)) for m in self.members.values() if m.pool is self]
        parts = [(m, keys) for m, keys in parts if keys]
        if spawn_together(world, parts):
            for m, _ in parts:
                m.ran_worlds.add(world)


# each shared spawn that failed (its rows then trained by file, then by row), with why: a test's message
FALLBACKS: list[str] = []


def spawn_together(world: int, parts: list[tuple[SharedSpawns, list[Any]]]) -> bool:
    """The rows `keys` of each (SharedSpawns, keys) in one spawn of `world` ranks, in order, each keeping its
    results; False, keeping nothing, if the spawn failed."""
    cases = [(m.rows[k][0], m.rows[k][2]) for m, keys in parts for k in keys]
    every = [m.every_rank for m, keys in parts for _ in keys]
    timeout = 60.0 + sum(m.timeout_per_row * len(keys) for m, keys in parts)
    try:
        by_rank = run_ranks(each_in_turn, world, cases, every, timeout=timeout, collective_timeout=COLLECTIVE_TIMEOUT)
    except (RankFailure, RankTimeout) as e:
        FALLBACKS.append(f"{world} ranks: {type(e).__name__}: {str(e)[:500]}")  # why the rows trained apart
        return False
    start = 0
    for m, keys in parts:
        m.take(keys, [per_rank[start : start + len(keys)] for per_rank in by_rank])
        start += len(keys)
    return True


def selected_keys(session: pytest.Session, module: ModuleType, param: str = "case") -> set:
    """(test function name, parameter value) of every item this session runs from `module`; a value that
    cannot be a key (a dict of layout options) as its str()."""
    keys = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is module and callspec is not None and param in callspec.params:
            value = callspec.params[param]
            keys.add((item.originalname, value if isinstance(value, Hashable) else str(value)))
    return keys
