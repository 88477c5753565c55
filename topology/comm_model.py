"""Analytic communication volumes: the bytes one rank sends per training step, by mesh axis (the names the
table of topology/axes.py accounts traffic under, COMM_AXES: one `@volume` function each, checked at import).

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
ep      each MoE block's dispatch and combine all-to-alls, forward and backward (balanced routing)
fsdp    per FSDP unit: all-gathers of the padded flat parameters (once a step inside a pipeline, where
        units stay gathered across microbatches; twice per microbatch under FULL_SHARD, once under
        SHARD_GRAD_OP), one reduce-scatter of the gradients (fp32), and under HSDP one all-reduce of the
        gradient shard over dp_replicate
Scalars (loss sums, grad-norm partials, the straggler watch's step times) are left out: bytes per step.
The model is a ModelShape (topology/shapes.py; tessera's Llama ModelConfig is read by the same names).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .axes import COMM_AXES, FLATTENED_BY_PURPOSE
from .layout import Layout
from .shapes import ModelShape, as_shape, fsdp_shard_numel, layer_param_shapes, stage_param_shapes

FSDP = FLATTENED_BY_PURPOSE["fsdp"]  # FSDP2's mesh (dp_shard x cp), replicated over dp_replicate under HSDP


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


@dataclass(frozen=True)
class StepTraffic:
    """What the volumes below read: one rank's share of one training step (b rows of s tokens per microbatch,
    its pipeline stages and the blocks they hold, recomputed blocks) and the run's options."""

    cfg: ModelShape
    layout: Layout
    microbatches: int
    rows: int  # b: rows of a microbatch on this rank
    tokens: int  # s = seq / cp: a row's tokens on this rank
    n_stages: int
    stages: tuple[int, ...]  # this rank's pipeline stages
    n_blocks: int  # blocks in them
    recomputed: int  # blocks whose forward activation checkpointing reruns
    sequence_parallel: bool
    strategy: str
    cp_method: str
    act_bytes: int
    param_bytes: int
    reduce_bytes: int

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.stages


# accounting name (topology/axes.py's COMM_AXES) -> the bytes a rank sends under it per step; in this order
VOLUMES: dict[str, Callable[[StepTraffic], float]] = {}


def volume(name: str):
    """Register the function giving the bytes accounted under `name` per step (a name of COMM_AXES)."""

    def register(fn: Callable[[StepTraffic], float]) -> Callable[[StepTraffic], float]:
        VOLUMES[name] = fn
        return fn

    return register


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
    """Bytes `rank` sends per step, by the accounting names of topology/axes.py's table (COMM_AXES: "tp", "cp",
    "pp", FSDP's "dp_shard_cp", HSDP's "dp_replicate"), in the order of the volumes below.
    act_bytes: the activations' dtype; param_bytes: FSDP's all-gather dtype (mixed precision's param
    dtype); reduce_bytes: the gradient reduction's dtype (tessera reduces in fp32). `shape` is the model's
    ModelShape."""
    cfg = as_shape(shape)
    pp = layout.pp
    n_stages = pp * virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages, layers_per_stage)
    p = layout.index("pp", rank)
    stages = tuple(p + k * pp for k in range(virtual))
    n_blocks = sum(layers[st] for st in stages)
    recomputed = n_blocks if ac in ("full", "op") else (
        sum(len(range(0, layers[st], 2)) for st in stages) if ac == "selective" else 0)
    step = StepTraffic(cfg, layout, microbatches, global_batch // layout.dp // microbatches, seq_len // layout.cp,
                       n_stages, stages, n_blocks, recomputed, sequence_parallel, strategy, cp_method, act_bytes,
                       param_bytes, reduce_bytes)
    return {name: fn(step) for name, fn in VOLUMES.items()}


@volume("tp")
def tp_bytes(x: StepTraffic) -> float:
    cfg, t, b, s, e = x.cfg, x.layout.tp, x.rows, x.tokens, x.act_bytes
    if t == 1:
        return 0.0
    h = cfg.dim
    act = b * s * h * e
    replicated_kv = cfg.n_kv_heads % t != 0
    # replicated weights whose gradients are partial under sequence parallel: two norms, o's and the
    # MLP down matrix's biases
    sp_replicated = 2 * cfg.norm_params + (2 * h if cfg.bias else 0)
    per_block = 8 * wire_bytes("all_gather", act, t) + (wire_bytes("all_reduce", sp_replicated * e, t) if x.sequence_parallel else 0.0)
    if cfg.qk_norm:
        per_block += wire_bytes("all_reduce", 2 * cfg.head_dim * e, t)
    if replicated_kv:
        kv_weight = cfg.n_kv_heads * cfg.head_dim * (h + (1 if cfg.bias else 0))
        per_block += 2 * wire_bytes("all_reduce", kv_weight * e, t)
    # a recomputed block reissues its forward collectives but the last: torch's checkpoint stops once the
    # last saved tensor is rebuilt, and the block's output collective feeds nothing saved
    again = 3 * wire_bytes("all_gather", act, t) if x.sequence_parallel else wire_bytes("all_reduce", act, t)
    tp = x.n_blocks * per_block + x.recomputed * again
    if x.first:
        tp += 2 * wire_bytes("all_gather", act, t) * (2 if cfg.learned_positions else 1)
    if x.last:
        tp += 2 * wire_bytes("all_gather", act, t) + 3 * wire_bytes("all_reduce", b * s * max(4, e), t)
        tp += wire_bytes("all_reduce", cfg.norm_params * e, t) if x.sequence_parallel else 0.0
    return x.microbatches * tp


