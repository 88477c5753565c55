"""Analytic communication volumes: the bytes one rank sends per training step, by mesh axis.

Volumes are ring-algorithm bytes a rank puts on the wire (what NCCL's bus bandwidth is measured in):

    all-reduce of S bytes over n ranks      2 (n-1)/n x S
    all-gather into S bytes                   (n-1)/n x S
    reduce-scatter of S bytes                 (n-1)/n x S
    send of S bytes                                      S

So for parameters of P bytes, FSDP (all-gather in forward and again in backward, reduce-scatter the
gradients) moves 3 (n-1)/n x P a step, DDP's one all-reduce 2 (n-1)/n x P: the ZeRO paper's 1.5x.

The formulas follow tessera's own collectives, per microbatch (b rows of s = seq/cp tokens, h = dim):
tp      sequence parallel or not, 8 x (tp-1)/tp x b s h per block (the two block inputs and two outputs,
        forward and backward), the embedding's (and a learned position table's) and the head's
        2 x (tp-1)/tp x b s h, the loss's three fp32 statistics per token, the gradient all-reduces of
        replicated weights: the norms' (weight, and bias for a layer norm) and the row-parallel biases'
        under sequence parallel, the qk-norms' always (each rank normalizes its own heads), K/V's when tp
        exceeds the kv heads; blocks recomputed by activation checkpointing issue their forward
        collectives again, all but the last
cp      ring: K and V of the local block passed cp-1 times forward and again in backward, with dK/dV
        (fp32) passed cp times; all-gather attention: one all-gather of K/V, one reduce-scatter of dK/dV
pp      each microbatch's activation to the next stage, its gradient to the previous one; with a tied
        head, the first and last stages' all-reduce of the embedding's gradient shard (fp32) once a step
fsdp    per FSDP unit: all-gathers of the padded flat parameters (once a step inside a pipeline, where
        units stay gathered across microbatches; twice per microbatch under FULL_SHARD, once under
        SHARD_GRAD_OP), one reduce-scatter of the gradients (fp32), and under HSDP one all-reduce of the
        gradient shard over dp_replicate
Scalars (loss sums, grad-norm partials, the straggler watch's step times) are left out: bytes per step.
The model is a ModelShape (topology/shapes.py; tessera's Llama ModelConfig is read by the same names).
"""

from __future__ import annotations

import functools

