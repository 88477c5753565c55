"""Score one configuration exactly as a user would run it (`tessera plan --layout L --top 0`): the layout, its
FSDP strategy, checkpointing, schedule, virtual stages and microbatches fixed (the microbatches picked by the
planner when not given), estimated alone, without enumerating the others; and the record `tessera plan
--json` prints for it under `layout.estimate`."""

from __future__ import annotations

from dataclasses import replace

from tessera.topology.errors import PlanError
from .fp8_model import blended_peak, fp8_flop_share
from tessera.topology.layout import Layout
from tessera.topology.memory import GB
from tessera.topology.estimators.offload_model import check_offload_mode, host_bytes_per_node
from tessera.topology.estimators.planner import Candidate, Estimate, Hardware, candidates_of_layout, estimate
from tessera.topology.estimators.step_estimate import model_flops_per_token
from tessera.topology.estimators.planner import why_not_runnable
from tessera.topology.shapes import as_shape

GIB = 2**30


def score_one(
    shape,
    hw: Hardware,
    seq_len: int,
    global_batch: int,
    layout: Layout,
    *,
    strategy: str | None = None,
    ac: str | None = None,
    sequence_parallel: bool | None = None,
    schedule: str | None = None,
    virtual: int | None = None,
    microbatches: int | None = None,
    offload: str | None = None,
) -> Estimate:
    """The estimate of `layout` with the settings given; each one left None is the planner's fastest choice
    among the settings tessera runs (a fitting one first). PlanError saying why tessera would not run it."""
    cfg = as_shape(shape)
    if microbatches is not None and microbatches < 1:
        raise PlanError(f"microbatches={microbatches} must be at least 1")
    # the planner tries a few counts and schedules: given ones are scored as given, with every other setting
    pinned = [(schedule, virtual)] if schedule is not None and virtual is not None and layout.pp > 1 else None
    counts = [microbatches] if microbatches is not None else None
    pool = candidates_of_layout(cfg, layout, seq_len, global_batch, counts, pinned)
    if sequence_parallel is not None:
        pool = [
            Candidate(c.layout, c.strategy, c.ac, c.schedule, c.microbatches, c.virtual, sequence_parallel)
            for c in pool
        ]

    if offload is not None:  # --offload: every setting scored with the states where it puts them
        pool = [replace(c, offload=check_offload_mode(offload)) for c in pool]

    def wanted(c: Candidate) -> bool:
        return (
            (strategy is None or c.strategy == strategy or layout.dp_shard * layout.cp == 1)
            and (ac is None or c.ac == ac)
            and (schedule is None or c.schedule == schedule or layout.pp == 1)
            and (virtual is None or c.virtual == virtual)
            and (sequence_parallel is None or c.sequence_parallel == (sequence_parallel and layout.tp > 1))
        )

    chosen = list(dict.fromkeys(c for c in pool if wanted(c)))
    if not chosen:  # none runs with these settings: the one they name says why (or is scored as named)
        probe = Candidate(
            layout,
            strategy or "FULL_SHARD",
            ac or "none",
            schedule or "1f1b",
            microbatches or max(1, layout.pp),
            virtual or 1,
            sequence_parallel,
            offload or "none",
        )
        chosen = [probe]
    runnable = [c for c in chosen if why_not_runnable(cfg, c, seq_len, global_batch) is None]
    if not runnable:
        why = why_not_runnable(cfg, chosen[0], seq_len, global_batch)
        raise PlanError(f"tessera would not run {chosen[0].describe()}: {why}")
    estimates = [estimate(cfg, c, hw, seq_len, global_batch) for c in runnable]
    return min(estimates, key=lambda x: (not x.fits, x.time["step"], x.memory["total"]))


def estimate_record(x: Estimate, hw: Hardware, shape, seq_len: int, global_batch: int) -> dict:
    """What `layout.estimate` holds: tokens/s per GPU, the step and its split (compute, recompute, each
    axis's exposed traffic, the bubble, the optimizer), MFU against the bf16 peak (and for FP8 against the
    FP8 peak and a peak blended by the FLOPs that run in FP8), peak memory per GPU by component (GiB), and
    whether it fits (and what overflows by how much when it does not)."""
    cfg = as_shape(shape)
    flops = model_flops_per_token(cfg, seq_len) * global_batch * seq_len
    step = x.time["step"]
    record = {
        **x.as_dict(),
        "tokens_per_s_per_gpu": x.tokens_per_s / hw.gpus,
        "step_time_s": step,
        "split_s": {k: v for k, v in x.time.items() if k != "step"},
        "mfu_bf16": None if hw.peak_tflops is None else flops / (step * hw.gpus * hw.peak_flops_per_s),
        "memory_gib": {k: v / GIB for k, v in x.memory.items()},
        "peak_memory_gib": x.memory["total"] / GIB,
        "usable_memory_gib": hw.usable_bytes / GIB,
    }
    fp8_peak = hw.fp8_peak_flops_per_s
    if hw.fp8 and fp8_peak is not None and hw.peak_tflops is not None:
        share = fp8_flop_share(cfg, seq_len, x.candidate.layout.tp)
        blended = blended_peak(share, hw.peak_flops_per_s, fp8_peak)
        record["mfu_fp8"] = flops / (step * hw.gpus * fp8_peak)
        record["mfu_fp8_blended"] = flops / (step * hw.gpus * blended)
        record["fp8_flop_share"] = share
    host = x.memory.get("host_offload")
    if host is not None:  # --offload: what each rank and each node keep in host memory
        node = host_bytes_per_node(host, hw.gpus, hw.gpus_per_node)
        record["host_memory_gb"] = {"per_rank": host / GB, "per_node": node / GB, "node_has": hw.host_memory_gb}
    if not x.fits and x.memory["total"] <= hw.usable_bytes and host is not None:
        record["overflow"] = (
            f"the offloaded states need {node / GB:.1f} GB of host memory a node ({host / GB:.1f} GB a rank), more "
            f"than its {hw.host_memory_gb:g} GB; offload less (offload=optimizer) or spread over more nodes"
        )
    elif not x.fits:
        parts = {k: v for k, v in x.memory.items() if k not in ("total", "host_offload")}
        biggest = max(parts, key=lambda k: parts[k])
        record["overflow"] = (
            f"needs {x.memory['total'] / GB:.1f} GB against {hw.usable_bytes / GB:.1f} GB usable, short by "
            f"{(x.memory['total'] - hw.usable_bytes) / GB:.1f} GB; the largest component is {biggest} "
            f"({parts[biggest] / GB:.1f} GB)"
        )
    return record
