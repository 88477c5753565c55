"""Naming stalled collectives: which rank, which mesh axis, which operation.

Every process group has a timeout (init_process_group(timeout=...), `tessera train --timeout`); when a
collective runs past it, gloo and NCCL raise an error that says little about where in the model it
happened. Collectives that tessera issues itself run inside `collective(op, axis, group)`, which turns
that error into a CollectiveTimeout naming the rank, the axis, the operation and the group's ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Iterator

import torch
import torch.distributed as dist

from tessera.topology.errors import CollectiveTimeout  # a restartable TesseraError
from tessera.topology.layout import AXES, FLATTENED

_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog")


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a collective running past its process group's timeout."""
    return isinstance(error, CollectiveTimeout) or (
        isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _TIMEOUT_MARKERS)
    )


# the axis of the tessera collective being issued now, for comm_stats (a group alone can be ambiguous: with
# dp_shard 1, the cp ring and FSDP share one group)
CURRENT_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_collective_axis", default=None)


# seconds spent inside tessera's collectives by axis, while a trainer step collects them (exposed
# communication: the time a rank waits on tp, cp and pp traffic and on its peers)
WAIT_SECONDS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("tessera_wait_s", default=None)


@contextlib.contextmanager
def collective(op: str, axis: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Name a stalled collective by rank, axis and operation; count its axis (comm_stats) and its wait
    (WAIT_SECONDS). Inside torch.compile's trace it does nothing: the collective becomes an op of the graph,
    which runs long after this code, and dynamo cannot trace ContextVar.set (a graph break at every tp
    collective split a compiled tp2 + SP block into 12 graphs)."""
    if torch.compiler.is_compiling():
        yield
        return
    token = CURRENT_AXIS.set(axis)
    waits = WAIT_SECONDS.get()
    started = time.perf_counter() if waits is not None else 0.0
    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        if isinstance(e, CollectiveTimeout) or not any(m in text for m in _TIMEOUT_MARKERS):
            raise
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise CollectiveTimeout(
            f"rank {dist.get_rank()} stalled in {op} over the {axis} axis (group ranks {ranks}): a peer never "
            f"joined; look for a rank that raised, exited, or took another code path. Underlying error: {e}"
        ) from e
    finally:
        CURRENT_AXIS.reset(token)
        if waits is not None and CURRENT_AXIS.get() is None:  # the outermost collective() only
            waits[axis] = waits.get(axis, 0.0) + time.perf_counter() - started


def stalled_collective(error: BaseException, layout, rank: int) -> str | None:
    """Where in torch a collective stalled, from the error's traceback: the innermost frame that holds a
    process group (FSDP2's param groups hold theirs; DTensor's redistribution holds a mesh and a mesh
    dim), mapped to the mesh axis whose group of `rank` has the same members. None if nothing is found."""
    tb, frames = error.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    files = [f.f_code.co_filename.replace("\\", "/") for f in frames]
    kind = (
        "an FSDP2 "
        if any("/fsdp/" in f for f in files)
        else "a DTensor "
        if any("/distributed/tensor/" in f for f in files)
        else "a "
    )
    names = [f.f_code.co_name for f in reversed(frames)]
    where = next((n for n in names if "gather" in n or "reduce" in n or "unshard" in n), names[0] if names else "?")
    op = (
        "all-gather"
        if "gather" in where or "unshard" in where
        else ("reduce-scatter" if "reduce_scatter" in where else "all-reduce" if "reduce" in where else where)
    )
    for frame in reversed(frames):
        members, _ = _group_members_in(frame.f_locals)
        if members is None:
            continue
        axis = axis_of_group(layout, rank, members)
        over = f"over the {axis} axis" if axis else "over a group that is no single mesh axis"
        return f"{kind}{op} ({where}) {over} (group ranks {sorted(members)})"
    return None


def _group_members_in(scope: dict) -> tuple[list[int] | None, str]:
    for name, value in scope.items():
        if isinstance(value, dist.ProcessGroup):
            return dist.get_process_group_ranks(value), name
    owner = scope.get("self")
    for attr in ("_all_gather_process_group", "_reduce_scatter_process_group"):
        group = getattr(owner, attr, None)
        if isinstance(group, dist.ProcessGroup):
            return dist.get_process_group_ranks(group), f"{type(owner).__name__}.{attr.strip('_')}"
    mesh_info = getattr(owner, "mesh_info", None)
    group = getattr(mesh_info, "shard_process_group", None)
    if isinstance(group, dist.ProcessGroup):
        return dist.get_process_group_ranks(group), f"{type(owner).__name__}.shard_process_group"
    mesh, dim = scope.get("device_mesh") or scope.get("mesh"), scope.get("mesh_dim")
    if mesh is not None and isinstance(dim, int) and hasattr(mesh, "get_group"):
        return dist.get_process_group_ranks(mesh.get_group(dim)), "mesh dim"
    return None, ""


def axis_of_group(layout, rank: int, members: list[int]) -> str | None:
    """The mesh axis (a single axis first, then a flattened one) whose group of `rank` is `members`."""
    wanted = sorted(members)
    for axis in tuple(a for a in AXES if getattr(layout, a) > 1) + tuple(FLATTENED):
        if sorted(layout.group(axis, rank)) == wanted:
            return axis
    return None
