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

from .data import (
    DataParallelConfig,
    apply_activation_checkpointing,
    apply_fsdp,
    check_data_parallel,
    layout_for_strategy,
)
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


def dry_run_model_states(
    model: str,
    layout: Layout,
    recipe: str = "mixed_adam",
    strategy: str = "FULL_SHARD",
    sequence_parallel: bool = False,
    rank: int = 0,
) -> dict[str, float]:
    """Per-rank model-state bytes of `rank`, counted from the parameters that tp and FSDP2 actually
    leave on it: the preset is built on the meta device and parallelized on the fake backend, so any
    layout (thousands of ranks) is measured in one process, in seconds."""
    from torch.distributed.tensor import DTensor

    from models import build_model
    from topology import dry_run
    from topology.memory import SHARDED_BY_STAGE, get_recipe, zero_stage_of

    def local_numel(m: nn.Module) -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in m.parameters())

    r, stage = get_recipe(recipe), zero_stage_of(strategy)
    layout = layout_for_strategy(layout, strategy)
    config = ParallelConfig(layout, sequence_parallel, DataParallelConfig(strategy=strategy))
    with dry_run(layout, rank=rank) as mesh:
        m = build_model(model, device="meta")
        if layout.tp > 1:
            apply_tp(m, submesh(mesh, "tp"), sequence_parallel)
        unsharded = local_numel(m)  # this rank's tp slice, whole over dp
        if config.uses_fsdp:
            apply_fsdp(m, mesh, layout, config.data)
        sharded = local_numel(m)
    out = {"local_params": float(sharded), "tp_local_params": float(unsharded)}
    for component in ("parameters", "gradients", "optimizer"):
        count = sharded if component in SHARDED_BY_STAGE[stage] else unsharded
        out[component] = float(count * getattr(r, component))
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out

