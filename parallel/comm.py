"""Naming stalled collectives: which rank, which mesh axis, which operation.

Every process group has a timeout (init_process_group(timeout=...), `tessera train --timeout`); when a
collective runs past it, gloo and NCCL raise an error that says little about where in the model it
happened. Collectives that tessera issues itself run inside `collective(op, axis, group)`, which turns
that error into a CollectiveTimeout naming the rank, the axis, the operation and the group's ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog")


class CollectiveTimeout(RuntimeError):
    pass


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a collective running past its process group's timeout."""
    return isinstance(error, CollectiveTimeout) or (
        isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _TIMEOUT_MARKERS))


@contextlib.contextmanager
def collective(op: str, axis: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
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
