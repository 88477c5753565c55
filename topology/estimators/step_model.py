"""The step of one rank from a machine's datasheet (a hardware profile, topology/hardware.py) and the model's
shapes: physics and stated assumptions, no fitted rows. Used by the planner whenever its Hardware carries a
profile (`tessera plan --hardware NAME|FILE`, the default h100-sxm-80gb).

compute    every linear layer's three GEMMs (forward x @ W^T, the input gradient, the weight gradient) at its
           tp-local shape, each at the large-GEMM share of the peak times d / (d + gemm_half_dim) for its
           smallest dimension d (small GEMMs do not fill the machine); FP8 layers (topology/estimators/fp8_model.py's
           rule) at the FP8 peak's share under tensorwise, at fp8_rowwise_speedup x the bf16 rate under
           rowwise; an MoE block's routed experts as grouped GEMMs of the tokens each expert receives
           (balanced routing), never faster than streaming their weights from HBM; causal attention's FLOPs
           at its backend's share of the bf16 peak (cuDNN or FlashAttention-2); the elementwise work of an
           eager block (topology/estimators/step_time.py's counted bytes) at the elementwise share of HBM bandwidth,
           what compile's fusion leaves of it when compiled; the GPU loss's bytes per logit; FP8's casts
           (fp8_model's bytes: compiled, fused as compiled blocks fuse the rest; eager, tessera's one-pass
           cast and one-reduction amax on a GPU, kernels/triton_fp8_cast.py, the same bytes).
           Under sequence parallel the residual-wide elementwise work runs on seq / tp tokens. Attention's
           share rises with the sequence and the head dim (the profile's `attention`). Under context
           parallel, the ring's merges of its cp steps' outputs and gradients (ring_merge.py's counted
           bytes of the ring that runs: tessera's, torch's, or fused kernels'), eager at the elementwise share
recompute  activation checkpointing reruns forwards: full every block's (its GEMMs' forward, attention's
           forward and its ring merges, a third of the elementwise bytes), selective every other block's, op
           the elementwise forward only (tessera's op policy keeps the matmul and attention outputs;
           torchtitan's per-op SAC keeps every other matmul's output, so it reruns half the GEMMs' forwards
           too)
comm       each accounting name's bytes (topology/estimators/comm_model.py, the counted volumes of --comm-stats) over
           the link its group takes at link_share of the datasheet, plus a latency per collective.
           Exposure: FSDP's and HSDP's traffic is prefetched behind compute (one unit's gather and one
           reduce-scatter are exposed, and whatever exceeds the compute); ring K/V behind attention
           (another framework's as it runs it: torch's all-gather rotater hides each gather behind the
           first of cp steps alone, Hardware.cp_overlap; torchtitan's K/V at the query heads, cp_kv_heads);
           tensor parallel exposed, or with async TP each collective behind the matmuls it feeds or
           follows (the all-gather before q, k, v behind them, the reduce-scatter after the output
           projection behind it, and the MLP's alike) but for its first chunk (1 / tp of it) and what it
           takes beyond them; pipeline P2P on the fill and drain (2 (pp - 1) microbatch transfers); expert
           all-to-alls exposed (to the peers of its node over NVLink, to the rest over the network, at once),
           or with ep overlap behind another microbatch's compute
bubble     the schedule simulator's idle share of the pipelined compute
optimizer  the clip and a fused AdamW over the rank's sharded parameters at the HBM share (40 B a
           parameter, 32 more for mixed precision's casts: topology/estimators/step_time.py)

One software-efficiency constant (Hardware.efficiency) divides every compute time: the framework's distance
from the kernels' rates above (dispatch, stream syncs, kernels slower than the best). It is fitted once per
framework, on one named anchor row (benchmarks/bench_published.py prints it), and held fixed elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .comm_model import cp_pass_heads
from .fp8_model import cast_bytes_per_step, fp8_layers
from .ring_merge import ring_merge_bytes
from tessera.topology.schedules.schedule import stages_on_rank
from tessera.topology.shapes import as_shape, layer_param_shapes, split_layer_counts
from tessera.topology.estimators.step_time import (
    MIXED_PRECISION_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    attention_flops_per_token,
    block_elements_per_token,
)

if TYPE_CHECKING:  # the planner imports this module; its types only for the annotations
    from tessera.topology.hardware import HardwareProfile

# `--loss logits`: the whole logits in the compute dtype, their fp32 upcast, log-softmax and its gradient
# (written, read back and cast down): about 30 bytes a logit, as torch's eager cross-entropy runs it
LOGITS_LOSS_BYTES_PER_LOGIT = 30
# a compiled cross-entropy on the whole logits: its forward reads them, its backward reads them and writes their
# gradient, in bf16 (the upcast fused into both kernels)
COMPILED_LOGITS_LOSS_BYTES_PER_LOGIT = 6
MOE_DISPATCH_ELEMENTS = 18  # elements read + written per (token, routed expert, dim): permute, weight, combine
FORWARD_ELEMENTWISE_SHARE = 1 / 3  # a block's elementwise bytes in its forward (step_time's counts: ~27-33%)


def gemm_share(profile: "HardwareProfile", m: float, n: float, k: float) -> float:
    """The share of the peak a GEMM of (m x k) @ (k x n) reaches: the large-GEMM share, less for a small
    smallest dimension (d / (d + gemm_half_dim))."""
    a = profile.achieved
    d = max(1.0, min(m, n, k))
    return a.gemm_share * d / (d + a.gemm_half_dim)


def gemm_seconds(profile: "HardwareProfile", m: float, n: float, k: float, peak_flops: float) -> float:
    """Seconds of one GEMM at its shape's share of `peak_flops`."""
    return 2.0 * m * n * k / (peak_flops * gemm_share(profile, m, n, k))


