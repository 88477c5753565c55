"""DeviceMesh helpers: slicing the mesh of `Layout.build_mesh`, and dry runs on the fake backend.

A dry run builds the mesh of any layout (thousands of ranks) in one process on torch's fake process
group: collectives are no-ops, so layouts, sharding plans and meta-device models can be checked far
beyond the ranks this machine can run.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .layout import Layout


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """`mesh[names]` for axis or flattened names, e.g. submesh(mesh, "tp") or ("dp_replicate", "dp_shard_cp")."""
    key = names[0] if len(names) == 1 else names
    with warnings.catch_warnings():
        # torch >= 2.11 warns that slicing flattened dims from the root will change; both 2.11 and 2.13
        # still support it, and it keeps build_mesh returning a plain DeviceMesh as the contract says.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[key]


def mesh_group_ranks(mesh: DeviceMesh, *names: str) -> list[int]:
    """Global ranks of this rank's group on the (possibly flattened, 1-D) submesh `names`."""
    return dist.get_process_group_ranks(submesh(mesh, *names).get_group())


@contextlib.contextmanager
def dry_run(layout: Layout, rank: int = 0, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """Build `layout`'s mesh as `rank` on the fake backend, in this process; destroyed on exit.

    >>> with dry_run(Layout.infer(4096, tp=8, pp=4, cp=2)) as mesh:
    ...     mesh_group_ranks(mesh, "tp")
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("dry_run needs this process to have no process group; destroy the current one first")
    layout._check_rank(rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        yield layout.build_mesh(device_type)
    finally:
        dist.destroy_process_group()