from .layout import Layout
from .shapes import as_shape, fsdp_shard_numel, layer_param_shapes, stage_param_shapes


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends in collective `op` on n ranks (ring algorithms), by the table above: payload is
    the buffer an all-reduce reduces, an all-gather's output, a reduce-scatter's input, a send's tensor.
    comm_stats counts measured collectives with the same rule."""
    if op == "send":
        return float(payload)
    if n <= 1:
        return 0.0
    return payload * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage=None) -> list[int]:
    """Blocks per pipeline stage: `layers_per_stage`, or parallel.pipeline.split_layers' even split (the
    remainder on the first stages), without importing torch."""
    if layers_per_stage is not None:
        return list(layers_per_stage)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


@functools.lru_cache(maxsize=65536)
def padded_numel(shape, tp: int, stages: tuple[int, ...], n_stages: int, n_blocks: int, n: int) -> int:
    """Elements FSDP2 gathers for these stages' units on one tp rank: each parameter's dim 0 padded to a
    multiple of the n shards (its flat all-gather buffer)."""
    cfg = as_shape(shape)

    def padded(shapes) -> int:
        return sum(n * -(-rows // n) * cols for rows, cols in shapes)

    extra = [u for s in stages for u in stage_param_shapes(cfg, tp, s == 0, s == n_stages - 1, 0)]
    return n_blocks * padded(layer_param_shapes(cfg, tp)) + sum(padded(u) for u in extra)


def comm_bytes_per_step(
    shape,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    microbatches: int = 1,
    sequence_parallel: bool = False,
    strategy: str = "FULL_SHARD",
    virtual: int = 1,
    ac: str = "none",
    cp_method: str = "ring",
    rank: int = 0,
    layers_per_stage=None,
    act_bytes: int = 4,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, float]:
    """Bytes `rank` sends per step, by axis: "tp", "cp", "pp", "dp_shard_cp" (FSDP), "dp_replicate".
    act_bytes: the activations' dtype; param_bytes: FSDP's all-gather dtype (mixed precision's param
    dtype); reduce_bytes: the gradient reduction's dtype (tessera reduces in fp32). `shape` is the model's
    ModelShape."""
    cfg = as_shape(shape)
    t, cp, pp, m = layout.tp, layout.cp, layout.pp, microbatches
    b = global_batch // layout.dp // m
    s = seq_len // cp
    h, e = cfg.dim, act_bytes
    n_stages = pp * virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages, layers_per_stage)
    p = layout.index("pp", rank)
    stages = [p + k * pp for k in range(virtual)]
    n_blocks = sum(layers[st] for st in stages)
    recomputed = n_blocks if ac in ("full", "op") else (
        sum(len(range(0, layers[st], 2)) for st in stages) if ac == "selective" else 0)
    first, last = 0 in stages, n_stages - 1 in stages
    act = b * s * h * e
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp_shard_cp": 0.0, "dp_replicate": 0.0}

    if t > 1:
        replicated_kv = cfg.n_kv_heads % t != 0
        # replicated weights whose gradients are partial under sequence parallel: two norms, o's and the
        # MLP down matrix's biases
        sp_replicated = 2 * cfg.norm_params + (2 * h if cfg.bias else 0)
        per_block = 8 * wire_bytes("all_gather", act, t) + (wire_bytes("all_reduce", sp_replicated * e, t) if sequence_parallel else 0.0)
        if cfg.qk_norm:
            per_block += wire_bytes("all_reduce", 2 * cfg.head_dim * e, t)
        if replicated_kv:
            kv_weight = cfg.n_kv_heads * cfg.head_dim * (h + (1 if cfg.bias else 0))
            per_block += 2 * wire_bytes("all_reduce", kv_weight * e, t)
        # a recomputed block reissues its forward collectives but the last: torch's checkpoint stops once the
        # last saved tensor is rebuilt, and the block's output collective feeds nothing saved
        again = 3 * wire_bytes("all_gather", act, t) if sequence_parallel else wire_bytes("all_reduce", act, t)
        tp = n_blocks * per_block + recomputed * again
        if first:
            tp += 2 * wire_bytes("all_gather", act, t) * (2 if cfg.learned_positions else 1)
        if last:
            tp += 2 * wire_bytes("all_gather", act, t) + 3 * wire_bytes("all_reduce", b * s * max(4, e), t)
            tp += wire_bytes("all_reduce", cfg.norm_params * e, t) if sequence_parallel else 0.0
        out["tp"] = m * tp

    if cp > 1:
        heads = cfg.n_kv_heads // t if cfg.n_kv_heads % t == 0 else 1
        kv = 2 * b * heads * s * cfg.head_dim
        acc = max(4, e)
        if cp_method == "ring":
            per_block = (cp - 1) * kv * e * 2 + cp * kv * acc
            per_recompute = (cp - 1) * kv * e
        else:
            per_block = wire_bytes("all_gather", cp * kv * e, cp) + wire_bytes("reduce_scatter", cp * kv * acc, cp)
            per_recompute = wire_bytes("all_gather", cp * kv * e, cp)
        out["cp"] = m * (n_blocks * per_block + recomputed * per_recompute)

    if pp > 1:
        boundary = b * (s // t if sequence_parallel else s) * h * e
        sends = sum((st < n_stages - 1) + (st > 0) for st in stages)
        out["pp"] = m * sends * boundary
        if cfg.tied_embeddings and (first or last):  # the tied embedding's gradient shard, summed over 2 ranks
            shard = fsdp_shard_numel(-(-cfg.vocab_size // t), h, layout.dp_shard * cp)
            out["pp"] += wire_bytes("all_reduce", shard * reduce_bytes, 2)

    data_layout = layout
    if strategy == "NO_SHARD" and layout.dp_shard > 1:
        data_layout = Layout(pp=pp, dp_replicate=layout.dp, dp_shard=1, cp=cp, tp=t)
    n = data_layout.dp_shard * cp
    replicas = data_layout.dp_replicate
    if n * replicas > 1:
        padded = padded_numel(cfg, t, tuple(stages), n_stages, n_blocks, n)
        if pp > 1:
            gathers = 1
        elif strategy == "SHARD_GRAD_OP" or n == 1:
            gathers = m
        else:
            gathers = 2 * m
        out["dp_shard_cp"] = gathers * wire_bytes("all_gather", padded * param_bytes, n) + wire_bytes("reduce_scatter", padded * reduce_bytes, n)
        out["dp_replicate"] = wire_bytes("all_reduce", padded // n * reduce_bytes, replicas)
    return out
