"""What `--offload` costs a step (parallel/offload.py's two modes), for the planner and `tessera memory`.

optimizer  after the backward, each rank's gradient shards go down to the host (4 B an element over PCIe),
           AdamW steps there (memory-bound: it reads the fp32 shard, gradient and both moments and writes the
           shard and the moments, 28 B an element, at the host's DRAM bandwidth shared by the node's GPUs),
           and the updated shards go back up (4 B): in series, nothing to hide them behind.
params     FSDP2's CPUOffloadPolicy copies a unit's shards up for each all-gather and the reduce-scattered
           gradients down, on its own streams: hidden behind the compute while they take less time than it
           (the excess is exposed); the step runs on the host as above, and the GPU runs no optimizer.

Figures are per rank; the bandwidths come from the hardware profile (pcie_gbps x pcie_share per GPU and
direction, host_memory_gbps x host_memory_share per node).
"""

from __future__ import annotations

from tessera.topology.memory import GB, OFFLOAD_MODES

HOST_ADAMW_BYTES = 28  # fp32: parameter, gradient, two moments read; parameter and moments written
COPY_BYTES = 4  # each element crosses PCIe as fp32 (the shard, its gradient)


def check_offload_mode(offload: str) -> str:
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload={offload!r} is not one of {', '.join(OFFLOAD_MODES)}: use one of them")
    return offload


def offload_seconds(
    offload: str,
    sharded_elements: float,
    pcie_bytes_per_s: float,
    host_bytes_per_s: float,
    gpus_on_host: int,
    gathers: int,
    compute_s: float,
) -> dict[str, float]:
    """{"offload_copies": the copies' exposed seconds, "host_optimizer": the host step's seconds, and the
    copies' whole time (before overlap) as "offload_copies_total"} for one rank of a step; {} for none.
    `gathers`: the all-gathers of each unit a step runs (FSDP2 copies the shard up for each); `compute_s`:
    the compute the params mode's copies hide behind; `gpus_on_host`: the ranks sharing the host's bandwidth."""
    if check_offload_mode(offload) == "none":
        return {}
    host = sharded_elements * HOST_ADAMW_BYTES / (host_bytes_per_s / max(1, gpus_on_host))
    if offload == "optimizer":
        copies = 2 * sharded_elements * COPY_BYTES / pcie_bytes_per_s
        exposed = copies
    else:
        up = gathers * sharded_elements * COPY_BYTES / pcie_bytes_per_s
        down = sharded_elements * COPY_BYTES / pcie_bytes_per_s  # the gradients, once a step
        copies = max(up, down)  # the two directions run at once
        exposed = max(0.0, copies - compute_s)
    return {"offload_copies": exposed, "host_optimizer": host, "offload_copies_total": copies}


def gathers_per_step(strategy: str, pipelined: bool, microbatches: int) -> int:
    """How often FSDP2 all-gathers each unit in a step: FULL_SHARD twice a microbatch (forward, and again for
    the backward); SHARD_GRAD_OP once a microbatch; inside a pipeline once a step (units stay gathered)."""
    if pipelined:
        return 1
    return (2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1) * microbatches


def host_bytes_per_node(host_per_rank: float, gpus: int, gpus_per_node: int) -> float:
    """What a node's host memory holds of the offloaded states: its ranks' shares together."""
    return host_per_rank * min(gpus, gpus_per_node)


def fits_host(host_per_rank: float, gpus: int, gpus_per_node: int, host_memory_gb: float | None) -> bool:
    """Whether the node's host memory holds what its ranks offload (unknown capacity: assumed to)."""
    if host_memory_gb is None:
        return True
    return host_bytes_per_node(host_per_rank, gpus, gpus_per_node) <= host_memory_gb * GB
