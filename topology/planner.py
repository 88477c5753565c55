"""The layout planner: which layout (a degree per axis of topology/axes.py's table: pp, dp_replicate,
dp_shard, cp, tp, and ep for a mixture-of-experts model), FSDP strategy, pipeline schedule and
activation checkpointing to use for a model on N GPUs, before reserving them. The axes it enumerates,
their caps, the axis that takes the ranks left over, the flags of a candidate and which traffic overlaps
compute all come from the table (`layout_degrees`).

For every candidate layout the planner estimates, per rank:

memory  model states (parameters, gradients, optimizer: topology.memory's recipe, counted for the rank
        that holds the most: the first pipeline stage's embedding or the last one's head, the kv
        projections replicated when tp exceeds the kv heads, ceil-division shards as FSDP2 cuts them; an
        MoE block's E / ep experts sharded over the dp_shard x cp / ep ranks ep leaves)
      + the unsharded compute copy FSDP2 gathers (one unit and its prefetch under FULL_SHARD; the whole
        stage under SHARD_GRAD_OP and inside a pipeline step, where parameters stay gathered across
        microbatches) and the unsharded gradients that gradient accumulation keeps until the last one
      + activations: the tensors each block saves for backward (`layer_activation_bytes`), times the
        microbatches in flight on the busiest pipeline rank (from the schedule simulator), reduced by
        activation checkpointing, plus the vocab-parallel loss's logits
      + communication buffers (a unit's reduce-scatter input, ring K/V blocks, pipeline send/receive)
step    model FLOPs (6 N per token, N an MoE model's active parameters, plus causal attention, the formula
        in `model_flops_per_token`; MFU counts the same) and
        recomputation at `efficiency` x `peak_tflops` (or, with a calibration of the device kind, matmuls,
        attention, elementwise memory traffic, the loss, the optimizer and the host's dispatch at the
        measured rates: topology/step_time.py), stretched by the pipeline bubble from the simulator;
        the experts' grouped GEMMs at their roofline (`expert_weight_seconds`: few tokens per expert make
        them stream weights, not compute); tp, pp and ep (the all-to-alls, balanced routing) traffic
        exposed; FSDP and ring K/V traffic overlapped with compute (only their excess over compute is
        exposed). Each axis's bytes go over the intra-node bandwidth when its group fits inside a node (the
        mesh order puts tp innermost; an ep group is ep consecutive ranks of dp_shard x cp, times tp),
        else over the inter-node bandwidth.

The model is a `ModelShape` (topology/shapes.py: plain numbers a family's spec gives, `spec.shape(config)`;
tessera's Llama ModelConfig is read by the same field names): its matrices (two or three in the MLP),
head_dim, qk-norm, norms, biases, tied head and position table are what the counts above count. Nothing
here imports torch, tessera.models or tessera.parallel: `tessera plan` resolves a preset name to a shape.

Candidates that do not fit `gpu_memory_gb x (1 - headroom)` are ruled out; the rest are ranked by
estimated step time (then memory). The figures are estimates with stated assumptions; `tessera plan
--dry-run` builds the chosen layout on the fake backend and counts its parameters exactly, and `tessera
bench` puts the predictions beside measurements.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from .axes import (
    AXIS,
    COMM_AXES,
    COMM_GROUPS,
    FLATTENED_BY_PURPOSE,
    OVERLAPPED,
    TABLE,
    Axis,
    planner_degrees,
    rest_axes,
    values_of,
)
from .comm_model import comm_bytes_per_step, stage_layer_counts
from .layout import AXES, Layout
from .schedule import SPLIT_BACKWARD, build_schedule, check_schedule, placement_of, stages_on_rank
from .simulator import simulate
from .shapes import (
    ModelShape,
    as_shape,
    check_expert_parallel,
    check_tensor_parallel,
    chunk_tokens,
    fsdp_shard_numel,
    kv_heads_split,
    layer_param_shapes,
    layer_shard_groups,
    stage_param_shapes,
)
from .memory import AC_MODES as MEMORY_AC_MODES
from .memory import FSDP_STRATEGIES, GB, OFFLOAD_MODES, get_recipe, min_gpus, offload_split
from .offload_model import fits_host, gathers_per_step, offload_seconds
from .muon_memory import MUON_RECIPES, muon_extra_bytes
from .step_time import Calibration, attention_flops_per_token, step_parts
from .hardware import ATTENTION_BACKENDS, HardwareProfile, load_profile
from .step_model import busiest_blocks, collective_counts, compute_parts, exposed_comm, latency_seconds
from .activations import block_activation_bytes, layer_kind, uses_block_model
from .errors import PlanError  # no layout fits, or a request it cannot plan
from .fp8_model import (
    FP8_RECIPES,
    cast_bytes_per_step,
    fp8_flop_share,
    fp8_params,
    fp8_time_factor,
    fsdp_param_bytes,
)

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s
# InfiniBand per GPU, as algorithm bandwidths a well-tuned collective reaches.
H100_BF16_TFLOPS = 989.0
DEFAULT_EFFICIENCY = 0.40  # share of peak that the matmuls reach in a real step (MFU of good runs: 0.35-0.45)
DEFAULT_INTRA_GBPS = 360.0  # GB/s per GPU inside a node (NVLink 4: 450 GB/s per direction, ~80% reached)
DEFAULT_INTER_GBPS = 40.0  # GB/s per GPU across nodes (400 Gb/s = 50 GB/s, ~80% reached)
DEFAULT_HBM_GBPS = 3000.0  # GB/s of a GPU's own memory (H100 SXM's HBM3: 3.35 TB/s, ~90% reached streaming)
# tessera's own software efficiency under a hardware profile (topology/step_model.py): fitted once, on the lent
# H200's eager 1b row (benchmarks/bench_published.py's "tessera" source, anchor "tessera-h200-1b-eager")
TESSERA_EFFICIENCY = 1.0

# recomputation as a share of the step's FLOPs, per activation checkpointing mode (topology/memory.py's
# AC_MODES, every one): full reruns every block's forward (1/3 of fwd + bwd), selective half of them; op reruns
# only the norms, RoPE and SwiGLU's elementwise ops, memory-bound work costed at 3% of the step (an
# assumption, stated in `tessera plan`'s output). The planner tries the modes cheapest first.
RECOMPUTE: dict[str, float] = {"none": 0.0, "op": 0.03, "selective": 1 / 6, "full": 1 / 3}
assert set(RECOMPUTE) == set(MEMORY_AC_MODES), "a recompute share for every activation checkpointing mode"
AC_MODES = tuple(sorted(RECOMPUTE, key=RECOMPUTE.__getitem__))
AC_POLICIES = ("tessera", "torchtitan")  # whose `ac op` a plan counts (Hardware.ac_policy)
# the strategies it enumerates: NO_SHARD and HYBRID_SHARD are layouts with dp_replicate, which it enumerates
STRATEGIES = tuple(s for s in FSDP_STRATEGIES if s in ("FULL_SHARD", "SHARD_GRAD_OP"))
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev", "looped-bfs", "gpipe")

FSDP = FLATTENED_BY_PURPOSE["fsdp"]  # FSDP2's group: dp_shard x cp
# a candidate's degree flags: the axes the planner enumerates (mesh order), then --dp and --dp-replicate, the
# flags of the axes that take the ranks left over
FLAG_ORDER: tuple[Axis, ...] = tuple(a for a in TABLE if a.name not in rest_axes()) + tuple(
    AXIS[n] for n in rest_axes()
)


def fsdp_degree(layout: Layout) -> int:
    """The ranks FSDP2 shards over (dp_shard x cp; 1: no FSDP)."""
    return layout.degree(FSDP.name)


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory_gb: float = 80.0
    gpus_per_node: int = 8
    # the dense peak per GPU: with `efficiency`, the uncalibrated compute rate; and what MFU is measured
    # against. None: H100's without a calibration; with one, unknown (a calibration measures rates, not a
    # peak), and no MFU is computed
    peak_tflops: float | None = None
    efficiency: float = DEFAULT_EFFICIENCY
    intra_node_gbps: float = DEFAULT_INTRA_GBPS
    inter_node_gbps: float = DEFAULT_INTER_GBPS
    hbm_gbps: float = DEFAULT_HBM_GBPS  # what MoE experts' weights stream at (expert_weight_seconds)
    headroom: float = 0.10  # share of memory kept free for the CUDA context, NCCL and fragmentation
    dtype_bytes: int = 2  # compute dtype (bf16); activations and the gathered copy use it
    recipe: str = "mixed_adam"
    # measured rates of the device kind (tessera plan --calibrate): they replace peak x efficiency
    calibration: Calibration | None = None
    # --fp8's recipe (None: off): FP8 matmuls at FP8_MATMUL_SPEEDUP x the bf16 (or calibrated) rate, their
    # casts' memory traffic, and FSDP2's float8 all-gather under tensorwise (topology/fp8_model.py)
    fp8: str | None = None
    # a machine's datasheet (topology/hardware.py): with it, and without a calibration, the step is
    # topology/step_model.py's physics and `efficiency` is the framework's software efficiency
    profile: HardwareProfile | None = None
    compile: bool = False  # torch.compile's fusion of the elementwise work (the profile's compiled_elementwise)
    async_tp: bool = False  # the tp collectives overlapped with the matmuls they feed
    ep_overlap: bool = False  # the expert all-to-alls overlapped with another microbatch's compute
    attention: str = "cudnn"  # the attention kernels' backend (the profile's attention_share)
    loss: str = "chunked"  # `tessera train --loss`: chunked (never the whole logits) or logits
    # whose per-op checkpointing `ac op` is: tessera's (every matmul output kept) or torchtitan's (every other)
    ac_policy: str = "tessera"
    # --offload's links (topology/offload_model.py), at the shares a copy and the host step reach: PCIe per GPU
    # and direction (H100's Gen5 x16, 64 GB/s, at 0.8), the host's DRAM per node (DGX H100's 614 GB/s at 0.5),
    # and the host memory per node the offloaded states must fit in (None: unknown, not checked)
    pcie_gbps: float = 51.2
    host_memory_gbps: float = 307.2
    host_memory_gb: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name}={v!r} must be a positive integer")
        if self.peak_tflops is None and self.calibration is None:
            object.__setattr__(self, "peak_tflops", H100_BF16_TFLOPS)
        for name in (
            "gpu_memory_gb",
            "peak_tflops",
            "intra_node_gbps",
            "inter_node_gbps",
            "hbm_gbps",
            "pcie_gbps",
            "host_memory_gbps",
            "host_memory_gb",
        ):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):  # inf would make every step take no time
                raise PlanError(f"{name}={v!r} must be a positive, finite number")
        if not 0 < self.efficiency <= 1 and self.profile is not None:
            raise PlanError(
                f"efficiency={self.efficiency:g} must be in (0, 1]: the framework's software efficiency, the share "
                f"of the kernels' rates of {self.profile.name} a step reaches; use e.g. efficiency="
                f"{TESSERA_EFFICIENCY:g} (tessera's)"
            )
        if not 0 < self.efficiency <= 1:  # a share of the peak (5 printed "500% of 989 TFLOP/s", MFU 451%)
            raise PlanError(
                f"efficiency={self.efficiency:g} must be in (0, 1]: the share of `peak_tflops` a step's matmuls "
                f"reach; use e.g. efficiency={DEFAULT_EFFICIENCY:g}"
            )
        if not 0 <= self.headroom < 1:
            raise PlanError(f"headroom={self.headroom!r} must be in [0, 1)")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(
                f"gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                f"use a multiple of {self.gpus_per_node}"
            )
        get_recipe(self.recipe)
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise PlanError(
                f"fp8={self.fp8!r} is not an FP8 recipe: use one of {', '.join(FP8_RECIPES)}, or plan without fp8"
            )
        if self.ac_policy not in AC_POLICIES:
            raise PlanError(f"ac_policy={self.ac_policy!r}: use one of {', '.join(AC_POLICIES)}")
        if self.loss not in ("chunked", "logits"):
            raise PlanError(f"loss={self.loss!r}: use chunked or logits")
        if self.attention not in ATTENTION_BACKENDS:
            raise PlanError(f"attention={self.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
        if self.fp8 is not None and self.profile is not None and self.profile.fp8_tflops is None:
            raise PlanError(
                f"fp8={self.fp8!r} on {self.profile.name}: that GPU has no FP8 tensor cores; plan with fp8=None"
            )

    @classmethod
    def from_profile(cls, profile: "HardwareProfile | str", gpus: int, **settings) -> "Hardware":
        """The Hardware of `gpus` GPUs of a profile (a name, a JSON file or a HardwareProfile): its peak, HBM,
        node size, and its links and HBM at the shares a step reaches (the profile's `achieved`); `settings`
        replace any field (efficiency, headroom, fp8, compile, async_tp, ...)."""
        prof = load_profile(profile) if isinstance(profile, str) else profile
        a = prof.achieved
        base = dict(
            gpu_memory_gb=prof.hbm_gb,
            gpus_per_node=prof.gpus_per_node,
            peak_tflops=prof.bf16_tflops,
            efficiency=TESSERA_EFFICIENCY,
            intra_node_gbps=prof.intra_node_gbps * a.link_share,
            inter_node_gbps=prof.inter_node_gbps * a.link_share,
            hbm_gbps=prof.hbm_gbps * a.hbm_share,
            host_memory_gb=prof.host_memory_gb,
        )
        if prof.pcie_gbps is not None:
            base["pcie_gbps"] = prof.pcie_gbps * a.pcie_share
        if prof.host_memory_gbps is not None:
            base["host_memory_gbps"] = prof.host_memory_gbps * a.host_memory_share
        return cls(gpus=gpus, profile=prof, **{**base, **settings})

    @property
    def fp8_peak_flops_per_s(self) -> float | None:
        """The dense FP8 peak (the profile's; twice the bf16 peak without one, as the datasheets have it)."""
        if self.profile is not None:
            return None if self.profile.fp8_tflops is None else self.profile.fp8_tflops * 1e12
        return None if self.peak_tflops is None else 2 * self.peak_tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GB * (1 - self.headroom)

    @property
    def peak_flops_per_s(self) -> float:
        """peak_tflops in FLOP/s; only without a calibration (where __post_init__ fills in H100's) or when given."""
        if self.peak_tflops is None:
            raise ValueError("peak_tflops is unknown: this Hardware has a calibration and no peak_tflops")
        return self.peak_tflops * 1e12

    def describe(self) -> str:
        """What the ranks are, for a plan's header: '8 GPUs of 80 GB (8 per node)'; with a calibration its
        device kind too, and a CPU's ranks called CPU ranks: "1 CPU rank of 80 GB (8 per node; the CPU
        calibration 'cpu: ..., 1 thread')"."""
        cal = self.calibration
        ranks = plural(self.gpus, "CPU rank" if cal is not None and cal.device_type == "cpu" else "GPU")
        where = "" if cal is None else f"; the {cal.device_type.upper()} calibration {cal.device_kind!r}"
        return f"{ranks} of {self.gpu_memory_gb:g} GB ({self.gpus_per_node} per node{where})"


def plural(n: int, noun: str) -> str:
    """'1 GPU', '8 GPUs'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    strategy: str = "FULL_SHARD"
    ac: str = "none"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    sp: bool | None = None  # sequence parallel; None: on whenever tp > 1
    offload: str = "none"  # --offload: model states in host memory (topology/offload_model.py)

    @property
    def sequence_parallel(self) -> bool:
        # the planner always turns it on: it divides the norms' activations by tp at no extra traffic
        return self.layout.tp > 1 if self.sp is None else self.sp and self.layout.tp > 1

    def describe(self) -> str:
        parts = [
            str(self.layout),
            self.strategy if fsdp_degree(self.layout) > 1 else "no FSDP",
            f"ac {self.ac}",
            f"mb {self.microbatches}",
        ]
        if self.layout.pp > 1:
            parts.insert(1, self.schedule + (f" v{self.virtual}" if self.virtual > 1 else ""))
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return ", ".join(parts)

    def flags(self) -> str:
        """The `tessera train` flags that run this candidate: each axis's flag of topology/axes.py's table
        (--dp counts dp_replicate x dp_shard), then the options."""
        lay = self.layout
        degrees = {a.flag: math.prod(getattr(lay, n) for n in a.counts) for a in FLAG_ORDER}
        out = [f"{a.option} {degrees[a.flag]}" for a in FLAG_ORDER if degrees[a.flag] > 1]
        if fsdp_degree(lay) > 1 and self.strategy != "FULL_SHARD":
            out.append(f"--fsdp {self.strategy}")
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.ac != "none":
            out.append(f"--ac {self.ac}")
        if self.microbatches > 1:
            out.append(f"--microbatches {self.microbatches}")
        if lay.pp > 1 and self.schedule != "1f1b":
            out.append(f"--schedule {self.schedule}")
        if self.virtual > 1:
            out.append(f"--virtual {self.virtual}")
        if self.offload != "none":
            out.append(f"--offload {self.offload}")
        return " ".join(out)


@dataclass
class Estimate:
    candidate: Candidate
    memory: dict[str, float]  # bytes per rank by component, "total" included
    time: dict[str, float]  # seconds per step by component, "step" included
    comm_bytes: dict[str, float]  # bytes each rank sends per step, by axis (ring-algorithm volumes)
    tokens_per_s: float
    mfu: float | None  # None: no peak to measure it against (a calibration without peak_tflops)
    fits: bool
    bubble: float
    compute_parts: dict[str, float] = field(default_factory=dict)  # calibrated: the compute's components

    def as_dict(self) -> dict:
        c = self.candidate
        return {
            "layout": c.layout.as_dict(),
            "strategy": c.strategy,
            "ac": c.ac,
            "schedule": c.schedule,
            "microbatches": c.microbatches,
            "virtual": c.virtual,
            "sequence_parallel": c.sequence_parallel,
            "flags": c.flags(),
            "memory_bytes": self.memory,
            "time_s": self.time,
            "comm_bytes": self.comm_bytes,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble": self.bubble,
            "fits": self.fits,
            **({"compute_parts_s": self.compute_parts} if self.compute_parts else {}),
        }


# ----------------------------------------------------------------------------- parameter counts
@functools.lru_cache(maxsize=65536)
def rank_params_of(
    shape, tp: int, pp: int, virtual: int, fsdp: int, pp_rank: int, ep: int = 1, placement: str = "loop"
) -> tuple[int, int, int]:
    """(parameters before FSDP, after FSDP, largest FSDP unit) on pipeline rank `pp_rank` of a model of
    `shape` (a ModelShape): after tp and ep (E / ep experts per MoE block), FSDP2 cuts every tensor's dim 0
    over the `fsdp` ranks of dp_shard x cp, the experts under ep over the fsdp / ep ranks ep leaves (its
    rank 0's shard, the largest). The largest unit is a whole block gathered (its experts' unit with it)."""
    cfg = as_shape(shape)
    n_stages = pp * virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    groups = layer_shard_groups(cfg, tp, ep, fsdp)
    block_numel = sum(r * c for shapes, _ in groups for r, c in shapes)
    block_sharded = sum(fsdp_shard_numel(r, c, n) for shapes, n in groups for r, c in shapes)
    stages = stages_on_rank(pp_rank, pp, virtual, placement)
    n_blocks = sum(layers[s] for s in stages)
    extra = [u for s in stages for u in stage_param_shapes(cfg, tp, s == 0, s == n_stages - 1, 0)]
    numel = n_blocks * block_numel + sum(r * c for u in extra for r, c in u)
    sharded = n_blocks * block_sharded + sum(fsdp_shard_numel(r, c, fsdp) for u in extra for r, c in u)
    unit_max = max([block_numel if n_blocks else 0] + [sum(r * c for r, c in u) for u in extra])
    return numel, sharded, unit_max


def rank_params(
    shape, tp: int, pp: int, virtual: int, fsdp: int, ep: int = 1, placement: str = "loop"
) -> tuple[int, int, int]:
    """`rank_params_of` for the pp rank that holds the most: pp rank 0 (the embedding) or the last (the head)."""
    return max(
        (rank_params_of(shape, tp, pp, virtual, fsdp, p, ep, placement) for p in sorted({0, pp - 1})),
        key=lambda x: x[0],
    )


# ----------------------------------------------------------------------------- activations
def layer_activation_bytes(
    shape,
    rows: int,
    seq: int,
    tp: int,
    sequence_parallel: bool,
    ac: str,
    e: int,
    cp: int = 1,
    layer: int = 0,
    cpu: bool | None = None,
    op_policy: str = "tessera",
) -> float:
    """Bytes one block keeps for backward for `rows` sequences of `seq` local tokens on one tp rank, as
    tessera's block saves them (counted with saved-tensor hooks; tests/test_planner_memory.py measures it).

    ac none, elements per token: each RMSNorm's input and x * rstd (seq/tp tokens under sequence parallel)
    and its output, which the column-parallel matmuls keep (gathered: seq tokens); q, k and v after RoPE
    (k and v repeated to the query heads for the fused kernel; ring attention keeps them at the kv heads),
    the attention output and its (B, S, heads x dim) copy that the output projection reads; SwiGLU's gate
    and up outputs, silu(gate) and the product the down projection reads (ffn / tp each; a GELU MLP: its up
    matrix's output and the GELU of it); with qk-norm, the q and k norms' inputs and x * rstd; the
    log-sum-exp (fp32) and the norms' rstd (a layer norm keeps its input, mean and rstd instead:
    F.layer_norm).
    op: matmul and attention outputs (q, k, v, out, the output projection, the MLP's matrices) and the block
    input; the rest recomputed. full: only the block input. (selective checkpoints every other block:
    `_rank_memory` combines them.)
    An MoE block (an estimate, not counted with hooks): each token's top_k assignments keep an MLP's
    tensors each (ffn / tp wide) plus their dispatched input and combined output (dim wide), the router's
    fp32 scores (n_experts per token), and a shared expert a dense MLP's.
    Blocks of another kind (latent attention, sinks, sliding windows, dense layers beside MoE ones, biased or
    clamped experts) are counted per block `layer` without checkpointing by topology/activations.py, whose
    attention takes the CPU's paths when `cpu` (None: for fp32 compute, as tessera's CPU runs are).
    """
    cfg = as_shape(shape)
    if ac == "none" and uses_block_model(cfg):
        on_cpu = e >= 4 if cpu is None else cpu
        return block_activation_bytes(cfg, layer, rows, seq, tp, sequence_parallel, e, on_cpu, cp)
    h, f = cfg.dim, cfg.ffn_dim // tp
    hq = cfg.n_heads * cfg.head_dim // tp
    kv = _kv_out(cfg, tp)
    ups = cfg.mlp_matrices - 1
    sp = seq // tp if sequence_parallel else seq
    rms = cfg.norm == "rms"
    # lse and the norms' statistics (fp32): rstd per token (a layer norm's mean too), the qk-norms' per head
    small = rows * seq * (cfg.n_heads // tp) * 4 + (2 if rms else 4) * rows * sp * 4
    if cfg.qk_norm:
        small += rows * seq * (hq + kv) // cfg.head_dim * 4
    if ac == "full":
        return float(rows * sp * h * e)
    # the MLP's tensors per token: (kept by the op policy, kept without checkpointing)
    if cfg.n_experts:
        sf = cfg.shared_ffn_dim // tp
        mlp_op = cfg.top_k * (ups * f + h) + ups * sf
        mlp_all = cfg.top_k * (2 * ups * f + 2 * h) + 2 * ups * sf
        small += rows * seq * cfg.n_experts * 4
    else:
        mlp_op, mlp_all = ups * f, 2 * ups * f
    # ring attention and the GPU's kernel keep q, k and v at their own heads and the output; the CPU's fused
    # op keeps k and v repeated to the query heads
    on_cpu = e >= 4 if cpu is None else cpu
    attention = (hq + 2 * kv + hq) if cp > 1 or not on_cpu else 4 * hq
    if ac == "op":
        # the matmul outputs: q, k and v, the two row-parallel outputs, the MLP's up matrices'
        matmuls: float = seq * (hq + 2 * kv) + 2 * sp * h + seq * mlp_op
        if op_policy == "torchtitan":  # its per-op SAC keeps every other matmul's output (the rest recomputed)
            matmuls /= 2
        saved = sp * h + seq * hq + matmuls
        return float(rows * saved * e + small)
    norms = (4 if rms else 2) * sp * h + 2 * seq * h + (2 * seq * (hq + kv) if cfg.qk_norm else 0)
    saved = norms + seq * (attention + hq) + seq * mlp_all
    return float(rows * saved * e + small)


def _kv_out(shape: ModelShape, tp: int) -> int:
    """k (or v) features a tp rank computes: its share of the kv heads, or the one head its query heads
    read when tp exceeds the kv heads."""
    return shape.n_kv_heads * shape.head_dim // tp if kv_heads_split(shape.n_kv_heads, tp) else shape.head_dim


def loss_activation_bytes(
    shape, rows: int, seq: int, tp: int, sequence_parallel: bool, e: int, loss: str = "chunked"
) -> tuple[float, float]:
    """(kept per microbatch until its backward, transient) on the last stage, for `--loss`:
    both: the final norm's input and x * rstd (sequence-parallel shards) and its gathered output;
    logits: the vocab-parallel softmax (fp32) kept, then the logits, their fp32 copy and their gradient;
    chunked (the default, parallel/loss.py): the gradients computed in the forward are kept (dh in the
    compute dtype, dW in fp32), and one chunk at a time holds its fp32 logits, their compute-dtype copy
    and gradient, plus dW's compute-dtype matmul result when that is not fp32."""
    cfg = as_shape(shape)
    vocab = -(-cfg.vocab_size // tp)
    sp = seq // tp if sequence_parallel else seq
    norm = rows * (2 * sp * cfg.dim * e + seq * cfg.dim * e)
    if loss == "logits":
        return float(norm + rows * seq * vocab * 4), float(rows * seq * vocab * (e + 2 * 4))
    chunk = chunk_tokens(rows * seq, vocab, hidden=cfg.dim)
    kept = norm + vocab * cfg.dim * 4  # (dh, the gathered output's size, is in `norm`)
    transient = chunk * vocab * (4 + 2 * e) + (vocab * cfg.dim * e if e < 4 else 0)
    return float(kept), float(transient)


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
        cand.strategy,
        cand.virtual,
        cand.ac,
        "ring",
        rank=0,
        act_bytes=e,
        param_bytes=fsdp_param_bytes(cfg, e, hw.fp8, lay.tp),
        reduce_bytes=4,
        placement=placement_of(cand.schedule),
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
    """The step with --offload's copies and host optimizer (topology/offload_model.py) in place of the GPU's
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
    overlapped = sum(t[name] for name in COMM_AXES if name in OVERLAPPED)
    time = {
        "compute": compute,
        "bubble": compute_stretched - compute,
        **{name: t[name] for name in comm if name not in OVERLAPPED},
        "exposed_overlapped_comm": max(0.0, overlapped - compute),
    }
    time["step"] = sum(time.values())
    return time, parts


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
    (topology/step_model.py's physics), for the pp rank whose step is longest; `comm`: the bytes each accounting
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
            local = max(1, min(lay.ep, hw.gpus_per_node // lay.tp))
            remote = (lay.ep - local) / (lay.ep - 1)
            wire = max(sent * (1 - remote) / (hw.intra_node_gbps * GB), sent * remote / bandwidth)
        seconds[name] = wire + latency_seconds(counts.get(name, 0.0), inter, profile)
    exposed = exposed_comm(
        seconds,
        parts,
        tp=lay.tp,
        pp=lay.pp,
        microbatches=cand.microbatches,
        units=busiest + 2,
        async_tp=hw.async_tp,
        ep_overlap=hw.ep_overlap,
    )
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
    its host dispatches the operators of its stage's blocks (topology/step_time.py)."""
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


def _rank_memory(
    cfg: ModelShape, cand: Candidate, hw: Hardware, pp_rank: int, in_flight: int, mb_rows: int, seq: int, fsdp: int
) -> dict[str, float]:
    """Peak bytes on a rank of pipeline rank `pp_rank`, by component. The peak is the start of the last
    backward (activations, the loss, accumulated gradients all live) or the optimizer step (gradients
    and optimizer state), whichever is larger; "total" is that peak."""
    lay, e, r = cand.layout, hw.dtype_bytes, get_recipe(hw.recipe)
    n_stages = lay.pp * cand.virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    placement = placement_of(cand.schedule)
    stages = stages_on_rank(pp_rank, lay.pp, cand.virtual, placement)
    tp_local, sharded, unit_max = rank_params_of(cfg, lay.tp, lay.pp, cand.virtual, fsdp, pp_rank, lay.ep, placement)
    stage = 0 if fsdp == 1 else (2 if cand.strategy == "SHARD_GRAD_OP" else 3)
    # FSDP2 keeps every strategy's parameters sharded at rest; SHARD_GRAD_OP's are also gathered from
    # forward to backward (gathered_params below): the ZeRO-2 figure of topology.memory plus that copy
    m: dict[str, float] = {
        "parameters": (sharded if stage >= 2 else tp_local) * r.parameters,
        "gradients": (sharded if stage >= 2 else tp_local) * r.gradients,
        "optimizer": (sharded if stage >= 1 else tp_local) * r.optimizer,
    }
    # FSDP2's gathered compute copy: one unit at a time under FULL_SHARD; the whole stage under
    # SHARD_GRAD_OP and inside a pipeline step (units stay gathered across microbatches)
    pipelined = lay.pp > 1
    # without data axes a compute dtype below fp32 runs FSDP2 on the degree-1 mesh for the precision policy
    # alone (parallelize): the whole stage's compute copy stays for the step
    # (--offload params runs FSDP2 there too: its CPUOffloadPolicy)
    keeps_gathered = (fsdp > 1 and (cand.strategy == "SHARD_GRAD_OP" or pipelined)) or (
        fsdp == 1 and (e < 4 or cand.offload == "params")
    )
    # (under FULL_SHARD one unit at the start of backward; two when backward recomputes a block, whose
    # re-gather overlaps the prefetch of the next)
    per_unit = 2 if cand.ac in ("full", "op") else 1
    m["gathered_params"] = tp_local * e if keeps_gathered else (per_unit * unit_max * e if fsdp > 1 else 0.0)
    # gradients of earlier microbatches, kept while later ones run (unsharded under FSDP until the sync);
    # a pipeline rank reaches its most forwards in flight before its first backward unless it runs more
    # forwards than that (the steady state of 1F1B)
    accumulating = cand.microbatches * cand.virtual > in_flight if pipelined else cand.microbatches > 1
    m["unsharded_grads"] = (tp_local * e if fsdp > 1 else m["gradients"]) if accumulating else 0.0
    cpu = e >= 4 or (hw.calibration is not None and hw.calibration.device_type == "cpu")
    # one count per checkpointing mode and block kind, not per block: blocks of one kind keep the same bytes
    # (on 48 layers the count per block was 70% of the planner's time)
    per_kind = uses_block_model(cfg)
    counted: dict[tuple, float] = {}

    def act(ac: str, layer: int) -> float:
        # compiled blocks: inductor's partitioner recomputes the elementwise ops in the backward, so a block
        # keeps what the op policy keeps (the matmul and attention outputs, the block input)
        if ac == "none" and hw.compile and not per_kind:
            ac = "op"
        key = (ac, layer_kind(cfg, layer) if per_kind and ac == "none" else None)
        if key not in counted:
            counted[key] = layer_activation_bytes(
                cfg,
                mb_rows,
                seq,
                lay.tp,
                cand.sequence_parallel,
                ac,
                e,
                cp=lay.cp,
                layer=layer,
                cpu=cpu,
                op_policy=hw.ac_policy,
            )
        return counted[key]

    starts = [sum(layers[:s]) for s in range(n_stages)]
    # each stage's blocks by index (a family's blocks may differ: dense or MoE, sliding or full attention)
    chunks = [range(starts[s], starts[s] + layers[s]) for s in stages]

    def mode(i: int, c: range) -> str:  # selective checkpoints blocks 0, 2, 4, ... of each stage
        return ("full" if (i - c.start) % 2 == 0 else "none") if cand.ac == "selective" else cand.ac

    def chunk_bytes(c: range) -> float:
        if per_kind:
            return sum(act(mode(i, c), i) for i in c)
        if cand.ac == "selective":  # (integral byte counts: n x a is the sum of n a's exactly)
            even = (len(c) + 1) // 2
            return even * act("full", c.start) + (len(c) - even) * act("none", c.start)
        return len(c) * act(cand.ac, c.start)

    # a recomputed block's activations come back one block at a time, during its backward: full adds a
    # whole block's, op the part its policy did not keep; selective recomputes the even blocks after the
    # odd ones above them have freed theirs, so it adds nothing to the peak at the start of backward
    def recomputed(i: int) -> float:
        if cand.ac in ("none", "selective") or (cand.ac == "op" and hw.compile):
            return 0.0
        return act("none", i) - (0.0 if cand.ac == "full" else act("op", i))

    blocks = [i for c in chunks for i in (c if per_kind else c[:1])]  # one of each kind
    recompute = max((recomputed(i) for i in blocks), default=0.0)
    acts = in_flight * max(chunk_bytes(c) for c in chunks) + recompute
    m["activations"] = acts
    last = n_stages - 1 in stages
    kept, transient = (
        loss_activation_bytes(cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, e, hw.loss) if last else (0.0, 0.0)
    )
    m["logits"] = (in_flight if cand.schedule in ("gpipe", "looped-bfs") else 1) * kept + transient
    kv_block = 2 * mb_rows * seq * _kv_out(cfg, lay.tp) * e
    # the rotary cos and sin tables, fp32 (none with learned positions: those are parameters)
    rope = 0 if cfg.learned_positions else 2 * (cfg.max_seq_len or seq * lay.cp) * (cfg.head_dim // 2) * 4
    m["buffers"] = (
        rope
        + (unit_max * 4 if fsdp > 1 else 0.0)
        + (2 * kv_block if lay.cp > 1 else 0.0)
        + (4 * mb_rows * seq * cfg.dim * e if pipelined else 0.0)
    )
    # the gradients flowing through one block's backward (its MLP's ffn-wide ones: SwiGLU's three, GELU's two;
    # two residual-wide)
    sp = seq // lay.tp if cand.sequence_parallel else seq
    mlp_width = (cfg.top_k * cfg.ffn_dim + cfg.shared_ffn_dim) if cfg.n_experts else cfg.ffn_dim  # per token
    m["backward_transient"] = float(mb_rows * (cfg.mlp_matrices * seq * mlp_width // lay.tp + 2 * sp * cfg.dim) * e)
    backward_start = (
        m["activations"] + max(m["logits"], m["backward_transient"]) + m["unsharded_grads"] + m["gathered_params"]
    )
    optimizer_step = 2 * m["gradients"]  # the gradients and the optimizer's temporaries of their size
    if hw.recipe in MUON_RECIPES:  # Muon's own accounting (topology/muon_memory.py)
        optimizer_step += _muon_memory(m, cfg, cand, hw, pp_rank, fsdp, stage, n_blocks=sum(layers[s] for s in stages))
    if cand.offload != "none":  # the states that leave the GPU (topology/memory.py's offload_split)
        split = offload_split({k: m[k] for k in ("parameters", "gradients", "optimizer")}, cand.offload, hw.recipe)
        m.update({k: split["device"][k] for k in ("parameters", "gradients", "optimizer")})
        m["host_offload"] = split["host"]["total"]  # in host memory, not in the device's total
        # the step runs on the host: the device holds the gradients it copies down (optimizer) or nothing
        optimizer_step = m["gradients"]
    m["total"] = m["parameters"] + m["optimizer"] + m["buffers"] + max(backward_start, optimizer_step)
    return m


def _muon_memory(
    m: dict[str, float],
    cfg: ModelShape,
    cand: Candidate,
    hw: Hardware,
    pp_rank: int,
    fsdp: int,
    stage: int,
    n_blocks: int,
) -> float:
    """Under a Muon recipe: add the second Adam moment of the parameters AdamW keeps to m["optimizer"], and
    return the step's transient (m["muon_gathered"]): the whole largest matrix its owner orthogonalizes."""
    lay = cand.layout
    moment, gathered = muon_extra_bytes(
        cfg, hw.recipe, lay.tp, lay.pp, cand.virtual, fsdp, pp_rank, lay.ep, placement_of(cand.schedule), stage >= 1
    )
    m["optimizer"] += moment
    m["muon_gathered"] = gathered if n_blocks else 0.0
    return m["muon_gathered"]


# ----------------------------------------------------------------------------- enumeration
def layout_degrees(
    shape, hw: Hardware, seq_len: int, global_batch: int, table: tuple[Axis, ...] = TABLE
) -> list[dict[str, int]]:
    """The degrees the planner tries, one dict per layout (every axis of `table`, in its order), read from
    the table: the axes with a mesh dimension of their own, innermost first (tp, cp, pp), each take the powers
    of two dividing the ranks left within their caps (`planner_degrees`: tp inside a node and at most the
    heads, cp at most 16, pp at most the layers); the other axes the rest axis's flag counts (dp_replicate)
    take powers of two of what they leave, and the rest axis (dp_shard) the remainder; an axis that borrows
    others' dimensions (expert parallel) then takes powers of two dividing their product. Degrees that break
    a rule of the table for this shape, sequence and batch are left out."""
    rest = next(a for a in table if a.planner.rest)
    by_name = {a.name: a for a in table}
    shared = [by_name[n] for n in rest.counts if n != rest.name]
    enumerated = [a for a in reversed(table) if not a.borrows and a.name not in rest.counts]
    steps = enumerated + shared + [rest] + [a for a in table if a.borrows]
    values = values_of(shape, table=table, seq_len=seq_len, global_batch=global_batch)
    out: list[dict[str, int]] = []

    def walk(i: int, left: int, degrees: dict[str, int]) -> None:
        if i == len(steps):
            full = {a.name: degrees[a.name] for a in table}
            if not any(a.problems(full, values) for a in table):
                out.append(full)
            return
        a = steps[i]
        if a is rest:
            walk(i + 1, 1, {**degrees, a.name: left})
            return
        ranks = math.prod(degrees[n] for n in a.borrows) if a.borrows else left
        for d in planner_degrees(a, ranks, shape, hw.gpus_per_node):
            walk(i + 1, left if a.borrows else left // d, {**degrees, a.name: d})

    walk(0, hw.gpus, {})
    return out


def candidates(shape, hw: Hardware, seq_len: int, global_batch: int) -> list[Candidate]:
    """Every layout tessera can run for this request (`runnable`: the checks tessera's ParallelConfig.check
    makes, in plain numbers) over the table's degrees (`layout_degrees`: tp inside a node, powers of two per
    axis), with the FSDP strategies, pipeline schedules, microbatches (1, 2, 4 and 8; or 1, 2 and 4 per
    stage) and activation checkpointing modes."""
    cfg = as_shape(shape)
    return [
        c
        for degrees in layout_degrees(cfg, hw, seq_len, global_batch)
        for c in candidates_of_layout(cfg, Layout(**degrees), seq_len, global_batch)
    ]


def candidates_of_layout(
    shape,
    lay: Layout,
    seq_len: int,
    global_batch: int,
    microbatches: list[int] | None = None,
    schedules: list[tuple[str, int]] | None = None,
) -> list[Candidate]:
    """The runnable settings of one layout: FSDP strategies, schedules, microbatches, checkpointing modes;
    `microbatches` and `schedules` ((kind, virtual) pairs) replace the counts and schedules the planner tries."""
    cfg = as_shape(shape)
    rows = global_batch // lay.dp
    out: list[Candidate] = []
    # inside a pipeline FSDP2 keeps units gathered across microbatches either way: one strategy
    for strategy in STRATEGIES if fsdp_degree(lay) > 1 and lay.pp == 1 else ("FULL_SHARD",):
        for sched, virtual in schedules or _schedules(lay.pp, cfg.n_layers):
            for mb in microbatches or _microbatch_counts(rows, lay.pp):
                for ac in AC_MODES:
                    cand = Candidate(lay, strategy, ac, sched, mb, virtual)
                    if runnable(cfg, cand, seq_len, global_batch):
                        out.append(cand)
    return out


def why_not_runnable(shape, cand: Candidate, seq_len: int, global_batch: int) -> str | None:
    """Why tessera would refuse to run `cand` for a model of `shape` (None: it runs): the checks of
    tessera.parallel's ParallelConfig.check (ring context parallel, the chunked loss) as plain arithmetic,
    so that the planner needs no torch. Context parallel splits the sequence into 2 x cp chunks (whose
    S / cp tokens split over tp under sequence parallel); tp divides the heads and the MLP width, and the kv
    heads divide tp or tp divides them; pp x virtual stages have a block each and the schedule can be built
    (a split-backward schedule runs without checkpointing); dp splits the global batch and the microbatches
    split a dp rank's rows."""
    cfg = as_shape(shape)
    lay, sp = cand.layout, cand.sequence_parallel
    if cand.strategy not in STRATEGIES or cand.ac not in AC_MODES:
        return f"strategy {cand.strategy!r} / ac {cand.ac!r}: the planner knows {STRATEGIES} and {AC_MODES}"
    if lay.cp > 1:
        multiple = math.lcm(2 * lay.cp, lay.cp * lay.tp) if sp and lay.tp > 1 else 2 * lay.cp
        if seq_len % multiple:
            return f"seq_len={seq_len} does not split into {multiple} chunks for cp={lay.cp}"
    try:  # the rules parallelize checks, in their words
        check_tensor_parallel(cfg, lay.tp)
        check_expert_parallel(cfg.n_experts, lay.ep, fsdp_degree(lay), cfg.family)
    except ValueError as e:
        return str(e)
    if lay.ep > 1 and cand.ac == "op":  # the experts' FSDP2 unit inside an op-checkpointed block (parallelize)
        return f"ac=op with ep={lay.ep} is not supported; use ac=full or ac=selective with expert parallel"
    if sp and (seq_len // lay.cp) % lay.tp:
        return f"sequence parallel needs the {seq_len // lay.cp} tokens of a cp rank divisible by tp={lay.tp}"
    if lay.pp > 1:
        try:
            check_schedule(cand.schedule, lay.pp, cand.microbatches, cand.virtual)
        except ValueError as e:
            return str(e)
        if lay.pp * cand.virtual > cfg.n_layers:
            return f"{lay.pp * cand.virtual} pipeline stages but only {cfg.n_layers} layers"
        if cand.schedule in SPLIT_BACKWARD and cand.ac != "none":
            return f"schedule={cand.schedule} with ac={cand.ac} is not supported"
    if global_batch % lay.dp:
        return f"global batch {global_batch} does not split over dp={lay.dp}"
    if (global_batch // lay.dp) % cand.microbatches:
        return f"microbatches={cand.microbatches} does not divide the {global_batch // lay.dp} rows of a dp rank"
    return None


def runnable(shape, cand: Candidate, seq_len: int, global_batch: int) -> bool:
    """Whether tessera runs `cand` for a model of `shape` (`why_not_runnable` says why not)."""
    return why_not_runnable(shape, cand, seq_len, global_batch) is None


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)]
    if n_layers >= 2 * pp:
        out += [("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2), ("looped-bfs", 2)]
    return out


def _microbatch_counts(rows: int, pp: int) -> list[int]:
    wanted = [1, 2, 4, 8] if pp == 1 else [pp, 2 * pp, 4 * pp]
    return [m for m in wanted if m <= rows and rows % m == 0]


@dataclass
class PlanResult:
    ranked: list[Estimate]  # the candidates that fit, best first
    closest: Estimate | None  # when nothing fits: the candidate needing the least memory
    considered: int
    request: dict = field(default_factory=dict)
    why: str = ""
    # an MoE model: the fastest fitting layout with expert parallel and its place in the ranking (1 = best),
    # shown beside the top ones when it is not among them (None: a dense model, or none fits)
    best_ep: tuple[int, Estimate] | None = None


def plan(
    shape,
    hw: Hardware,
    seq_len: int,
    global_batch: int,
    top: int | None = None,
    name: str | None = None,
    offload: str | None = None,
) -> PlanResult:
    """Rank every runnable layout for a model of `shape` (a ModelShape: `tessera plan` resolves a preset name
    with spec_of(config).shape(config)) on `hw`; raise PlanError saying what is short when none fits. `name`
    is what the request and the messages call the model (default: the shape's family). `offload`: every layout
    with its states there; None: without, unless nothing fits without (then the cheapest mode that fits)."""
    if isinstance(shape, str):
        raise TypeError(
            f"plan() takes a ModelShape, not the name {shape!r}: resolve it with tessera.models "
            f"(cfg = get_preset(name); spec_of(cfg).shape(cfg)), or run `tessera plan --model {shape}`"
        )
    cfg = as_shape(shape)
    model = name or cfg.family
    if seq_len < 1 or global_batch < 1:
        raise PlanError(f"seq_len={seq_len} and global_batch={global_batch} must be positive")
    cands = candidates(cfg, hw, seq_len, global_batch)
    request = {
        "model": model,
        "params": cfg.num_params(),
        "matmul_params": cfg.matmul_params(),
        "experts": cfg.n_experts,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "hardware": asdict(hw),
    }
    if not cands:
        raise PlanError(
            f"no layout of {plural(hw.gpus, 'GPU')} runs {model} with seq_len={seq_len} global_batch="
            f"{global_batch}: the global batch must split over dp (try a multiple of {hw.gpus}) and "
            f"tp must divide the {cfg.n_heads} heads"
        )
    if offload is not None:
        cands = [replace(c, offload=offload) for c in cands]
    estimates = [estimate(cfg, c, hw, seq_len, global_batch) for c in cands]
    offloaded = None
    if offload is None and not any(
        x.fits for x in estimates
    ):  # offload only where nothing fits without it: the cheaper mode first
        for mode in OFFLOAD_MODES[1:]:
            tried = [estimate(cfg, replace(c, offload=mode), hw, seq_len, global_batch) for c in cands]
            if any(x.fits for x in tried):
                estimates, offloaded = tried, mode
                break
    fitting = sorted(
        (x for x in estimates if x.fits),
        key=lambda x: (round(x.time["step"], 6), x.memory["total"], x.candidate.layout.cp, x.candidate.layout.pp),
    )
    closest = min(estimates, key=lambda x: x.memory["total"])
    result = PlanResult(fitting, None if fitting else closest, len(cands), request)
    result.why = why_best(result)  # against every fitting layout, not only the ones shown
    if offloaded is not None:
        best = fitting[0]
        cost = best.time["offload_copies"] + best.time["host_optimizer"]
        result.why = (
            f"no layout fits in {hw.gpu_memory_gb:g} GB without offload: offload={offloaded} moves "
            f"{best.memory['host_offload'] / GB:.1f} GB a rank to host memory and costs {cost:.2f} s of the "
            f"{best.time['step']:.2f} s step (host optimizer {best.time['host_optimizer']:.2f} s, exposed copies "
            f"{best.time['offload_copies']:.2f} s); " + result.why
        )
    result.best_ep = next(((i + 1, x) for i, x in enumerate(fitting) if x.candidate.layout.ep > 1), None)
    result.ranked = fitting[:top] if top else fitting
    if not fitting:
        floor = min_gpus(cfg.num_params(), hw.gpu_memory_gb, hw.recipe)
        raise PlanError(
            f"{model} does not fit on {plural(hw.gpus, 'GPU')} of {hw.gpu_memory_gb:g} GB at seq_len={seq_len} "
            f"global_batch={global_batch}: the closest of {len(cands)} layouts ({closest.candidate.describe()}) "
            f"needs {closest.memory['total'] / GB:.1f} GB per rank against {hw.usable_bytes / GB:.1f} GB usable "
            f"({hw.headroom:.0%} headroom), short by {(closest.memory['total'] - hw.usable_bytes) / GB:.1f} GB; "
            f"model states alone need at least {floor} GPUs of {hw.gpu_memory_gb:g} GB (fully sharded), so add "
            f"GPUs or shorten the sequence or batch"
            + (
                f"; with offload=optimizer or offload=params neither fits either (the node's "
                f"{'unknown' if hw.host_memory_gb is None else f'{hw.host_memory_gb:g} GB'} of host memory included)"
                if offload is None
                else f" (with offload={offload})"
            )
        )
    return result


def wins_by(faster: Estimate, slower: Estimate) -> tuple[str, float]:
    """(what `faster` gains most by, seconds per step) against `slower`: the part of the step time that
    differs most (compute, bubble, each exposed accounting name (tp, pp, ep), the overlapped excess), the
    compute named by what differs in it (`_compute_gain`). `gain_text` adds the settings that differ."""
    label, seconds, _ = _gain(faster, slower)
    return label, seconds


def gain_text(faster: Estimate, slower: Estimate) -> str:
    """`wins_by` in words, with the settings that differ: 'a smaller pipeline bubble (0.150 s/step;
    interleaved-1f1b v2 against 1f1b)'."""
    label, seconds, detail = _gain(faster, slower)
    return f"{label} ({seconds:.3f} s/step; {detail})"


def _gain(faster: Estimate, slower: Estimate) -> tuple[str, float, str]:
    """(label, seconds per step, detail: the settings that differ) of what `faster` gains most by."""
    diffs = {k: slower.time[k] - faster.time[k] for k in faster.time if k != "step"}
    key = max(diffs, key=lambda k: diffs[k])
    settings = _setting_differences(faster.candidate, slower.candidate)
    if key == "compute":
        label, detail = _compute_gain(faster, slower)
        return label, diffs[key], f"{detail}{settings}"
    label = {
        "bubble": "a smaller pipeline bubble",
        "tp": "less tensor-parallel traffic",
        "pp": "less pipeline traffic",
        "ep": "less expert-parallel all-to-all traffic",
        "exposed_overlapped_comm": "less data/context traffic left exposed",
        "recompute": "less recomputation",
        "optimizer": "a smaller optimizer step per rank",
        "cp": "less context-parallel traffic left exposed",
        "fsdp": "less data-parallel (FSDP) traffic left exposed",
    }.get(key, f"less {key} traffic")
    return label, diffs[key], settings


def _setting_differences(a: Candidate, b: Candidate) -> str:
    """The settings in which two candidates differ, as their descriptions write them: 'mb 1 against mb 2'."""

    def settings(c: Candidate) -> list[str]:
        schedule = c.schedule + (f" v{c.virtual}" if c.virtual > 1 else "") if c.layout.pp > 1 else "no pipeline"
        fsdp = c.strategy if fsdp_degree(c.layout) > 1 else "no FSDP"
        return [str(c.layout), schedule, fsdp, f"ac {c.ac}", f"mb {c.microbatches}"]

    return ", ".join(f"{x} against {y}" for x, y in zip(settings(a), settings(b)) if x != y) or "the same settings"


def _compute_gain(faster: Estimate, slower: Estimate) -> tuple[str, str]:
    """(label, the detail before the settings) of what makes `faster`'s compute shorter: less recomputation
    only where its checkpointing recomputes less; with a calibration, the part of the compute (host dispatch,
    memory traffic, matmuls, attention) that differs most; else the MoE experts' weight streaming
    (`expert_weight_seconds`), the rest of the compute that settings change."""
    if RECOMPUTE[faster.candidate.ac] < RECOMPUTE[slower.candidate.ac]:
        return "less recomputation", ""
    mine, theirs = faster.compute_parts, slower.compute_parts
    if "host" in mine and "host" in theirs:  # the calibrated model's parts
        parts = {k: theirs[k] - mine[k] for k in ("host", "memory", "matmul", "attention")}
        key = max(parts, key=lambda k: parts[k])
        if parts[key] > 0:
            if key == "host":
                return "fewer operators for the host to dispatch", (
                    f"{mine['operators']:,.0f} against {theirs['operators']:,.0f} per step: "
                )
            return {
                "memory": "less memory traffic per rank",
                "matmul": "fewer matmul FLOPs per rank",
                "attention": "fewer attention FLOPs per rank",
            }[key], ""
    if theirs.get("step", 0.0) - mine.get("step", 0.0) < slower.time["compute"] - faster.time["compute"]:
        return "less expert weight streaming", ""
    return "less compute per rank", ""


def why_best(result: PlanResult) -> str:
    """One sentence: what the top layout gains over the runner-up."""
    if not result.ranked:
        return ""
    best = result.ranked[0]
    if len(result.ranked) == 1:
        return f"{best.candidate.describe()} is the only layout that fits."
    ties = [x for x in result.ranked[1:] if x.time["step"] <= best.time["step"] * 1.001]
    tie_note = (
        f" {len(ties)} more layout(s) tie within 0.1% on time; it holds the least memory of them." if ties else ""
    )
    other = next((x for x in result.ranked[1:] if x.time["step"] > best.time["step"] * 1.001), None)
    if other is None:
        return f"all {len(result.ranked)} layouts shown tie within 0.1% on time; it holds the least memory per rank."
    return (
        f"it wins by {gain_text(best, other)}: an estimated {best.time['step']:.3f} s/step against "
        f"{other.time['step']:.3f} s for the next slower layout ({other.candidate.describe()}), at "
        f"{best.memory['total'] / GB:.1f} GB per rank against {other.memory['total'] / GB:.1f} GB.{tie_note}"
    )
