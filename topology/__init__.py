"""Layouts of the five mesh axes (the axes as data: topology/axes.py), DeviceMesh construction, memory
models and dry runs."""

from tessera.topology.layout import AXES, FLATTENED, Layout

__all__ = ["AXES", "FLATTENED", "Layout", "Meshes", "submesh", "dry_run", "mesh_group_ranks"]


def __getattr__(name: str):  # the mesh helpers import torch; keep `import topology` light
    if name in ("Meshes", "dry_run"):
        from tessera.topology import (
            mesh,
        )  # lazy: the mesh helpers import torch, which `import tessera.topology` does not

        return getattr(mesh, name)
    if name in ("submesh", "mesh_group_ranks"):
        from tessera.topology import device_mesh  # lazy: (as above) torch

        return getattr(device_mesh, name)
    raise AttributeError(name)
