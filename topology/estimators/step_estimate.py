"""The step time of one candidate (planner.py's step paragraph), and `estimate`, which puts it beside the
rank's memory: at a calibration's rates or `efficiency` x the peak without a profile (`_rated_time`), or the
physics of topology/estimators/step_model.py from a hardware profile (`physics_time`); the pipeline bubble from the
schedule simulator, each axis's traffic exposed or overlapped, --offload's copies and host step."""

from __future__ import annotations

import functools
import math

from tessera.topology.axes import (
    COMM_AXES,
    COMM_GROUPS,
    OVERLAPPED,
    TABLE,
)
from tessera.topology.estimators.comm_model import comm_bytes_per_step, ep_over_tp_applies, stage_layer_counts
from .fp8_model import (
    FP8_BYTES,
    cast_bytes_per_step,
    fp8_flop_share,
    fp8_params,
    fp8_time_factor,
    fsdp_param_bytes,
)
from tessera.topology.estimators.comm_model import HSDP_REPLICATE
from tessera.topology.layout import AXES, Layout
from tessera.topology.memory import GB
from tessera.topology.estimators.offload_model import fits_host, gathers_per_step, offload_seconds

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s
from tessera.topology.estimators.plan_inputs import (
    RECOMPUTE,
    Candidate,
    Estimate,
    Hardware,
    fsdp_degree,
)
from tessera.topology.estimators.rank_memory import (
    _rank_memory,
    rank_params_of,
)
from tessera.topology.schedules.schedule import build_schedule, placement_of, stages_on_rank
from tessera.topology.shapes import (
    ModelShape,
    as_shape,
    layer_param_shapes,
    stage_param_shapes,
)
from tessera.topology.schedules.simulator import simulate
from tessera.topology.estimators.step_model import (
    busiest_blocks,
    collective_counts,
    compute_parts,
    exposed_comm,
    latency_seconds,
)
from tessera.topology.estimators.step_time import attention_flops_per_token, step_parts


# ----------------------------------------------------------------------------- the schedule
@functools.lru_cache(maxsize=4096)
def pipeline_profile(kind: str, pp: int, microbatches: int, virtual: int) -> tuple[float, tuple[int, ...]]:
    """(bubble fraction, forwards in flight at most, per pp rank) from the schedule simulator, with a
    backward costing twice a forward (B = W = F for the kinds that split it)."""
    if pp == 1:
        return 0.0, (1,)
    timeline = simulate(build_schedule(kind, pp, microbatches, virtual), {"F": 1.0, "B": 1.0, "W": 1.0}, checked=True)
    return timeline.bubble, tuple(timeline.peak_held_activations)  # a deferred W holds its layer's inputs


