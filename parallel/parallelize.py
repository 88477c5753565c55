"""parallelize: the one place that applies the parallel axes to a model, in DESIGN.md's order.

    tp (+ sequence parallel) -> activation checkpointing -> FSDP2 over the data axes (dp_shard x cp,
    HSDP across dp_replicate). pp and cp slot in here as their issues land; their degrees are
    validated now and must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from topology import Layout, submesh

from .data import DataParallelConfig, apply_activation_checkpointing, apply_fsdp, check_data_parallel
from .tensor import apply_tp, check_tensor_parallel


@dataclass(frozen=True)
class ParallelConfig:
    layout: Layout
    sequence_parallel: bool = False
    data: DataParallelConfig = field(default_factory=DataParallelConfig)

    def check(self, model_config, seq_len: int | None = None, global_batch: int | None = None) -> None:
        """Every check that can fail, before any process group starts."""
        layout = self.layout
        for axis in ("pp", "cp"):
            if getattr(layout, axis) != 1:
                raise ValueError(f"{axis}={getattr(layout, axis)}: the {axis} axis is not available yet; use {axis}=1")
        check_tensor_parallel(model_config, layout.tp, self.sequence_parallel, seq_len)
        check_data_parallel(self.data, layout)
        if global_batch is not None and global_batch % layout.dp:
            raise ValueError(
                f"global batch {global_batch} does not split over dp={layout.dp}; use a multiple of {layout.dp}"
            )

    @property
    def uses_fsdp(self) -> bool:
        return self.layout.dp_shard * self.layout.cp * self.layout.dp_replicate > 1


def parallelize(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> nn.Module:
    """Turn a one-process `models.Transformer` into this rank's part of the mesh-parallel model."""
    config.check(model.config)
    if config.layout.tp > 1:
        apply_tp(model, submesh(mesh, "tp"), config.sequence_parallel)
    apply_activation_checkpointing(model, config.data.activation_checkpointing)
    if config.uses_fsdp:
        apply_fsdp(model, mesh, config.layout, config.data)
    return model