def linear_seconds(
    profile: "HardwareProfile", tokens: float, out: int, inp: int, peak_flops: float
) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer of (out x inp) on `tokens` rows: the forward GEMM, then
    the input gradient (tokens x out @ out x inp) and the weight gradient (out x tokens @ tokens x inp)."""
    fwd = gemm_seconds(profile, tokens, out, inp, peak_flops)
    bwd = gemm_seconds(profile, tokens, inp, out, peak_flops) + gemm_seconds(profile, out, inp, tokens, peak_flops)
    return fwd, bwd


def busiest_blocks(n_layers: int, pp: int, virtual: int, placement: str) -> tuple[int, int]:
    """(blocks on the pp rank that runs the most, that rank)."""
    counts = split_layer_counts(n_layers, pp * virtual)
    per_rank = [sum(counts[s] for s in stages_on_rank(r, pp, virtual, placement)) for r in range(pp)]
    most = max(per_rank)
    return most, per_rank.index(most)


def compute_parts(
    shape,
    profile: "HardwareProfile",
    *,
    tp: int,
    ep: int,
    mb_tokens: float,
    microbatches: int,
    blocks: int,
    last_stage: bool,
    attention_tokens: float,
    seq_len: int,
    ac: str,
    fp8: str | None,
    compiled: bool,
    attention: str,
    loss: str,
    sequence_parallel: bool,
    ac_policy: str,
    dtype_bytes: int,
    sharded_params: float,
    efficiency: float,
    cp: int = 1,
    cp_merge: str = "tessera",
    cp_kv_heads: str = "kv",
) -> dict[str, float]:
    """Seconds of one rank's compute in a step, by part (module doc): matmul, attention, elementwise, loss,
    fp8_casts, ring_merges, recompute, optimizer, and "compute" (their sum). `mb_tokens`: the tokens one microbatch puts
    through this rank's GEMMs (gathered over tp under sequence parallel: the whole cp-local sequence);
    `attention_tokens`: the tokens of the step whose attention this rank computes (its heads are 1 / tp);
    `cp`, `cp_merge`, `cp_kv_heads`: the context-parallel ring whose merges this rank runs (ring_merge.py)."""
    cfg = as_shape(shape)
    a = profile.achieved
    bf16 = profile.bf16_tflops * 1e12
    fp8_rate = None
    if fp8 == "tensorwise":
        fp8_rate = (profile.fp8_tflops or profile.bf16_tflops) * 1e12
    elif fp8 == "rowwise":
        fp8_rate = bf16 * a.fp8_rowwise_speedup
    fp8_set = (
        {(o // tp if s == 0 else o, i if s == 0 else i // tp) for o, i, s in fp8_layers(cfg, tp)} if fp8 else set()
    )
    matrices = [(r, c) for r, c in layer_param_shapes(cfg, tp, ep, experts=False) if c > 1]
    fwd = bwd = 0.0
    for out, inp in matrices:
        rate = fp8_rate if (out, inp) in fp8_set and fp8_rate else bf16
        f, b = linear_seconds(profile, mb_tokens, out, inp, rate)
        fwd, bwd = fwd + f, bwd + b
    if cfg.n_experts:  # the routed experts' grouped GEMMs: each of the E / ep local experts gets its share
        local = cfg.n_experts // ep
        per_expert = mb_tokens * cfg.top_k * ep / cfg.n_experts
        f_local = cfg.ffn_dim // tp
        shapes = [(f_local, cfg.dim)] * (cfg.mlp_matrices - 1) + [(cfg.dim, f_local)]
        weights = sum(o * i for o, i in shapes) * local * dtype_bytes
        stream = weights / (profile.hbm_gbps * 1e9 * a.hbm_share)  # each pass reads every local expert
        ef = eb = 0.0
        for out, inp in shapes:
            f, b = linear_seconds(profile, per_expert, out, inp, bf16)
            ef, eb = ef + f * local, eb + b * local
        fwd, bwd = fwd + max(ef, stream), bwd + max(eb, 2 * stream)
    per_block = fwd + bwd
    head_fwd = head_bwd = 0.0
    if last_stage:
        head_fwd, head_bwd = linear_seconds(profile, mb_tokens, -(-cfg.vocab_size // tp), cfg.dim, bf16)
    matmul = microbatches * (blocks * per_block + head_fwd + head_bwd)
    share = min(1.0, a.attention(attention, seq_len, cfg.head_dim))
    attn_flops = attention_flops_per_token(cfg, seq_len) * attention_tokens * blocks / cfg.n_layers / tp
    attn = attn_flops / (bf16 * share)
    hbm_elementwise = profile.hbm_gbps * 1e9 * a.elementwise_share
    fusion = a.compiled_elementwise if compiled else 1.0
    rank_tokens = microbatches * mb_tokens  # the tokens through this rank's blocks over the step
    # the block's elementwise bytes: the residual-wide work (two norms and two residual adds: 80 D a token,
    # 92 D with layer norms' means) on seq / tp tokens under sequence parallel, the head- and ffn-wide work
    # tp-local on every token
    per_token = block_elements_per_token(cfg, tp)
    if sequence_parallel and tp > 1:
        residual = (80 + (12 if cfg.norm == "layer" else 0)) * cfg.dim
        per_token = per_token - residual + residual / tp
    if cfg.n_experts:  # the dispatch's gather into expert order and the combine's weighted scatter back: each
        # reads and writes top_k rows of dim a token, forward (~6 k dim) and twice that backward
        per_token += MOE_DISPATCH_ELEMENTS * cfg.top_k * cfg.dim
    elementwise_bytes = blocks * per_token * dtype_bytes * rank_tokens
    elementwise = elementwise_bytes * fusion / hbm_elementwise
    per_logit = {"chunked": a.loss_bytes_per_logit, "compiled-logits": COMPILED_LOGITS_LOSS_BYTES_PER_LOGIT}.get(
        loss, LOGITS_LOSS_BYTES_PER_LOGIT
    )
    loss_s = 0.0
    if last_stage:
        loss_bytes = per_logit * -(-cfg.vocab_size // tp) * rank_tokens
        loss_s = loss_bytes / hbm_elementwise
    casts = 0.0
    if fp8:
        # eager, tessera's sibling layers share their input's cast (parallel/fp8_shared_casts.py), the backward's
        # only without checkpointing
        shared = None if compiled else fp8
        casts = (
            cast_bytes_per_step(cfg, rank_tokens, tp, dtype_bytes, microbatches, shared, shared_backward=ac == "none")
            * blocks
            / cfg.n_layers
        )
        # fp8_model counts a fused cast (its amax, then the scaled cast: 2 e + 1 bytes an element): eager, what
        # tessera's one-pass cast moves on a GPU, in the order torch._scaled_mm takes each operand (no copies);
        # torchao's eager cast ran it as separate ops, (5 e + 25) / (2 e + 1) times the bytes (the H200's eager
        # FP8 step of 2026-11-27). Compiled, the casts fuse into the ops that produce their inputs as the rest of
        # the elementwise work does
        casts = casts * (fusion if compiled else 1.0) / hbm_elementwise
    # the ring's merges of cp steps' partial outputs and gradients, eager at the elementwise share
    merge_fwd, merge_bwd = ring_merge_bytes(
        cp_merge,
        cp,
        cfg.n_heads * (cfg.v_head_dim or cfg.head_dim) // tp,
        cp_pass_heads(cfg, tp, cp_kv_heads) * cfg.head_dim,
        dtype_bytes,
    )
    merge_forward = merge_fwd * attention_tokens * blocks / hbm_elementwise
    ring_merges = merge_forward + merge_bwd * attention_tokens * blocks / hbm_elementwise
    block_fwd = fwd + attn / microbatches / max(blocks, 1) / 3 if blocks else 0.0
    rerun_full = microbatches * blocks * block_fwd + FORWARD_ELEMENTWISE_SHARE * (elementwise + casts) + merge_forward
    op = FORWARD_ELEMENTWISE_SHARE * (elementwise + casts)
    if ac_policy == "torchtitan":  # its per-op SAC reruns every other matmul's forward too
        op += microbatches * blocks * fwd / 2
    recompute = {
        "none": 0.0,
        "op": op,
        "selective": rerun_full / 2,
        "full": rerun_full,
    }[ac]
    optimizer_bytes = sharded_params * (
        OPTIMIZER_BYTES_PER_PARAM["cuda"] + (MIXED_PRECISION_BYTES_PER_PARAM if dtype_bytes == 2 else 0)
    )
    optimizer = optimizer_bytes / (profile.hbm_gbps * 1e9 * a.hbm_share)
    parts = {
        "matmul": matmul,
        "attention": attn,
        "elementwise": elementwise,
        "loss": loss_s,
        "fp8_casts": casts,
        "ring_merges": ring_merges,
        "recompute": recompute,
        "optimizer": optimizer,
    }
    parts = {k: v / efficiency for k, v in parts.items()}
    parts["compute"] = sum(parts.values())
    # what each of a block's four tp collectives can hide behind under async TP (exposed_comm): the matmuls it
    # feeds or follows, one microbatch's forward (the backward's input-gradient GEMMs take as long)
    if tp > 1 and not cfg.n_experts and not cfg.kv_lora_rank:
        for group, seconds in _tp_neighbours(cfg, profile, mb_tokens, tp, fp8_set, fp8_rate, bf16).items():
            parts[f"tp_neighbour_{group}_s"] = seconds / efficiency
    return parts


def _tp_neighbours(cfg, profile, tokens: float, tp: int, fp8_set: set, fp8_rate: float | None, bf16: float) -> dict:
    """Forward seconds of the matmuls beside each of a block's tp collectives under sequence parallel, one
    microbatch: the all-gather before q, k and v, the reduce-scatter after the output projection, the all-gather
    before the MLP's up matrices, the reduce-scatter after its down matrix."""
    h, q, f = cfg.dim, cfg.n_heads * cfg.head_dim // tp, cfg.ffn_dim // tp
    kv = cfg.n_kv_heads * cfg.head_dim // tp if cfg.n_kv_heads % tp == 0 else cfg.head_dim
    ups = cfg.mlp_matrices - 1
    groups = {"qkv": [(q, h), (kv, h), (kv, h)], "out": [(h, q)], "mlp_in": [(f, h)] * ups, "mlp_out": [(h, f)]}

    def forward(shapes: list) -> float:
        return sum(
            linear_seconds(profile, tokens, o, i, fp8_rate if (o, i) in fp8_set and fp8_rate else bf16)[0]
            for o, i in shapes
        )

    return {group: forward(shapes) for group, shapes in groups.items()}


