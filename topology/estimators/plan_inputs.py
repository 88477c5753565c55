"""What a plan is asked and what it answers, for topology/estimators/planner.py: the machine and the run's settings
(`Hardware`), one configuration of a model's run (`Candidate`: layout, FSDP strategy, checkpointing, schedule,
microbatches, offload), and what is estimated of it (`Estimate`); the defaults they start from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.topology.axes import (
    AXIS,
    FLATTENED_BY_PURPOSE,
    TABLE,
    Axis,
    rest_axes,
)
from tessera.topology.errors import PlanError  # no layout fits, or a request it cannot plan
from .fp8_model import (
    FP8_RECIPES,
)
from tessera.topology.hardware import ATTENTION_BACKENDS, HardwareProfile, load_profile
from tessera.topology.layout import Layout
from tessera.topology.memory import AC_MODES as MEMORY_AC_MODES
from tessera.topology.memory import FSDP_STRATEGIES, GB, get_recipe
from tessera.topology.estimators.ring_merge import RING_MERGES
from tessera.topology.estimators.step_time import Calibration

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s


# InfiniBand per GPU, as algorithm bandwidths a well-tuned collective reaches.
H100_BF16_TFLOPS = 989.0
DEFAULT_EFFICIENCY = 0.40  # share of peak that the matmuls reach in a real step (MFU of good runs: 0.35-0.45)
DEFAULT_INTRA_GBPS = 360.0  # GB/s per GPU inside a node (NVLink 4: 450 GB/s per direction, ~80% reached)
DEFAULT_INTER_GBPS = 40.0  # GB/s per GPU across nodes (400 Gb/s = 50 GB/s, ~80% reached)
DEFAULT_HBM_GBPS = 3000.0  # GB/s of a GPU's own memory (H100 SXM's HBM3: 3.35 TB/s, ~90% reached streaming)
# tessera's own software efficiency under a hardware profile (step_model.py): fitted once, on the lent
# H200's eager 1b row (benchmarks/bench_published.py's "tessera" source, anchor "tessera-h200-1b-eager")
TESSERA_EFFICIENCY = 1.0

# recomputation as a share of the step's FLOPs, per activation checkpointing mode (topology/memory.py's
# AC_MODES, every one): full reruns every block's forward (1/3 of fwd + bwd), selective half of them; op reruns
# only the norms, RoPE and SwiGLU's elementwise ops, memory-bound work costed at 3% of the step (an
# assumption, stated in `tessera plan`'s output). The planner tries the modes cheapest first.
RECOMPUTE: dict[str, float] = {"none": 0.0, "op": 0.03, "selective": 1 / 6, "full": 1 / 3}
assert set(RECOMPUTE) == set(MEMORY_AC_MODES), "a recompute share for every activation checkpointing mode"
AC_MODES = tuple(sorted(RECOMPUTE, key=RECOMPUTE.__getitem__))
LOSS_MODES = ("chunked", "logits", "compiled-logits")
DATA_PARALLEL_STATES = ("fsdp2", "megatron")
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
    # casts' memory traffic, and FSDP2's float8 all-gather under tensorwise (topology/estimators/fp8_model.py)
    fp8: str | None = None
    # a machine's datasheet (topology/hardware.py): with it, and without a calibration, the step is
    # topology/estimators/step_model.py's physics and `efficiency` is the framework's software efficiency
    profile: HardwareProfile | None = None
    compile: bool = False  # torch.compile's fusion of the elementwise work (the profile's compiled_elementwise)
    async_tp: bool = False  # the tp collectives overlapped with the matmuls they feed
    # under tensorwise FP8 the sequence-parallel activation all-gathers move FP8 (torchao's float8 tp styles,
    # torchtitan's; tessera's tp layers gather in the compute dtype and cast after): for predicting its runs
    fp8_tp_gather: bool = False
    ep_overlap: bool = False  # the expert all-to-alls overlapped with another microbatch's compute
    # the expert group folds tp in: ep x tp ranks of whole experts (Megatron's MoE parallel folding, expert tp 1;
    # topology/estimators/comm_model.py's ep_over_tp)
    ep_over_tp: bool = False
    attention: str = "cudnn"  # the attention kernels' backend (the profile's attention_share)
    # context parallel as a framework runs it (for predicting its runs): the K/V heads its passes carry, "kv"
    # (tessera's, the model's own kv heads) or "query" (repeated to the query heads before attention, as
    # torchtitan's Llama does), and what hides them, "attention" (each pass behind its step's attention,
    # tessera's ring) or "first_step" (torch's all-gather rotater: each gather waited for before the second
    # step, hidden by the first step alone; the dK/dV passes behind their own steps)
    cp_kv_heads: str = "kv"
    cp_overlap: str = "attention"
    # whose ring merges the cp steps' partial outputs and gradients (topology/estimators/ring_merge.py):
    # tessera's, torch's templated ring (torchtitan's), or fused kernels (Transformer Engine's)
    cp_merge: str = "tessera"
    # `tessera train --loss`: chunked (never the whole logits) or logits; compiled-logits: the whole logits with a
    # compiled cross-entropy (another framework's, for predicting its runs)
    loss: str = "chunked"
    # whose per-op checkpointing `ac op` is: tessera's (every matmul output kept) or torchtitan's (every other)
    ac_policy: str = "tessera"
    # how a data axis without FULL_SHARD holds the model's states (for predicting another framework's runs):
    # "fsdp2" (tessera's: sharded at rest, gathered for compute) or "megatron" (Megatron's DDP with its
    # distributed optimizer: one bf16 parameter buffer, one gradient buffer (in grad_reduce_bytes' dtype) the
    # gradients accumulate and are reduce-scattered in, the fp32 master and Adam's moments sharded;
    # topology/estimators/rank_memory.py)
    data_parallel: str = "fsdp2"
    # the bytes of the dtype gradients are reduced (and, under "megatron", accumulated in their buffer) in:
    # 4, fp32 (tessera's and torchtitan's FSDP2 reduce_dtype); 2, bf16, for a framework that reduces in bf16
    # (Megatron-Bridge's performance scripts: grad_reduce_in_fp32 = False)
    grad_reduce_bytes: int = 4
    # --offload's links (offload_model.py), at the shares a copy and the host step reach: PCIe per GPU
    # and direction (H100's Gen5 x16, 64 GB/s, at 0.8), the host's DRAM per node (DGX H100's 614 GB/s at 0.5),
    # and the host memory per node the offloaded states must fit in (None: unknown, not checked)
    # --fault-tolerant: the replicate axis through torchft (step_estimate.py's _replica_seconds), its
    # gradient buffer counted (topology/estimators/rank_memory.py)
    fault_tolerant: bool = False
    # the ranks' device when it is known to be a CPU (a run's own estimate, runtime/training/estimate.py): its
    # attention and norms take the CPU's paths whatever the dtype (None: GPU paths below fp32, CPU's in fp32)
    device_type: str | None = None
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
        if self.loss not in LOSS_MODES:
            raise PlanError(f"loss={self.loss!r}: use one of {', '.join(LOSS_MODES)}")
        if self.grad_reduce_bytes not in (2, 4):
            raise PlanError(f"grad_reduce_bytes={self.grad_reduce_bytes!r}: use 4 (fp32) or 2 (bf16)")
        if self.data_parallel not in DATA_PARALLEL_STATES:
            raise PlanError(f"data_parallel={self.data_parallel!r}: use one of {', '.join(DATA_PARALLEL_STATES)}")
        if self.cp_merge not in RING_MERGES:
            raise PlanError(f"cp_merge={self.cp_merge!r}: use one of {', '.join(RING_MERGES)}")
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
        device kind too, and a CPU's ranks called CPU ranks, each holding its share of the host's memory:
        "2 CPU ranks of 12.6 GB of host memory (8 per node; the CPU calibration 'cpu: ..., 1 thread')"."""
        cal = self.calibration
        cpu = cal is not None and cal.device_type == "cpu"
        ranks = plural(self.gpus, "CPU rank" if cpu else "GPU")
        where = "" if cal is None else f"; the {cal.device_type.upper()} calibration {cal.device_kind!r}"
        memory = f"{self.gpu_memory_gb:.4g} GB" + (" of host memory" if cpu else "")
        return f"{ranks} of {memory} ({self.gpus_per_node} per node{where})"


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
    offload: str = "none"  # --offload: model states in host memory (topology/estimators/offload_model.py)

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