@volume("cp")
def cp_bytes(x: StepTraffic) -> float:
    cfg, t, cp, e = x.cfg, x.layout.tp, x.layout.cp, x.act_bytes
    if cp == 1:
        return 0.0
    heads = cfg.n_kv_heads // t if cfg.n_kv_heads % t == 0 else 1
    kv = 2 * x.rows * heads * x.tokens * cfg.head_dim
    acc = max(4, e)
    if x.cp_method == "ring":
        per_block = (cp - 1) * kv * e * 2 + cp * kv * acc
        per_recompute = (cp - 1) * kv * e
    else:
        per_block = wire_bytes("all_gather", cp * kv * e, cp) + wire_bytes("reduce_scatter", cp * kv * acc, cp)
        per_recompute = wire_bytes("all_gather", cp * kv * e, cp)
    return x.microbatches * (x.n_blocks * per_block + x.recomputed * per_recompute)


@volume("pp")
def pp_bytes(x: StepTraffic) -> float:
    cfg, t = x.cfg, x.layout.tp
    if x.layout.pp == 1:
        return 0.0
    boundary = x.rows * (x.tokens // t if x.sequence_parallel else x.tokens) * cfg.dim * x.act_bytes
    sends = sum((st < x.n_stages - 1) + (st > 0) for st in x.stages)
    out = x.microbatches * sends * boundary
    if cfg.tied_embeddings and (x.first or x.last):  # the tied embedding's gradient shard, summed over 2 ranks
        shard = fsdp_shard_numel(-(-cfg.vocab_size // t), cfg.dim, x.layout.degree(FSDP.name))
        out += wire_bytes("all_reduce", shard * x.reduce_bytes, 2)
    return out


def _data_groups(x: StepTraffic) -> tuple[int, int, int]:
    """(FSDP2's shard group, its replicas, the padded elements of this rank's units): NO_SHARD replicates over
    every data-parallel rank, and FSDP2 keeps only cp's ranks (which hold the same rows) as its group."""
    shard, replicas = x.layout.degree(FSDP.name), x.layout.degree(FSDP.replicate)
    if x.strategy == "NO_SHARD":
        shard, replicas = x.layout.cp, x.layout.dp
    padded = padded_numel(x.cfg, x.layout.tp, x.stages, x.n_stages, x.n_blocks, shard) if shard * replicas > 1 else 0
    return shard, replicas, padded


@volume(FSDP.name)
def fsdp_bytes(x: StepTraffic) -> float:
    n, replicas, padded = _data_groups(x)
    if n * replicas == 1:
        return 0.0
    if x.layout.pp > 1:
        gathers = 1
    elif x.strategy == "SHARD_GRAD_OP" or n == 1:
        gathers = x.microbatches
    else:
        gathers = 2 * x.microbatches
    return gathers * wire_bytes("all_gather", padded * x.param_bytes, n) + wire_bytes("reduce_scatter", padded * x.reduce_bytes, n)


@volume(FSDP.replicate)
def replicate_bytes(x: StepTraffic) -> float:
    n, replicas, padded = _data_groups(x)
    if n * replicas == 1:
        return 0.0
    return wire_bytes("all_reduce", padded // n * x.reduce_bytes, replicas)


@volume("ep")
def ep_bytes(x: StepTraffic) -> float:
    """Expert parallel: per MoE block and microbatch, the dispatch and combine all-to-alls of the token
    assignments (rows x tokens x top_k rows of dim), forward and backward, each sending (ep-1)/ep of them
    when routing is balanced (the measured counts say how balanced it was), and again for a recomputed
    block's forward. Every tp rank exchanges its own copy of the tokens."""
    cfg, ep = x.cfg, x.layout.ep
    if ep == 1 or not cfg.n_experts:
        return 0.0
    assignments = x.rows * x.tokens * cfg.top_k * cfg.dim * x.act_bytes
    per_block = 4 * wire_bytes("all_to_all", assignments, ep)
    again = 2 * wire_bytes("all_to_all", assignments, ep)
    return x.microbatches * (x.n_blocks * per_block + x.recomputed * again)


# every accounting name of the table has its volume (a new axis: register one above with @volume(its comm name))
if set(VOLUMES) != set(COMM_AXES):
    raise ImportError(f"topology/comm_model.py's volumes {sorted(VOLUMES)} differ from topology/axes.py's accounting "
                      f"names {sorted(COMM_AXES)}: give each name of COMM_AXES a @volume(name) function")