def collective_counts(
    tp: int,
    cp: int,
    pp: int,
    ep: int,
    fsdp: int,
    replicate: int,
    blocks: int,
    microbatches: int,
    virtual: int,
    ac: str,
    strategy: str,
    experts: bool,
) -> dict[str, float]:
    """Collectives one rank issues a step, by accounting name (each pays the link's latency once): tp four a
    block forward and four backward (four more for a recomputed forward), two for the embedding and the head;
    cp 2 (cp - 1) ring passes a block forward and 2 cp backward; FSDP an all-gather per unit and microbatch
    forward, again backward under FULL_SHARD (once a step inside a pipeline), one reduce-scatter per unit;
    pp a send and a receive per microbatch and stage; ep three all-to-alls forward and two backward."""
    rerun = {"none": 0.0, "op": 0.0, "selective": 0.5, "full": 1.0}[ac]
    units = blocks + 2
    gathers = (1 if pp > 1 else microbatches * (2 if strategy == "FULL_SHARD" else 1)) if fsdp > 1 else 0
    return {
        "tp": (blocks * (8 + 4 * rerun) + 2) * microbatches if tp > 1 else 0.0,
        "cp": blocks * (2 * (cp - 1) + 2 * cp) * microbatches if cp > 1 else 0.0,
        "pp": 2.0 * microbatches * virtual if pp > 1 else 0.0,
        "dp_shard_cp": units * (gathers + 1) if fsdp > 1 else 0.0,
        "dp_replicate": float(units) if replicate > 1 else 0.0,
        "ep": blocks * (5 + 3 * rerun) * microbatches if ep > 1 and experts else 0.0,
    }


