"""The layout planner: which (pp, dp_replicate, dp_shard, cp, tp) layout, FSDP strategy, pipeline schedule and
activation checkpointing to use for a model on N GPUs, before reserving them.

For every candidate layout the planner estimates, per rank:

memory  model states (parameters, gradients, optimizer: topology.memory's recipe, counted for the rank
        that holds the most: the first pipeline stage's embedding or the last one's head, the kv
        projections replicated when tp exceeds the kv heads, ceil-division shards as FSDP2 cuts them)
      + the unsharded compute copy FSDP2 gathers (one unit and its prefetch under FULL_SHARD; the whole
        stage under SHARD_GRAD_OP and inside a pipeline step, where parameters stay gathered across
        microbatches) and the unsharded gradients that gradient accumulation keeps until the last one
      + activations: the tensors each block saves for backward (`layer_activation_bytes`), times the
        microbatches in flight on the busiest pipeline rank (from the schedule simulator), reduced by
        activation checkpointing, plus the vocab-parallel loss's logits
      + communication buffers (a unit's reduce-scatter input, ring K/V blocks, pipeline send/receive)
step    model FLOPs (6 N per token plus causal attention, the formula in `model_flops_per_token`) and
        recomputation at `efficiency` x `peak_tflops`, stretched by the pipeline bubble from the simulator;
        tp and pp traffic exposed; FSDP and ring K/V traffic overlapped with compute (only their excess
        over compute is exposed). Each axis's bytes go over the intra-node bandwidth when its group fits
        inside a node (the mesh order puts tp innermost), else over the inter-node bandwidth.

Candidates that do not fit `gpu_memory_gb x (1 - headroom)` are ruled out; the rest are ranked by
estimated step time (then memory). The figures are estimates with stated assumptions; `tessera plan
--dry-run` builds the chosen layout on the fake backend and counts its parameters exactly, and `tessera
bench` puts the predictions beside measurements.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from .comm_model import comm_bytes_per_step
from .layout import AXES, Layout, divisors
from .memory import GB, get_recipe, min_gpus

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s
# InfiniBand per GPU, as algorithm bandwidths a well-tuned collective reaches.
H100_BF16_TFLOPS = 989.0
DEFAULT_EFFICIENCY = 0.40  # share of peak that the matmuls reach in a real step (MFU of good runs: 0.35-0.45)
DEFAULT_INTRA_GBPS = 360.0  # GB/s per GPU inside a node (NVLink 4: 450 GB/s per direction, ~80% reached)
DEFAULT_INTER_GBPS = 40.0  # GB/s per GPU across nodes (400 Gb/s = 50 GB/s, ~80% reached)

AC_MODES = ("none", "op", "selective", "full")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "gpipe")


class PlanError(ValueError):
    """No layout fits, or the request itself is malformed; the message says what is short."""


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory_gb: float = 80.0
    gpus_per_node: int = 8
    peak_tflops: float = H100_BF16_TFLOPS
    efficiency: float = DEFAULT_EFFICIENCY
    intra_node_gbps: float = DEFAULT_INTRA_GBPS
    inter_node_gbps: float = DEFAULT_INTER_GBPS
    headroom: float = 0.10  # share of memory kept free for the CUDA context, NCCL and fragmentation
    dtype_bytes: int = 2  # compute dtype (bf16); activations and the gathered copy use it
    recipe: str = "mixed_adam"

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
        for name in ("gpu_memory_gb", "peak_tflops", "efficiency", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, name) > 0:
                raise PlanError(f"--{name.replace('_', '-')} {getattr(self, name)!r} must be positive")
        if not 0 <= self.headroom < 1:
            raise PlanError(f"--headroom {self.headroom!r} must be in [0, 1)")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(f"--gpus {self.gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                            f"use a multiple of {self.gpus_per_node}")
        get_recipe(self.recipe)

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GB * (1 - self.headroom)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    strategy: str = "FULL_SHARD"
    ac: str = "none"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.tp > 1  # always worth it: it divides the norms' activations by tp for free

    def describe(self) -> str:
        parts = [str(self.layout), self.strategy if self.layout.dp_shard * self.layout.cp > 1 else "no FSDP",
                 f"ac {self.ac}", f"mb {self.microbatches}"]
        if self.layout.pp > 1:
            parts.insert(1, self.schedule + (f" v{self.virtual}" if self.virtual > 1 else ""))
        return ", ".join(parts)

    def flags(self) -> str:
        """The `tessera train` flags that run this candidate."""
        lay = self.layout
        out = [f"--{a.replace('_', '-')} {getattr(lay, a)}" for a in ("pp", "cp", "tp") if getattr(lay, a) > 1]
        if lay.dp > 1:
            out.append(f"--dp {lay.dp}")
        if lay.dp_replicate > 1:
            out.append(f"--dp-replicate {lay.dp_replicate}")
        if lay.dp_shard * lay.cp > 1 and self.strategy != "FULL_SHARD":
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
        return " ".join(out)


@dataclass
class Estimate:
    candidate: Candidate
    memory: dict[str, float]  # bytes per rank by component, "total" included
    time: dict[str, float]  # seconds per step by component, "step" included
    comm_bytes: dict[str, float]  # bytes each rank sends per step, by axis (ring-algorithm volumes)
    tokens_per_s: float
    mfu: float
    fits: bool
    bubble: float

    def as_dict(self) -> dict:
        c = self.candidate
        return {"layout": c.layout.as_dict(), "strategy": c.strategy, "ac": c.ac, "schedule": c.schedule,
                "microbatches": c.microbatches, "virtual": c.virtual, "sequence_parallel": c.sequence_parallel,
                "flags": c.flags(), "memory_bytes": self.memory, "time_s": self.time, "comm_bytes": self.comm_bytes,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble, "fits": self.fits}


# ----------------------------------------------------------------------------- parameter counts
def _kv_local(cfg, tp: int) -> int:
    """Output features of the k (or v) projection on one tp rank: kv heads split, or all of them
    replicated when tp exceeds the kv heads (tessera's ReplicatedHeads keeps the whole weight)."""
    return cfg.n_kv_heads * cfg.head_dim // tp if cfg.n_kv_heads % tp == 0 else cfg.n_kv_heads * cfg.head_dim


def layer_param_shapes(cfg, tp: int) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter of one block on one tp rank, in the rows FSDP2 shards (dim 0)."""
    h, hd = cfg.dim, cfg.head_dim
    kv = _kv_local(cfg, tp)
    return [(h, 1), (cfg.n_heads * hd // tp, h), (kv, h), (kv, h), (h, cfg.n_heads * hd // tp), (h, 1),
            (cfg.ffn_dim // tp, h), (cfg.ffn_dim // tp, h), (h, cfg.ffn_dim // tp)]


def stage_param_shapes(cfg, tp: int, first: bool, last: bool, n_layers: int) -> list[list[tuple[int, int]]]:
    """One list of (rows, cols) per FSDP unit of a stage on one tp rank: embedding, blocks, norm + head."""
    vocab_rows = -(-cfg.vocab_size // tp)  # torch.chunk rows: ceil(V / tp)
    units = [[(vocab_rows, cfg.dim)]] if first else []
    units += [layer_param_shapes(cfg, tp) for _ in range(n_layers)]
    if last:
        units.append([(cfg.dim, 1), (vocab_rows, cfg.dim)])
    return units


@functools.lru_cache(maxsize=65536)
def rank_params(cfg, tp: int, pp: int, virtual: int, fsdp: int) -> tuple[int, int, int]:
    """(parameters before FSDP, after FSDP, largest FSDP unit) on the pp rank that holds the most: pp rank
    0 (the embedding) or the last (the head), with all of its virtual stages."""
    n_stages = pp * virtual
    layers = _split(cfg.n_layers, n_stages)
    block = layer_param_shapes(cfg, tp)
    block_numel = sum(r * c for r, c in block)
    block_sharded = sum(fsdp_shard_numel(r, c, fsdp) for r, c in block)
    best = (-1, 0, 0)
    for pp_rank in sorted({0, pp - 1}):
        stages = [pp_rank + k * pp for k in range(virtual)]
        n_blocks = sum(layers[s] for s in stages)
        extra = [u for s in stages for u in stage_param_shapes(cfg, tp, s == 0, s == n_stages - 1, 0)]
        numel = n_blocks * block_numel + sum(r * c for u in extra for r, c in u)
        sharded = n_blocks * block_sharded + sum(fsdp_shard_numel(r, c, fsdp) for u in extra for r, c in u)
        unit_max = max([block_numel if n_blocks else 0] + [sum(r * c for r, c in u) for u in extra])
        if numel > best[0]:
            best = (numel, sharded, unit_max)
    return best


def fsdp_shard_numel(rows: int, cols: int, shards: int, index: int = 0) -> int:
    """Elements FSDP2 leaves on shard `index` of a (rows, cols) tensor: torch.chunk of dim 0."""
    if shards == 1:
        return rows * cols
    per = -(-rows // shards)
    return max(0, min(per, rows - index * per)) * cols


# ----------------------------------------------------------------------------- activations
def layer_activation_bytes(cfg, rows: int, seq: int, tp: int, sequence_parallel: bool, ac: str, e: int) -> float:
    """Bytes one block keeps for backward for `rows` sequences of `seq` local tokens on one tp rank.

    Saved with ac none (elements, e bytes each): the two norm inputs (seq/tp tokens under sequence
    parallel), the two normed inputs of the column-parallel matmuls (gathered: seq tokens), q, k and v
    after RoPE and the attention output (heads / tp), the SwiGLU's w1 and w3 outputs, silu(w1) and the
    product fed to w2 (ffn / tp each); the attention's log-sum-exp in fp32.
    op: matmul and attention outputs are saved, the norms, RoPE and SwiGLU recomputed (torchtitan's policy).
    full: only the block input. selective checkpoints every other block (see `activation_bytes`).
    """
    h, f = cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim // tp, _kv_local(cfg, tp) if cfg.n_kv_heads % tp == 0 else cfg.head_dim
    sp = seq // tp if sequence_parallel else seq
    lse = rows * seq * (cfg.n_heads // tp) * 4
    if ac == "full":
        return float(rows * sp * h * e)
    if ac == "op":
        saved = sp * h + seq * (q + 2 * kv) + seq * q + 2 * seq * h + 2 * seq * f // tp
        return float(rows * saved * e + lse)
    saved = 2 * sp * h + 2 * seq * h + seq * (2 * q + 2 * kv) + 4 * seq * f // tp
    return float(rows * saved * e + lse)


def loss_activation_bytes(cfg, rows: int, seq: int, tp: int, e: int) -> float:
    """The last stage's loss per microbatch: the head's gathered input and its vocab-parallel logits
    (the compute dtype, then an fp32 copy for the log-softmax and its gradient)."""
    vocab = -(-cfg.vocab_size // tp)
    return float(rows * seq * (cfg.dim * e + vocab * (e + 2 * 4)))


# ----------------------------------------------------------------------------- the schedule
@functools.lru_cache(maxsize=4096)
def pipeline_profile(kind: str, pp: int, microbatches: int, virtual: int) -> tuple[float, int]:
    """(bubble fraction, most forwards in flight on any rank) from the schedule simulator, with a
    backward costing twice a forward (B = W = F for the kinds that split it)."""
    if pp == 1:
        return 0.0, 1
    from tessera.parallel.schedule import build_schedule, simulate

    timeline = simulate(build_schedule(kind, pp, microbatches, virtual), {"F": 1.0, "B": 1.0, "W": 1.0})
    return timeline.bubble, max(timeline.peak_activations)


# ----------------------------------------------------------------------------- flops
def model_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters in matmuls: all but the embedding table) + 6 x layers x
    dim x seq_len for causal attention (QK^T and PV, forward 2 x 2 x dim x seq / 2, backward twice that)."""
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.dim
    return 6.0 * matmul_params + 6.0 * cfg.n_layers * cfg.dim * seq_len


def _ring(bytes_: float, n: int, kind: str) -> float:
    """Bytes one rank sends in a ring collective on n ranks over a buffer of `bytes_`."""
    if n <= 1:
        return 0.0
    return bytes_ * (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)


def axis_bandwidth(layout: Layout, axis: str | tuple[str, ...], hw: Hardware) -> float:
    """GB/s for `axis`'s group: intra-node when the group lies inside one node (the axes after it in the
    mesh order and it span at most gpus_per_node ranks), else inter-node."""
    axes = (axis,) if isinstance(axis, str) else axis
    outer = min(AXES.index(a) for a in axes)
    span = math.prod(getattr(layout, a) for a in AXES[outer:])
    return (hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps) * GB


# ----------------------------------------------------------------------------- one estimate
def estimate(cfg, cand: Candidate, hw: Hardware, seq_len: int, global_batch: int) -> Estimate:
    lay, e = cand.layout, hw.dtype_bytes
    r = get_recipe(hw.recipe)
    n_stages = lay.pp * cand.virtual
    from_layers = _split(cfg.n_layers, n_stages)
    rows_per_dp = global_batch // lay.dp
    mb_rows = rows_per_dp // cand.microbatches
    seq = seq_len // lay.cp
    fsdp = lay.dp_shard * lay.cp
    pipelined = lay.pp > 1

    tp_local, sharded, unit_max = rank_params(cfg, lay.tp, lay.pp, cand.virtual, fsdp)
    stage = 0 if fsdp == 1 else (2 if cand.strategy == "SHARD_GRAD_OP" else 3)
    states = {"parameters": (sharded if stage == 3 else tp_local) * r.parameters,
              "gradients": (sharded if stage >= 2 else tp_local) * r.gradients,
              "optimizer": (sharded if stage >= 1 else tp_local) * r.optimizer}

    # FSDP2's gathered compute copy and the unsharded gradients gradient accumulation keeps
    keeps_gathered = fsdp > 1 and (cand.strategy == "SHARD_GRAD_OP" or pipelined)
    gathered = tp_local * e if keeps_gathered else (2 * unit_max * e if fsdp > 1 else 0.0)
    accumulating = fsdp > 1 and cand.microbatches > 1
    unsharded_grads = tp_local * e if accumulating else 0.0

    # activations on the busiest rank
    bubble, in_flight = pipeline_profile(cand.schedule, lay.pp, cand.microbatches, cand.virtual) if pipelined else (0.0, 1)
    layers_per_chunk = max(from_layers)
    per_layer = layer_activation_bytes(cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, cand.ac, e)
    if cand.ac == "full":
        acts = in_flight * layers_per_chunk * per_layer + layer_activation_bytes(
            cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, "none", e)
    elif cand.ac == "selective":
        full = layer_activation_bytes(cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, "none", e)
        ckpt = layer_activation_bytes(cfg, mb_rows, seq, lay.tp, cand.sequence_parallel, "full", e)
        half = layers_per_chunk // 2
        acts = in_flight * ((layers_per_chunk - half) * full + half * ckpt) + full
    else:
        acts = in_flight * layers_per_chunk * per_layer
    logits = loss_activation_bytes(cfg, mb_rows, seq, lay.tp, e)
    kv_block = 2 * mb_rows * seq * _kv_local(cfg, lay.tp) * e
    buffers = (unit_max * 4 if fsdp > 1 else 0.0) + (2 * kv_block if lay.cp > 1 else 0.0) + (
        4 * mb_rows * seq * cfg.dim * e if pipelined else 0.0)
    memory = {**states, "gathered_params": gathered, "unsharded_grads": unsharded_grads,
              "activations": acts, "logits": logits, "buffers": buffers}
    memory["total"] = sum(memory.values())

    # step time
    tokens = global_batch * seq_len
    flops = model_flops_per_token(cfg, seq_len) * tokens
    recompute = {"none": 0.0, "op": 0.0, "selective": 1 / 6, "full": 1 / 3}[cand.ac]
    compute = flops * (1 + recompute) / (hw.gpus * hw.peak_tflops * 1e12 * hw.efficiency)
    compute_stretched = compute / (1 - bubble)
    comm = comm_bytes_per_step(cfg, lay, seq_len, global_batch, cand.microbatches, cand.sequence_parallel,
                               cand.strategy, cand.virtual, cand.ac, "ring", rank=0, act_bytes=e, param_bytes=e,
                               reduce_bytes=4)
    bw = {"tp": axis_bandwidth(lay, "tp", hw), "cp": axis_bandwidth(lay, "cp", hw), "pp": axis_bandwidth(lay, "pp", hw),
          "dp_shard_cp": axis_bandwidth(lay, ("dp_shard", "cp"), hw),
          "dp_replicate": axis_bandwidth(lay, "dp_replicate", hw)}
    t = {axis: comm[axis] / bw[axis] for axis in comm}
    overlapped = t["dp_shard_cp"] + t["dp_replicate"] + t["cp"]
    time = {"compute": compute, "bubble": compute_stretched - compute, "tp": t["tp"], "pp": t["pp"],
            "exposed_overlapped_comm": max(0.0, overlapped - compute)}
    time["step"] = sum(time.values())
    tokens_per_s = tokens / time["step"]
    mfu = flops / (time["step"] * hw.gpus * hw.peak_tflops * 1e12)
    return Estimate(cand, memory, time, comm, tokens_per_s, mfu, memory["total"] <= hw.usable_bytes, bubble)


def _split(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


# ----------------------------------------------------------------------------- enumeration
def _pow2_divisors(n: int, cap: int | None = None) -> list[int]:
    return [d for d in divisors(n) if d & (d - 1) == 0 and (cap is None or d <= cap)]


def candidates(cfg, hw: Hardware, seq_len: int, global_batch: int) -> list[Candidate]:
    """Every layout tessera can run for this request (its own ParallelConfig.check decides), with tp
    inside a node, powers of two per axis, and the pipeline's microbatches at 1, 2 and 4 per stage."""
    from tessera.parallel.data import DataParallelConfig
    from tessera.parallel.parallelize import ParallelConfig
    from tessera.parallel.pipeline import PipelineConfig

    out: list[Candidate] = []
    G = hw.gpus
    for tp in _pow2_divisors(G, min(hw.gpus_per_node, cfg.n_heads)):
        for cp in _pow2_divisors(G // tp, 16):
            if seq_len % (2 * cp):
                continue
            for pp in _pow2_divisors(G // (tp * cp), cfg.n_layers):
                dp = G // (tp * cp * pp)
                if global_batch % dp:
                    continue
                rows = global_batch // dp
                for dp_replicate in _pow2_divisors(dp):
                    lay = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp // dp_replicate, cp=cp, tp=tp)
                    fsdp = lay.dp_shard * cp > 1
                    for strategy in (STRATEGIES if fsdp else ("FULL_SHARD",)):
                        for sched, virtual in _schedules(pp, cfg.n_layers):
                            for mb in _microbatch_counts(rows, pp):
                                for ac in AC_MODES:
                                    cand = Candidate(lay, strategy, ac, sched, mb, virtual)
                                    pc = ParallelConfig(lay, cand.sequence_parallel,
                                                        DataParallelConfig(strategy, "bf16", "selective" if ac == "selective" else ac),
                                                        PipelineConfig(schedule=sched, microbatches=mb, virtual=virtual))
                                    try:
                                        pc.check(cfg, seq_len, global_batch, mb)
                                    except ValueError:
                                        continue
                                    out.append(cand)
    return out


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)]
    if n_layers >= 2 * pp:
        out.append(("interleaved-1f1b", 2))
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


def plan(model: str, hw: Hardware, seq_len: int, global_batch: int, top: int | None = None) -> PlanResult:
    """Rank every runnable layout for `model` on `hw`; raise PlanError saying what is short when none fits."""
    from tessera.models import get_preset

    cfg = get_preset(model)
    if seq_len < 1 or global_batch < 1:
        raise PlanError(f"--seq-len {seq_len} and --global-batch {global_batch} must be positive")
    cands = candidates(cfg, hw, seq_len, global_batch)
    request = {"model": model, "params": cfg.num_params(), "seq_len": seq_len, "global_batch": global_batch,
               "hardware": asdict(hw)}
    if not cands:
        raise PlanError(f"no layout of {hw.gpus} GPUs runs {model} with --seq-len {seq_len} --global-batch "
                        f"{global_batch}: the global batch must split over dp (try a multiple of {hw.gpus}) and "
                        f"tp must divide the {cfg.n_heads} heads")
    estimates = [estimate(cfg, c, hw, seq_len, global_batch) for c in cands]
    fitting = sorted((x for x in estimates if x.fits), key=lambda x: (round(x.time["step"], 6), x.memory["total"], x.candidate.layout.cp,
                                                                      x.candidate.layout.pp))
    closest = min(estimates, key=lambda x: x.memory["total"])
    result = PlanResult(fitting[:top] if top else fitting, None if fitting else closest, len(cands), request)
    if not fitting:
        floor = min_gpus(cfg.num_params(), hw.gpu_memory_gb, hw.recipe)
        raise PlanError(
            f"{model} does not fit on {hw.gpus} GPUs of {hw.gpu_memory_gb:g} GB at --seq-len {seq_len} "
            f"--global-batch {global_batch}: the closest of {len(cands)} layouts ({closest.candidate.describe()}) "
            f"needs {closest.memory['total'] / GB:.1f} GB per rank against {hw.usable_bytes / GB:.1f} GB usable "
            f"({hw.headroom:.0%} headroom), short by {(closest.memory['total'] - hw.usable_bytes) / GB:.1f} GB; "
            f"model states alone need at least {floor} GPUs of {hw.gpu_memory_gb:g} GB (fully sharded), so add "
            f"GPUs or shorten the sequence or batch")
    return result


def why_best(result: PlanResult) -> str:
    """One sentence: what the top layout gains over the runner-up."""
    if not result.ranked:
        return ""
    best = result.ranked[0]
    if len(result.ranked) == 1:
        return f"{best.candidate.describe()} is the only layout that fits."
    ties = [x for x in result.ranked[1:] if x.time["step"] <= best.time["step"] * 1.001]
    tie_note = (f" {len(ties)} more layout(s) tie within 0.1% on time; it holds the least memory of them." if ties else "")
    other = next((x for x in result.ranked[1:] if x.time["step"] > best.time["step"] * 1.001), None)
    if other is None:
        return f"all {len(result.ranked)} layouts shown tie within 0.1% on time; it holds the least memory per rank."
    diffs = {k: other.time[k] - best.time[k] for k in best.time if k != "step"}
    key = max(diffs, key=diffs.get)
    label = {"compute": "less recomputation", "bubble": "a smaller pipeline bubble", "tp": "less tensor-parallel traffic",
             "pp": "less pipeline traffic", "exposed_overlapped_comm": "less data/context traffic left exposed"}[key]
    return (f"it wins by {label} ({diffs[key]:.3f} s/step): an estimated {best.time['step']:.3f} s/step against "
            f"{other.time['step']:.3f} s for the next slower layout ({other.candidate.describe()}), at "
            f"{best.memory['total'] / GB:.1f} GB per rank against {other.memory['total'] / GB:.1f} GB.{tie_note}")


def with_layout(cand: Candidate, **degrees: int) -> Candidate:
    return replace(cand, layout=replace(cand.layout, **degrees))
