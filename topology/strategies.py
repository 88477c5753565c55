"""Hypothesis strategies for property tests of sharding (needs hypothesis: `pip install -e '.[test]'`).

layouts(max_world=8, axes=("dp_shard", "tp"), model=cfg, seq_len=256, global_batch=8, tp_divides=None)
    Layouts up to `max_world` ranks over the chosen axes, limited to what the model and data allow:
    tp divides the heads and ffn width (and kv heads divide tp or tp divides them), cp splits the
    sequence into 2*cp chunks, pp has a layer per stage, dp divides the global batch. Shrinks towards
    the smallest degrees (1 on every axis, then the fewest ranks).
divisible_shapes(divisors, max_side=8)   shapes whose dim i is a multiple of divisors[i]
placements(ndim, mesh_ndim)              a DTensor placement per mesh dim: Shard(d), Replicate, Partial
schedules(max_stages=4, max_microbatches=8, kinds=KINDS)   valid (kind, stages, microbatches, virtual)
                                         with the built schedule
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

from hypothesis import assume
from hypothesis import strategies as st

from tessera.topology.axes import problems, values_of
from tessera.topology.layout import Layout
from tessera.topology.schedules.schedule import KINDS, VIRTUAL_KINDS, build_schedule, check_schedule

AXES = Layout.AXES


def _allowed(axis: str, model, seq_len: int | None, tp_divides: int | None, max_world: int) -> list[int]:
    """The degrees of `axis` (the others 1) that break none of topology/axes.py's rules for the model and
    the sequence length given (Layout.problems); `tp_divides`: tp must also divide it."""
    facts = tuple(sorted(values_of(model, seq_len=seq_len).items()))  # what the rules read of the model
    try:
        return list(_allowed_by_facts(axis, facts, tp_divides, max_world))
    except TypeError:  # a fact that cannot be a key (a list): counted afresh
        return list(_allowed_by_facts.__wrapped__(axis, facts, tp_divides, max_world))


# A draw asks for every axis's degrees: checking each degree up to max_world against every rule took 2/3 of a
# draw (45 ms of a 64-rank draw), the same answer each time for one model
@functools.lru_cache(maxsize=1024)
def _allowed_by_facts(axis: str, facts: tuple, tp_divides: int | None, max_world: int) -> tuple[int, ...]:
    given = dict(facts)
    values = [v for v in range(1, max_world + 1) if not problems({axis: v}, None, **given)]
    if axis == "tp" and tp_divides is not None:
        values = [t for t in values if tp_divides % t == 0]
    return tuple(values)


@st.composite
def layouts(
    draw,
    max_world: int = 8,
    axes: Sequence[str] = ("dp_shard", "tp"),
    model=None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    min_world: int = 1,
    tp_divides: int | None = None,
) -> Layout:
    """A Layout over `axes` (the others 1) with min_world <= world_size <= max_world that the model
    (a ModelShape, tessera's LlamaConfig, or anything with n_heads, n_kv_heads, ffn_dim and n_layers), the sequence
    length and the global batch allow; `tp_divides`: tp must divide it (a user model's head count)."""
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown axes {unknown}; use some of {', '.join(AXES)}")
    degrees = {}
    budget = max_world
    for axis in AXES:
        if axis not in axes:
            continue
        options = [v for v in _allowed(axis, model, seq_len, tp_divides, max_world) if v <= budget]
        degrees[axis] = draw(st.sampled_from(options))
        budget //= degrees[axis]
    layout = Layout(**degrees)
    assume(global_batch is None or global_batch % layout.dp == 0)
    assume(layout.world_size >= min_world)
    return layout


def divisible_shapes(divisors: Sequence[int], max_multiple: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes (d0, d1, ...) with d_i a positive multiple of divisors[i] (at most max_multiple times it)."""

    def multiples(d: int) -> st.SearchStrategy[int]:
        return st.integers(1, max_multiple).map(lambda k: k * d)

    return st.tuples(*(multiples(d) for d in divisors))


def placements(ndim: int, mesh_ndim: int = 1, partial: bool = True) -> st.SearchStrategy[list]:
    """One placement per mesh dimension: Shard(d) for d < ndim, Replicate(), or (if `partial`) Partial()."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: torch objects; topology is torch-free

    one = st.one_of(
        st.integers(0, max(0, ndim - 1)).map(Shard), st.just(Replicate()), *([st.just(Partial())] if partial else [])
    )
    return st.lists(one, min_size=mesh_ndim, max_size=mesh_ndim)


class ScheduleCase(NamedTuple):
    kind: str
    stages: int
    microbatches: int
    virtual: int
    schedule: list


@st.composite
def schedules(
    draw, max_stages: int = 4, max_microbatches: int = 8, kinds: Sequence[str] | None = None, max_virtual: int = 2
) -> ScheduleCase:
    """A pipeline schedule that build_schedule accepts, with the arguments that built it."""
    kind = draw(st.sampled_from(list(kinds or KINDS)))
    stages = draw(st.integers(1, max_stages))
    virtual = draw(st.integers(2, max(2, max_virtual))) if kind in VIRTUAL_KINDS else 1
    microbatches = draw(st.integers(1, max_microbatches))
    try:
        check_schedule(kind, stages, microbatches, virtual)
    except ValueError:
        assume(False)
    return ScheduleCase(kind, stages, microbatches, virtual, build_schedule(kind, stages, microbatches, virtual))
