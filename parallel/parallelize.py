"""parallelize: the one place that applies the parallel axes to a model, in DESIGN.md's order.

    tp (+ sequence parallel)  ->  [activation checkpointing, FSDP2 over dp: the data-axis issue]
    pp and cp slot in here as their issues land; their flags are validated now and must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from topology import Layout, submesh

from .tensor import apply_tp, check_tensor_parallel


@dataclass(frozen=True)
class ParallelConfig:
    layout: Layout
    sequence_parallel: bool = False

    def check(self, model_config, seq_len: int | None = None, global_batch: int | None = None) -> None:
        """Every check that can fail, before any process group starts."""
        layout = self.layout
        for axis in ("pp", "cp"):
            if getattr(layout, axis) != 1:
                raise ValueError(f"{axis}={getattr(layout, axis)}: the {axis} axis is not available yet; use {axis}=1")
        if layout.dp != 1:
            raise ValueError(f"dp={layout.dp}: the data-parallel axes are not available yet; use dp=1")
        check_tensor_parallel(model_config, layout.tp, self.sequence_parallel, seq_len)
        if global_batch is not None and global_batch % layout.dp:
            raise ValueError(
                f"global batch {global_batch} does not split over dp={layout.dp}; use a multiple of {layout.dp}"
            )


def parallelize(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> nn.Module:
    """Turn a one-process `models.Transformer` into this rank's part of the mesh-parallel model."""
    config.check(model.config)
    if config.layout.tp > 1:
        apply_tp(model, submesh(mesh, "tp"), config.sequence_parallel)
    return model