# ----------------------------------------------------------------------------- flops
def model_flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters in matmuls: all but the lookup tables, the output head
    included even when tied: `ModelShape.matmul_params`) + 6 x layers x (heads x head_dim) x seq_len for
    causal attention (QK^T and PV, forward 2 x 2 x heads x head_dim x seq / 2, backward twice that; latent
    attention's PV at its v head dim, a sliding block's at most `sliding_window` keys: step_time's
    `attention_flops_per_token`)."""
    cfg = as_shape(shape)
    return 6.0 * cfg.matmul_params() + attention_flops_per_token(cfg, seq_len)


def axis_bandwidth(layout: Layout, axis: str | tuple[str, ...], hw: Hardware, ranks: int | None = None) -> float:
    """GB/s for `axis`'s group: intra-node when the group lies inside one node (the axes after it in the
    mesh order and it span at most gpus_per_node ranks), else inter-node. `ranks`: the group is only that
    many consecutive coordinates of the innermost of `axis` (expert parallel's ep ranks of dp_shard x cp),
    so it spans `ranks` x the axes inside them."""
    axes = (axis,) if isinstance(axis, str) else axis
    outer = min(AXES.index(a) for a in axes)
    inner = max(AXES.index(a) for a in axes)
    span = (
        ranks * math.prod(getattr(layout, a) for a in AXES[inner + 1 :])
        if ranks is not None
        else math.prod(getattr(layout, a) for a in AXES[outer:])
    )
    return (hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps) * GB


def _group_ranks(layout: Layout, name: str) -> int | None:
    """The ranks of an accounting name's group when it is a borrowing axis's (ep: its degree), else None."""
    borrowing = next((a for a in TABLE if a.borrows and (a.comm or a.name) == name), None)
    return None if borrowing is None else getattr(layout, borrowing.name)


def expert_weight_seconds(
    shape, cand: Candidate, hw: Hardware, seq_len: int, global_batch: int, recompute: float
) -> float:
    """Time the MoE experts' grouped GEMMs lose to memory on one rank, per step: they are at their roofline,
    max(FLOPs / the matmul rate, weight bytes / the memory bandwidth), and the FLOPs side is already in
    the compute. Each microbatch streams the rank's E / ep experts (ffn / tp of each) from memory three
    times (forward, backward's input gradient and its weight gradient), once more when recomputed; with few
    tokens per expert (small microbatches, no ep) that, not the FLOPs, bounds them. 0 for a dense model."""
    cfg = as_shape(shape)
    if not cfg.n_experts:
        return 0.0
    lay = cand.layout
    per_expert = cfg.mlp_matrices * cfg.dim * cfg.ffn_dim
    local = cfg.n_experts // lay.ep * per_expert // lay.tp
    n_stages = lay.pp * cand.virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    placement = placement_of(cand.schedule)
    blocks = max(sum(layers[s] for s in stages_on_rank(p, lay.pp, cand.virtual, placement)) for p in range(lay.pp))
    passes = 3 + {"none": 0.0, "selective": 0.5}.get(cand.ac, 1.0)  # op and full rerun each forward
    weight_bytes = cand.microbatches * blocks * local * hw.dtype_bytes * passes
    cal = hw.calibration
    expert_flops = (
        6.0 * cfg.top_k * per_expert * cfg.n_layers * global_batch * seq_len * (1 + recompute) / lay.world_size
    )
    if cal is None:
        flops_s = expert_flops / (hw.peak_flops_per_s * hw.efficiency)
        memory_s = weight_bytes / (hw.hbm_gbps * GB)
    else:
        flops_s, memory_s = expert_flops / cal.matmul_flops_per_s, weight_bytes / cal.memory_bytes_per_s
    return max(0.0, memory_s - flops_s)


# ----------------------------------------------------------------------------- one estimate
def ep_over_tp(hw: Hardware, cand: Candidate) -> bool:
    """Whether `cand` is scored with an expert group of ep x tp ranks (hw.ep_over_tp, where the layout has ep,
    tp and sequence parallel: each rank dispatches its own sequence shard)."""
    return hw.ep_over_tp and ep_over_tp_applies(cand.layout, cand.sequence_parallel)


def cp_gather_share(cp: int, dtype_bytes: int, recomputed: bool) -> float:
    """The K/V gathers' share of cp's bytes (comm_model's ring volumes): (cp - 1) K/V passes forward, again in
    backward and, recomputed, in the forward's rerun, beside cp passes of the fp32 dK/dV accumulators."""
    if cp == 1:
        return 1.0
    gathers = (cp - 1) * dtype_bytes * (3 if recomputed else 2)
    return gathers / (gathers + cp * max(4, dtype_bytes))


def estimate(shape, cand: Candidate, hw: Hardware, seq_len: int, global_batch: int) -> Estimate:
    """Per-rank memory, step time, traffic and MFU of one candidate for a model of `shape` (a ModelShape)."""
    cfg = as_shape(shape)
    lay, e = cand.layout, hw.dtype_bytes
    rows_per_dp = global_batch // lay.dp
    mb_rows = rows_per_dp // cand.microbatches
    seq = seq_len // lay.cp
    fsdp = fsdp_degree(lay)
    pipelined = lay.pp > 1

    bubble, in_flight = (
        pipeline_profile(cand.schedule, lay.pp, cand.microbatches, cand.virtual) if pipelined else (0.0, (1,))
    )
    memory = max(
        (
            _rank_memory(cfg, cand, hw, pp_rank, in_flight[pp_rank], mb_rows, seq, fsdp)
            for pp_rank in sorted({0, lay.pp - 1})
        ),
        key=lambda m: m["total"],
    )

    comm = comm_bytes_per_step(
        cfg,
        lay,
        seq_len,
        global_batch,
        cand.microbatches,
        cand.sequence_parallel,
        strategy=cand.strategy,
        virtual=cand.virtual,
        ac=cand.ac,
        cp_method="ring",
        rank=0,
        act_bytes=e,
        param_bytes=fsdp_param_bytes(cfg, e, hw.fp8, lay.tp),
        reduce_bytes=hw.grad_reduce_bytes,
        placement=placement_of(cand.schedule),
        ep_over_tp=ep_over_tp(hw, cand),
        cp_kv_heads=hw.cp_kv_heads,
        tp_gather_bytes=FP8_BYTES if hw.fp8 == "tensorwise" and hw.fp8_tp_gather else None,
    )
    # step time
    tokens = global_batch * seq_len
    flops = model_flops_per_token(cfg, seq_len) * tokens
    if hw.profile is not None and hw.calibration is None:
        time, parts = physics_time(cfg, cand, hw, seq_len, global_batch, bubble, comm)
    else:
        time, parts = _rated_time(cfg, cand, hw, seq_len, global_batch, bubble, comm)
    if cand.offload != "none":
        time = _with_offload(time, cfg, cand, hw)
    tokens_per_s = tokens / time["step"]
    mfu = None if hw.peak_tflops is None else flops / (time["step"] * hw.gpus * hw.peak_flops_per_s)
    fits = memory["total"] <= hw.usable_bytes and fits_host(
        memory.get("host_offload", 0.0), hw.gpus, hw.gpus_per_node, hw.host_memory_gb
    )
    return Estimate(cand, memory, time, comm, tokens_per_s, mfu, fits, bubble, parts)


def _with_offload(time: dict[str, float], cfg: ModelShape, cand: Candidate, hw: Hardware) -> dict[str, float]:
    """The step with --offload's copies and host optimizer (topology/estimators/offload_model.py) in place of the GPU's
    optimizer, for the pp rank holding the most sharded parameters."""
    lay = cand.layout
    placement = placement_of(cand.schedule)
    sharded = max(
        rank_params_of(cfg, lay.tp, lay.pp, cand.virtual, fsdp_degree(lay), r, lay.ep, placement)[1]
        for r in sorted({0, lay.pp - 1})
    )
    extra = offload_seconds(
        cand.offload,
        sharded,
        hw.pcie_gbps * GB,
        hw.host_memory_gbps * GB,
        min(hw.gpus, hw.gpus_per_node),
        # without data axes FSDP2 runs on the degree-1 mesh unresharded (parallelize): one gather a step
        gathers_per_step(cand.strategy, lay.pp > 1 or fsdp_degree(lay) == 1, cand.microbatches),
        time.get("compute", 0.0),
    )
    out = {k: v for k, v in time.items() if k not in ("step", "optimizer")}  # the GPU steps nothing
    out["offload_copies"], out["host_optimizer"] = extra["offload_copies"], extra["host_optimizer"]
    out["step"] = sum(out.values())
    return out


def _rated_time(
    cfg: ModelShape,
    cand: Candidate,
    hw: Hardware,
    seq_len: int,
    global_batch: int,
    bubble: float,
    comm: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """(the step by component, "step" included; the calibrated compute's parts, {} without a calibration) at
    `efficiency` x `peak_tflops`, or at a calibration's measured rates: the model without a hardware profile."""
    lay, e = cand.layout, hw.dtype_bytes
    fsdp = fsdp_degree(lay)
    flops = model_flops_per_token(cfg, seq_len) * global_batch * seq_len
    recompute = RECOMPUTE[cand.ac]
    parts: dict[str, float] = {}
    if hw.calibration is not None:
        parts = calibrated_compute(cfg, cand, hw, seq_len, global_batch, recompute)
        compute = parts["step"]
    else:
        compute = flops * (1 + recompute) / (hw.gpus * hw.peak_flops_per_s * hw.efficiency)
    if hw.fp8:  # the FP8 matmuls' share at their rate, and the casts' memory traffic (one pp rank: 1 / pp of it)
        if hw.calibration is not None:  # the calibrated matmul time: its FP8 share at the speedup
            saved = parts["matmul"] * (1 - fp8_time_factor(fp8_params(cfg, lay.tp) / cfg.matmul_params()))
            parts = {**parts, "fp8_matmul_saved": saved}
            compute -= saved
        else:
            compute *= fp8_time_factor(fp8_flop_share(cfg, seq_len, lay.tp))
        tokens_seen = global_batch * seq_len / (lay.dp * lay.cp) * (1 + recompute)
        fp8_gather = hw.fp8 == "tensorwise" and lay.tp == 1 and fsdp > 1  # each gather casts a shard
        weight_casts = cand.microbatches * (1 + recompute) / (fsdp if fp8_gather else 1)
        cast = cast_bytes_per_step(cfg, tokens_seen, lay.tp, e, weight_casts) / lay.pp
        rate = hw.calibration.memory_bytes_per_s if hw.calibration is not None else hw.hbm_gbps * GB
        compute += cast / rate
        if parts:
            parts["fp8_casts"] = cast / rate
    compute += expert_weight_seconds(cfg, cand, hw, seq_len, global_batch, recompute)
    compute_stretched = compute / (1 - bubble)
    # each accounting name's traffic over its group's links; FSDP's, HSDP's and ring K/V's overlap compute
    # (only their excess is exposed), the rest (tp, pp) is exposed
    t = {name: comm[name] / axis_bandwidth(lay, COMM_GROUPS[name], hw, _group_ranks(lay, name)) for name in comm}
    replicas = _replica_seconds(t, hw, lay)  # --fault-tolerant: the replicate axis after the backward, exposed
    overlapped = sum(t[name] for name in COMM_AXES if name in OVERLAPPED)
    time = {
        "compute": compute,
        "bubble": compute_stretched - compute,
        **{name: t[name] for name in comm if name not in OVERLAPPED},
        "exposed_overlapped_comm": max(0.0, overlapped - compute),
        **replicas,
    }
    time["step"] = sum(time.values())
    return time, parts


def _replica_seconds(seconds: dict[str, float], hw: Hardware, lay: Layout) -> dict[str, float]:
    """--fault-tolerant (parallel/fault_tolerance.py): the replicate axis's traffic leaves the overlapped set
    (`seconds` loses it) and runs after the backward, in series, as one all-reduce of the gradient shards through
    torchft's managed group, with the quorum's and the commit vote's round trips (a network latency each)."""
    if not hw.fault_tolerant or lay.dp_replicate == 1:
        return {}
    wire = seconds.get(HSDP_REPLICATE, 0.0)
    seconds[HSDP_REPLICATE] = 0.0  # not behind the backward any more
    latency = hw.profile.latency_inter_us * 1e-6 if hw.profile is not None else 20e-6
    return {"replicas": wire + 3 * latency}


def physics_time(
    cfg: ModelShape,
    cand: Candidate,
    hw: Hardware,
    seq_len: int,
    global_batch: int,
    bubble: float,
    comm: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """(the step split into compute, recompute, optimizer, bubble and each axis's exposed traffic, "step" their
    sum; the compute's parts and each name's traffic seconds) of one candidate on a hardware profile
    (step_model.py's physics), for the pp rank whose step is longest; `comm`: the bytes each accounting
    name sends (comm_bytes_per_step)."""
    profile = hw.profile
    if profile is None:
        raise ValueError("physics_time needs a Hardware with a profile (Hardware.from_profile)")
    lay = cand.layout
    fsdp = fsdp_degree(lay)
    placement = placement_of(cand.schedule)
    mb_rows = global_batch // lay.dp // cand.microbatches
    seq = seq_len // lay.cp
    n_stages = lay.pp * cand.virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    busiest, _ = busiest_blocks(cfg.n_layers, lay.pp, cand.virtual, placement)

    def rank_parts(pp_rank: int) -> dict[str, float]:
        stages = stages_on_rank(pp_rank, lay.pp, cand.virtual, placement)
        _, sharded, _ = rank_params_of(cfg, lay.tp, lay.pp, cand.virtual, fsdp, pp_rank, lay.ep, placement)
        return compute_parts(
            cfg,
            profile,
            tp=lay.tp,
            ep=lay.ep,
            mb_tokens=mb_rows * seq,
            microbatches=cand.microbatches,
            blocks=sum(layers[s] for s in stages),
            last_stage=n_stages - 1 in stages,
            attention_tokens=global_batch * seq_len / (lay.dp * lay.cp),
            seq_len=seq_len,
            ac=cand.ac,
            fp8=hw.fp8,
            compiled=hw.compile,
            attention=hw.attention,
            loss=hw.loss,
            sequence_parallel=cand.sequence_parallel,
            ac_policy=hw.ac_policy,
            dtype_bytes=hw.dtype_bytes,
            sharded_params=sharded,
            efficiency=hw.efficiency,
            cp=lay.cp,
            cp_merge=hw.cp_merge,
            cp_kv_heads=hw.cp_kv_heads,
        )

    parts = max((rank_parts(r) for r in sorted({0, lay.pp - 1})), key=lambda p: p["compute"])
    counts = collective_counts(
        lay.tp,
        lay.cp,
        lay.pp,
        lay.ep,
        fsdp,
        lay.dp_replicate,
        busiest,
        cand.microbatches,
        cand.virtual,
        cand.ac,
        cand.strategy,
        bool(cfg.n_experts),
    )
    seconds = {}
    for name, sent in comm.items():
        bandwidth = axis_bandwidth(lay, COMM_GROUPS[name], hw, _group_ranks(lay, name))
        inter = bandwidth < hw.intra_node_gbps * GB
        wire = sent / bandwidth
        if name == "ep" and inter and lay.ep > 1:
            # an all-to-all sends to each peer directly: to those in its node over NVLink, to the rest over
            # the network, at once (the ep group is ep consecutive coordinates of dp_shard x cp, tp apart)
            if ep_over_tp(hw, cand):  # ep x tp members, consecutive ranks
                members = lay.ep * lay.tp
                local = min(members, hw.gpus_per_node)
            else:
                members, local = lay.ep, max(1, min(lay.ep, hw.gpus_per_node // lay.tp))
            remote = (members - local) / (members - 1)
            wire = max(sent * (1 - remote) / (hw.intra_node_gbps * GB), sent * remote / bandwidth)
        seconds[name] = wire + latency_seconds(counts.get(name, 0.0), inter, profile)
    replicas = _replica_seconds(seconds, hw, lay)
    exposed = exposed_comm(
        seconds,
        parts,
        tp=lay.tp,
        pp=lay.pp,
        microbatches=cand.microbatches,
        units=busiest + 2,
        async_tp=hw.async_tp,
        ep_overlap=hw.ep_overlap,
        cp=lay.cp,
        cp_overlap=hw.cp_overlap,
        cp_gather_share=cp_gather_share(lay.cp, hw.dtype_bytes, cand.ac == "full"),
        tp_collectives=counts.get("tp", 0.0),
    )
    exposed.update(replicas)
    pipelined = parts["compute"] - parts["optimizer"]
    time = {
        "compute": pipelined - parts["recompute"],
        "recompute": parts["recompute"],
        "optimizer": parts["optimizer"],
        "bubble": pipelined * bubble / (1 - bubble) if bubble < 1 else math.inf,
        **exposed,
    }
    time["step"] = sum(time.values())
    return time, {**parts, **{f"comm_{k}_s": v for k, v in seconds.items()}}


def calibrated_compute(
    shape, cand: Candidate, hw: Hardware, seq_len: int, global_batch: int, recompute: float
) -> dict[str, float]:
    """One rank's compute (no communication, no bubble) at the calibration's rates: every rank does
    1 / gpus of the model's FLOPs and activation traffic; its optimizer steps its own (sharded) parameters;
    its host dispatches the operators of its stage's blocks (topology/estimators/step_time.py)."""
    calibration = hw.calibration
    if calibration is None:
        raise ValueError("calibrated_compute needs a Hardware with a calibration (tessera plan --calibrate)")
    cfg = as_shape(shape)
    lay = cand.layout
    fsdp = fsdp_degree(lay)
    biggest = max(
        sorted({0, lay.pp - 1}),
        key=lambda p: rank_params_of(cfg, lay.tp, lay.pp, cand.virtual, fsdp, p, lay.ep, placement_of(cand.schedule))[
            0
        ],
    )
    _, sharded, _ = rank_params_of(
        cfg, lay.tp, lay.pp, cand.virtual, fsdp, biggest, lay.ep, placement_of(cand.schedule)
    )
    n_stages = lay.pp * cand.virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    stages = stages_on_rank(biggest, lay.pp, cand.virtual, placement_of(cand.schedule))
    blocks = sum(layers[s] for s in stages)
    # parameter tensors: a block's (9 in Llama's), the embedding on the first stage, the final norm and head on the last
    extra = [u for s in stages for u in stage_param_shapes(cfg, lay.tp, s == 0, s == n_stages - 1, 0)]
    tensors = len(layer_param_shapes(cfg, lay.tp, lay.ep)) * blocks + sum(len(u) for u in extra)
    return step_parts(
        cfg,
        calibration,
        global_batch * seq_len,
        seq_len,
        sharded,
        tensors,
        blocks,
        hw.dtype_bytes,
        recompute,
        share=1.0 / lay.world_size,
        microbatches=cand.microbatches,
    )
