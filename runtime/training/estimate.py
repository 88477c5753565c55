"""The planner's estimate of the run a training config describes: its layout, strategy, checkpointing,
schedule, microbatches and dtype as the config runs them (topology/estimators/planner.py's `estimate`). The bench puts
it beside its measurements; the pre-run checks refuse a run whose estimated memory this machine lacks."""

from __future__ import annotations

import os
from typing import Any

from tessera.models.spec import shape_of
from tessera.topology.memory import GB
from tessera.topology.estimators.muon_memory import recipe_for
from tessera.topology.estimators.planner import Candidate, Estimate, Hardware, estimate

# the torch runtime of one CPU rank beside its tensors: a debug rank of two layers peaks at 330 MiB of RSS
# (measured here: `tessera train --model debug`), nearly all of it torch, gloo and Python
CPU_RANK_RUNTIME_BYTES = 300 * 2**20


def planner_estimate(config: Any, calibration: Any = None) -> Estimate:
    """The planner's Estimate for the layout a training config runs: its strategy (NO_SHARD as FSDP2 runs
    it, every dp rank on dp_replicate; HYBRID_SHARD is FULL_SHARD on that 2-D mesh), checkpointing,
    schedule, microbatches, virtual stages and sequence parallel, at its dtype and optimizer (fp32 on CPU: fp32
    Adam; under --optimizer muon the Muon recipe: one momentum on the matrices, the owner's gathered matrix);
    its step time at a calibration's measured rates when one is given (topology/estimators/step_time.py)."""
    from tessera.parallel.fsdp import PRECISIONS, layout_for_strategy  # lazy: tessera.parallel imports torch

    p = config.parallel_config()
    layout = layout_for_strategy(config.layout, p.data.strategy)
    strategy = "SHARD_GRAD_OP" if p.data.strategy == "SHARD_GRAD_OP" else "FULL_SHARD"
    cand = Candidate(
        layout,
        strategy,
        p.data.activation_checkpointing,
        # a schedule file: the planner knows schedules by name; (interleaved) 1F1B's held activations stand in
        p.pipeline.schedule
        if isinstance(p.pipeline.schedule, str)
        else "interleaved-1f1b"
        if p.pipeline.virtual > 1
        else "1f1b",
        config.data.microbatches,
        p.pipeline.virtual,
        p.sequence_parallel,
        p.data.offload,
    )
    element = PRECISIONS[p.data.mixed_precision].itemsize
    ranks = layout.world_size
    hw = Hardware(
        gpus=ranks,
        gpu_memory_gb=1e6,
        gpus_per_node=max(8, ranks),
        dtype_bytes=element,
        recipe=recipe_for(element, config.optimizer.optimizer),
        calibration=calibration,
        fp8=config.parallel.fp8,
        fault_tolerant=config.ft.fault_tolerant,
        device_type=config.device_type(),
    )

    return estimate(shape_of(config.model_config), cand, hw, config.data.seq_len, config.data.global_batch)


def fit_problem(config: Any, available: int | None, local_ranks: int, per_device: int | None) -> str | None:
    """Why this machine cannot hold the run, by the planner's estimate, or None. CPU ranks share the host's
    `available` bytes (each also needs CPU_RANK_RUNTIME_BYTES of runtime); a GPU rank has its device's
    `per_device` bytes. Unknown capacities pass."""
    need = planner_estimate(config).memory
    host = need.get("host_offload", 0.0)  # --offload: the states each rank keeps in host memory
    per_rank = need["total"]
    parts = ", ".join(
        f"{k} {v / GB:,.2f}" for k, v in need.items() if k not in ("total", "host_offload") and v >= 0.01 * GB
    )
    what = (
        f"the planner estimates {per_rank / GB:,.2f} GB per rank ({parts or 'all parts under 0.01 GB'}) for "
        f"{config.layout} at seq_len={config.data.seq_len}, global_batch={config.data.global_batch}, "
        f"microbatches={config.data.microbatches}"
        + (f", and {host / GB:,.2f} GB per rank of offloaded states in host memory" if host else "")
    )
    fix = (
        "lower `global_batch`, raise `microbatches`, add activation checkpointing, spread the model over more "
        "ranks, or pass `force` to run anyway"
    )
    if per_device is not None:
        if per_rank > per_device:
            return f"{what}, more than a GPU's {per_device / GB:,.2f} GB; {fix}"
        from tessera.launching.host_memory import available_bytes  # lazy: tessera.parallel imports torch

        host_available = available_bytes() if host else None
        if host_available is not None and local_ranks * host > host_available:
            return (
                f"--offload {config.parallel.offload}: the planner estimates {host / GB:,.2f} GB of host memory per "
                f"rank for the offloaded states, {local_ranks * host / GB:,.2f} GB for this machine's {local_ranks} "
                f"rank(s), more than the {host_available / GB:,.2f} GB it has available; offload less (--offload "
                f"optimizer keeps the weights and gradients on the GPU), spread the model over more machines, or "
                f"pass `force` to run anyway"
            )
        return None
    if available is None:
        return None
    per_rank += host  # CPU ranks: the host buffers are the same memory
    total = local_ranks * (per_rank + CPU_RANK_RUNTIME_BYTES)
    if total <= available:
        return None
    holds = int(available // (per_rank + CPU_RANK_RUNTIME_BYTES))
    if local_ranks * CPU_RANK_RUNTIME_BYTES > available / 2:  # the rank count itself, not the tensors
        fix = (
            f"this machine holds about {holds} such rank(s): use a smaller layout, torchrun across machines, or "
            f"pass `force` to run anyway"
        )
    return (
        f"{what}; {local_ranks} local CPU rank(s) with their runtime ({CPU_RANK_RUNTIME_BYTES / 2**20:.0f} MiB "
        f"each) need {total / GB:,.2f} GB, more than the {available / GB:,.2f} GB this machine has available; {fix}"
    )


def local_ranks(world: int) -> int:
    """The ranks this machine runs: torchrun's LOCAL_WORLD_SIZE, else the whole layout (the local launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))
