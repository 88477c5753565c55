"""The DeviceMesh of a shape over the five mesh axes: built with the flattened submeshes of topology/axes.py's
table, every process group of it given one timeout, and sliced by axis or flattened name. It knows no Layout
(`Layout.build_mesh` checks the layout against the world, then calls `init_mesh` with its shape), so the
torch-free layout loads it lazily and nothing imports back.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from tessera.topology.axes import FLATTENED_MESHES, MESH_AXES


def world_size() -> int:
    """The initialized process group's world size; a RuntimeError naming the fix when there is none."""
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs an initialized process group; call torch.distributed.init_process_group first"
        )
    return dist.get_world_size()


def init_mesh(shape: Sequence[int], device_type: str, timeout: float | None = None) -> DeviceMesh:
    """One DeviceMesh of `shape` over the mesh axes (outermost first), with the table's flattened submeshes;
    `timeout` seconds on every process group of it when given."""
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=MESH_AXES)
    for flat in FLATTENED_MESHES:
        mesh[flat.axes]._flatten(flat.name)
    if timeout is not None:
        set_mesh_timeout(mesh, timeout)
    return mesh


def set_mesh_timeout(mesh: DeviceMesh, timeout: float) -> None:
    """Give every process group of `mesh` (each axis and each flattened submesh) `timeout` seconds."""
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    groups += [submesh(mesh, flat.name).get_group() for flat in FLATTENED_MESHES]
    seen: set[int] = set()
    for group in groups:
        if id(group) not in seen and dist.get_world_size(group) > 1:
            seen.add(id(group))
            _set_pg_timeout(timedelta(seconds=timeout), group)


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