# the compute parts naming what a block's four tp collectives hide behind under async TP (compute_parts)
TP_NEIGHBOURS = ("tp_neighbour_qkv_s", "tp_neighbour_out_s", "tp_neighbour_mlp_in_s", "tp_neighbour_mlp_out_s")


def exposed_comm(
    seconds: dict[str, float],
    parts: dict[str, float],
    *,
    tp: int,
    pp: int,
    microbatches: int,
    units: int,
    async_tp: bool,
    ep_overlap: bool = False,
    cp: int = 1,
    cp_overlap: str = "attention",
    cp_gather_share: float = 1.0,
    tp_collectives: float = 0.0,
) -> dict[str, float]:
    """The exposed part of each accounting name's traffic time (module doc): "tp", "pp", "ep", "cp" and
    "fsdp" (FSDP's and HSDP's together). cp_overlap "first_step" (torch's all-gather rotater): the K/V
    gathers, `cp_gather_share` of cp's time, hide behind the first of a pass's cp steps alone, the dK/dV
    passes behind the backward's other steps."""
    compute = parts["compute"] - parts["optimizer"]
    t_tp = seconds.get("tp", 0.0)
    neighbours = [parts[k] for k in TP_NEIGHBOURS if k in parts]
    if async_tp and tp > 1 and len(neighbours) == len(TP_NEIGHBOURS) and tp_collectives:
        # each collective, cut in tp chunks, hides behind its own matmuls (torch's fused all-gather-matmul and
        # matmul-reduce-scatter): its first chunk is exposed, and whatever the rest takes beyond them
        per = t_tp / tp_collectives
        heads = min(tp_collectives, 2.0 * microbatches)  # the head's two (collective_counts), exposed
        instances = (tp_collectives - heads) / len(neighbours)  # each of the four, every block, microbatch, pass
        tp_exposed = heads * per + sum(instances * (per / tp + max(0.0, per * (tp - 1) / tp - m)) for m in neighbours)
    elif async_tp and tp > 1:
        tp_exposed = t_tp / tp + max(0.0, t_tp * (tp - 1) / tp - parts["matmul"])
    else:
        tp_exposed = t_tp
    data = seconds.get("dp_shard_cp", 0.0) + seconds.get("dp_replicate", 0.0)
    data_exposed = (2 * data / max(units, 1)) + max(0.0, data - compute) if data else 0.0
    t_pp = seconds.get("pp", 0.0)
    pp_exposed = t_pp * min(1.0, 2 * (pp - 1) / max(1, 2 * microbatches)) if pp > 1 else 0.0
    if cp_overlap not in ("attention", "first_step"):
        raise ValueError(f"cp_overlap={cp_overlap!r}: use attention (tessera's ring) or first_step (torch's gather)")
    t_cp = seconds.get("cp", 0.0)
    if cp_overlap == "first_step" and cp > 1:
        gathers, passes = t_cp * cp_gather_share, t_cp * (1 - cp_gather_share)
        backward = parts["attention"] * 2 / 3  # the backward's share of attention's forward + backward FLOPs
        cp_exposed = max(0.0, gathers - parts["attention"] / cp) + max(0.0, passes - backward * (cp - 1) / cp)
    else:
        cp_exposed = max(0.0, t_cp - parts["attention"])
    return {
        "tp": tp_exposed,
        "cp": cp_exposed,
        "pp": pp_exposed,
        # overlapped (Megatron's overlap_moe_expert_parallel_comm: one microbatch's all-to-alls beside another's
        # compute), only what exceeds the compute is exposed
        "ep": max(0.0, seconds.get("ep", 0.0) - compute) if ep_overlap else seconds.get("ep", 0.0),
        "fsdp": min(data, data_exposed),
    }


def latency_seconds(count: float, inter_node: bool, profile: "HardwareProfile") -> float:
    return count * (profile.latency_inter_us if inter_node else profile.latency_intra_us) * 1e-6
