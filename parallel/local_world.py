"""Whether this process is a simulated world: torch's LocalTensorMode, every rank's shard held here and each
collective computed for all ranks at once (runtime/training/simulated.py runs a layout so). The few places of
tessera's own Python that differ by rank (the rows a rank reads, its positions under cp) ask here and run once
per simulated rank."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable


@functools.cache
def _enabled_mode() -> Callable[[], Any] | None:
    """torch's lookup of the enabled LocalTensorMode, found once (None on a torch without it): every attention
    call and expert dispatch asks, and a failed import would search the path again each time."""
    try:
        # lazy: torch's simulated world, loaded where a rank first asks whether it is in one
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return None
    return enabled_local_tensor_mode


def simulated_world() -> Any:
    """The enabled LocalTensorMode, or None (a real process group, or a torch without it)."""
    lookup = _enabled_mode()
    return None if lookup is None else lookup()


def world_disabled() -> Any:
    """The simulated world switched off for a block (plain tensors inside), or a no-op outside one."""
    world = simulated_world()
    return contextlib.nullcontext() if world is None else world.disable()


def group_members(group: Any) -> list[list[int]]:
    """Every group `group` stands for in the simulated world, as global ranks in group order: under
    LocalTensorMode one group object stands for all of them, and torch's own simulated collectives derive
    them so (its c10d layer's _prepare_collective_groups). Only the groups whose ranks this world holds: a
    simulated pipeline's stage holds its own ranks alone (parallel/pipeline_simulated.py)."""
    # lazy: torch's simulated world, read only inside one
    from torch.distributed._local_tensor import local_tensor_mode
    from torch.distributed._local_tensor._c10d import _prepare_collective_groups

    ranks, offsets, _ = _prepare_collective_groups(group)
    mode = local_tensor_mode()  # enabled or not (asked from blocks that disable it, too)
    assert mode is not None, "group_members is asked inside a simulated world only"
    held = mode.ranks
    groups = [[offset + r for r in ranks] for offset in offsets]
    return [g for g in groups if set(g) <= held]


def per_rank(n: Any) -> dict[int, int] | None:
    """A size that is one int per simulated rank (an uneven shard's, a LocalIntNode) as {rank: int}; None for
    a plain int, every rank's alike."""
    node = getattr(n, "node", None)
    ints = getattr(node, "_local_ints", None)
    return None if ints is None else dict(ints)


def widest(n: Any) -> int:
    """The largest over the simulated ranks of a size that may be one int per rank (`per_rank`), else the int."""
    ints = per_rank(n)
    return int(n) if ints is None else max(ints.values())


def rank_int(values: dict[int, int]) -> Any:
    """One int per simulated rank ({rank: int}) as a size torch's simulated ops take (a plain int where every
    rank's is alike)."""
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    import torch  # lazy: (as in _enabled_mode)
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(values))


@contextlib.contextmanager
def swapped(owner: Any, **values: Any) -> Iterator[None]:
    """For the block, each named attribute of `owner` (a module or a class: torch's internals a simulated run
    patches) is the given value; after it, the originals as `owner.__dict__` held them (a staticmethod stays
    one), whatever the block raised."""
    before = {name: owner.__dict__[name] for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(owner, name, value)
