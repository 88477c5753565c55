"""A layout's meshes: the meshes by purpose (`Meshes`), the expert meshes unflattened from the data axes,
the check that a mesh handed in is the layout's, and dry runs on the fake backend. The DeviceMesh of a shape
itself (built, flattened, given its timeout, sliced) is topology/device_mesh.py's, which `Layout.build_mesh`
calls; this module sits above both, so no import runs back.

A dry run builds the mesh of any layout (thousands of ranks) in one process on torch's fake process
group: collectives are no-ops, so layouts, sharding plans and meta-device models can be checked far
beyond the ranks this machine can run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from tessera.topology.axes import FLATTENED_BY_PURPOSE, FLATTENED_MESHES, MESH_AXES, TABLE
from tessera.topology.device_mesh import mesh_group_ranks, set_mesh_timeout, submesh
from tessera.topology.layout import Layout

__all__ = ["Meshes", "check_world_mesh", "dry_run", "expert_meshes", "mesh_group_ranks", "submesh"]


def check_world_mesh(mesh: DeviceMesh, layout: Layout, device_type: str) -> None:
    """A mesh handed in for `layout` must be one `build_mesh` made for a layout of its shape, on the device
    type the run computes on."""
    names, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)
    if names != tuple(MESH_AXES) or shape != tuple(layout.shape):
        raise ValueError(
            f"the mesh {dict(zip(names, shape)) or shape} is not the mesh of layout {layout} "
            f"({dict(zip(MESH_AXES, layout.shape))}); build it with layout.build_mesh(device_type)"
        )
    if mesh.device_type != device_type:
        raise ValueError(
            f"the mesh is a {mesh.device_type} mesh and the run computes on {device_type}; build it with "
            f"layout.build_mesh({device_type!r})"
        )


@contextlib.contextmanager
def dry_run(layout: Layout, rank: int = 0, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """Build `layout`'s mesh as `rank` on the fake backend, in this process; destroyed on exit.

    >>> with dry_run(Layout.infer(4096, tp=8, pp=4, cp=2)) as mesh:
    ...     mesh_group_ranks(mesh, "tp")
    """
    if dist.is_initialized():
        raise RuntimeError("dry_run needs this process to have no process group; destroy the current one first")
    layout._check_rank(rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        yield layout.build_mesh(device_type)
    finally:
        dist.destroy_process_group()


def expert_meshes(world: DeviceMesh, layout: Layout) -> tuple[DeviceMesh, DeviceMesh]:
    """(the 1-D ep mesh, the experts' FSDP2 mesh): the flattened dp_shard x cp mesh unflattened into
    (edp, ep), ep innermost (consecutive cp ranks first, as torchtitan takes them); the FSDP2 mesh is edp,
    or (dp_replicate, edp) under HSDP."""
    fsdp = FLATTENED_BY_PURPOSE["fsdp"]
    shard = submesh(world, fsdp.name)
    if not hasattr(shard, "_unflatten"):
        raise RuntimeError(
            f"expert parallel needs DeviceMesh._unflatten (torch >= 2.10); this is torch {torch.__version__}"
        )
    ep = layout.ep
    if shard.size() % ep:
        raise ValueError(f"ep={ep} must divide dp_shard x cp = {shard.size()}; raise `dp` or `cp`")
    split = shard._unflatten(0, (shard.size() // ep, ep), ("edp", "ep"))
    experts = split["edp"]
    if fsdp.replicate is not None and layout.degree(fsdp.replicate) > 1:
        experts = DeviceMesh._concatenate([submesh(world, fsdp.replicate), experts])
    return split["ep"], experts


class Meshes:
    """The run's DeviceMesh and the meshes each part of tessera needs, named by purpose (each None when
    its axes are off, so a caller never slices strings or branches on degrees itself). They are read from
    topology/axes.py's table: each axis with a `mesh` gets its 1-D mesh, each flattened submesh its purpose.

    tp      tensor-parallel layers and the vocab-parallel loss (1-D "tp")
    ep      expert parallel's all-to-alls (1-D "ep", unflattened from "dp_shard_cp": `expert_meshes`)
    expert_fsdp  FSDP2 over the experts: the rest of dp_shard x cp ("edp"), 2-D with dp_replicate (HSDP)
    pp      pipeline stages' point-to-point sends and the grad-norm sum across stages (1-D "pp")
    cp      ring attention's K/V exchange (1-D "cp")
    fsdp    FSDP2 sharding: 1-D "dp_shard_cp", or 2-D ("dp_replicate", "dp_shard_cp") for HSDP
    precision  fsdp, or where that is off the degree-1 "dp_shard_cp" mesh (never None): FSDP2 runs on it
            for the mixed-precision policy alone when the compute dtype is not fp32
    batch   the ranks that read different rows of the global batch: "dp" (dp_replicate x dp_shard)
    loss    the ranks whose loss sums add up to the global one: "dp_cp" (tp and pp ranks share theirs)
    """

    # the purpose meshes, by name: the axes' own, then the flattened ones'
    PURPOSES: tuple[str, ...] = tuple(a.mesh for a in TABLE if a.mesh) + tuple(f.purpose for f in FLATTENED_MESHES)
    # each set by __init__ (from the table, by name); declared here for their type (tests/test_mesh.py
    # checks that every purpose is)
    tp: DeviceMesh | None
    ep: DeviceMesh | None
    expert_fsdp: DeviceMesh | None
    pp: DeviceMesh | None
    cp: DeviceMesh | None
    fsdp: DeviceMesh | None
    precision: DeviceMesh
    batch: DeviceMesh | None
    loss: DeviceMesh | None

    def __init__(
        self, layout: Layout, device_type: str = "cpu", mesh: DeviceMesh | None = None, timeout: float | None = None
    ):
        self.layout = layout
        self.device_type = device_type
        if mesh is not None:  # built once by the caller, for several runs of one layout shape
            check_world_mesh(mesh, layout, device_type)
            if timeout is not None:
                set_mesh_timeout(mesh, timeout)
        self.world = mesh if mesh is not None else layout.build_mesh(device_type, timeout=timeout)

        def on(size: int, *names: str) -> DeviceMesh | None:
            return submesh(self.world, *names) if size > 1 else None

        for axis in TABLE:  # tp, pp, cp
            if axis.mesh and not axis.borrows:
                setattr(self, axis.mesh, on(layout.degree(axis.name), axis.name))
        for flat in FLATTENED_MESHES:  # batch, fsdp, loss
            if flat.replicate is not None and layout.degree(flat.replicate) > 1:  # HSDP: (dp_replicate, dp_shard_cp)
                setattr(self, flat.purpose, submesh(self.world, flat.replicate, flat.name))
            else:
                setattr(self, flat.purpose, on(layout.degree(flat.name), flat.name))
        # the degree-1 data mesh where FSDP2 is off: FSDP2 on it shards nothing and applies only the
        # mixed-precision policy, so every layout computes in the same dtype (parallel/fsdp.py)
        self.precision = self.fsdp if self.fsdp is not None else submesh(self.world, FLATTENED_BY_PURPOSE["fsdp"].name)
        # expert parallel borrows dp_shard x cp: its 1-D mesh and the experts' FSDP2 mesh (None when ep is 1)
        self.ep, self.expert_fsdp = expert_meshes(self.world, layout) if layout.ep > 1 else (None, None)

    @staticmethod
    def group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
        """The process group of a 1-D mesh, or None when the mesh is off."""
        return None if mesh is None else mesh.get_group()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def batch_index(self) -> int:
        """Which slice of the global batch's rows this rank reads (its dp coordinate)."""
        return self.layout.index(FLATTENED_BY_PURPOSE["batch"].name, self.rank)

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 averages gradients over (1 when FSDP is off)."""
        return 1 if self.fsdp is None else self.fsdp.size()

    def __repr__(self) -> str:
        on = [name for name in self.PURPOSES if getattr(self, name) is not None]
        return f"Meshes({self.layout}, on: {', '.join(on) or 'none'})"
