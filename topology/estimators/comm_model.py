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
        replicated weights (fp32: copy_weight_to_tp adds them in fp32): the norms' (weight, and bias for a
        layer norm) and the row-parallel biases' under sequence parallel, the qk-norms' always (each rank
        normalizes its own heads), K/V's when tp exceeds the kv heads; blocks recomputed by activation
        checkpointing issue their forward collectives again, all but the last. An MoE block: its input and
        output like a dense MLP's, its routing (each token's k fp32 weights and int64 expert ids) gathered
        under sequence parallel (the weights' gradient reduce-scattered) or the weights' gradient
        all-reduced without, the router's (E x dim) gradient all-reduced under sequence parallel, a shared
        expert's input and output like a dense MLP's; a recomputed MoE block with the auxiliary loss
        reissues its output reduce too (the loss's saved tensors come after it)
cp      ring: K and V of the local block passed cp-1 times forward and again in backward, with dK/dV
        (fp32) passed cp times; all-gather attention: one all-gather of K/V, one reduce-scatter of dK/dV;
        an MoE block with the auxiliary loss all-reduces its per-sequence expert counts (b x E, fp32)
pp      each microbatch's activation to the next stage, its gradient to the previous one; with a tied
        head, the first and last stages' all-reduce of the embedding's gradient shard (fp32) once a step
ep      each MoE block's three all-to-alls of parallel/expert.py: the E int64 expert counts (equal splits,
        (ep-1)/ep of them sent), the dispatch of the rank's b s k assignments (rows of h) and the combine
        that returns the rows other ranks sent it; backward runs the dispatch and the combine again with
        their splits swapped, a recomputed block all three forward. What a dispatch or a combine sends is
        the routed fraction of the b s k assignments (`routed_fraction`: those of other ranks' experts, and
        those other ranks sent; (ep-1)/ep when routing is balanced, the planner's assumption; a run's
        measured routing gives its exact value). Every tp rank exchanges its own copy of the tokens.
        `ep_over_tp` (`tessera plan` only: another framework's expert layout, Megatron's MoE parallel
        folding with expert tp 1) scores an expert group of ep x tp ranks holding whole experts: each rank
        dispatches its own sequence-parallel shard (s / tp tokens), (ep tp - 1) / (ep tp) of it off-rank, and
        the MoE block's tp gathers (its input, output and routing) are not issued
fsdp    per FSDP unit: all-gathers of the padded flat parameters (once a step inside a pipeline, where
        units stay gathered across microbatches; twice per microbatch under FULL_SHARD, once under
        SHARD_GRAD_OP), one reduce-scatter of the gradients (fp32), and under HSDP one all-reduce of the
        gradient shard over dp_replicate. Under expert parallel each MoE block's experts (E / ep of them on
        a rank) are a unit of their own whose group is edp, the dp_shard x cp / ep ranks that hold the same
        experts; their bytes stay under FSDP's accounting names ("dp_shard_cp", and "dp_replicate" for the
        HSDP all-reduce), as they are the same collectives over a subgroup of the same ranks, and a
        separate name would split one overlapped stream of FSDP traffic in two (parallel/comm_stats.py
        counts the edp group's collectives under "dp_shard_cp" too)
Scalars (loss sums, grad-norm partials, the straggler watch's step times) are left out: bytes per step.
The model is a ModelShape (topology/shapes.py; tessera's LlamaConfig is read by the same names).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from tessera.topology.axes import COMM_AXES, FLATTENED_BY_PURPOSE
from tessera.topology.layout import Layout
from tessera.topology.schedules.schedule import stage_rank, stages_on_rank
from tessera.topology.shapes import (
    ModelShape,
    as_shape,
    fsdp_shard_numel,
    kv_heads_split,
    layer_shard_groups,
    split_layers,
    stage_param_shapes,
)

FSDP = FLATTENED_BY_PURPOSE["fsdp"]  # FSDP2's mesh (dp_shard x cp), replicated over dp_replicate under HSDP
if FSDP.replicate is None:
    raise RuntimeError("topology/axes.py: the fsdp mesh must name the axis HSDP replicates it over")
HSDP_REPLICATE: str = FSDP.replicate  # "dp_replicate"


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
    """Blocks per pipeline stage, by the stage split's one rule (topology/shapes.py's split_layers)."""
    per_stage = None if layers_per_stage is None else tuple(layers_per_stage)
    return list(_stage_layer_counts(n_layers, n_stages, per_stage))


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few splits for each of its candidates
def _stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(len(r) for r in split_layers(n_layers, n_stages, layers_per_stage))


# bytes of the elements that tessera's collectives carry whatever the activation dtype: expert counts and
# ids are int64 (torch.bincount, torch.topk), a replicated weight's gradient is added in fp32
# (copy_weight_to_tp), the routing weights are fp32 at least (models/moe.py's route)
INT64_BYTES, FP32_BYTES = 8, 4


@functools.lru_cache(maxsize=65536)
def padded_numel(
    shape, tp: int, stages: tuple[int, ...], n_stages: int, n_blocks: int, n: int, ep: int = 1
) -> tuple[tuple[int, int], ...]:
    """((elements, ranks in the group), ...) that FSDP2 gathers for these stages' units on one tp rank, by
    shard group: each parameter's dim 0 padded to a multiple of its group's shards (its flat all-gather
    buffer). One group of n ranks, or under expert parallel a second one for the experts over n / ep."""
    cfg = as_shape(shape)

    def padded(shapes, k: int) -> int:
        return sum(k * -(-rows // k) * cols for rows, cols in shapes)

    extra = [u for s in stages for u in stage_param_shapes(cfg, tp, s == 0, s == n_stages - 1, 0)]
    groups = layer_shard_groups(cfg, tp, ep, n)
    out = [(n_blocks * padded(groups[0][0], n) + sum(padded(u, n) for u in extra), n)]
    out += [(n_blocks * padded(shapes, k), k) for shapes, k in groups[1:]]
    return tuple(out)


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
    param_bytes: float
    reduce_bytes: int
    routed_fraction: float | None = None  # ep: share of assignments moved off-rank; None: balanced routing
    placement: str = "loop"  # where the stages live (topology/schedules/schedule.py's stage_rank)
    documents: bool = False  # packed documents: cp attention gathers the shards' document ids (int64) per layer
    ep_over_tp: bool = False  # the expert group is ep x tp ranks of whole experts (module docstring; plan only)
    cp_kv_heads: str = "kv"  # cp's passes carry the kv heads ("kv") or K/V repeated to the query heads ("query")
    # the dtype bytes of a sequence-parallel block's activation all-gathers (None: act_bytes): torchao's float8
    # tp styles, which torchtitan runs under tensorwise FP8, cast to FP8 before gathering, forward (the input of
    # the column-parallel layers) and backward (the row-parallel layers' output gradient); `tessera plan` only
    tp_gather_bytes: int | None = None

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


def ep_over_tp_applies(layout: Layout, sequence_parallel: bool) -> bool:
    """Whether an expert group can fold tp in (`ep_over_tp`): ep and tp both, and sequence parallel, each rank
    dispatching its own sequence shard."""
    return layout.ep > 1 and layout.tp > 1 and bool(sequence_parallel)


def comm_bytes_per_step(
    shape,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    microbatches: int = 1,
    sequence_parallel: bool = False,
    *,
    strategy: str = "FULL_SHARD",
    virtual: int = 1,
    ac: str = "none",
    cp_method: str = "ring",
    rank: int = 0,
    layers_per_stage=None,
    act_bytes: int = 4,
    param_bytes: float = 4,
    reduce_bytes: int = 4,
    routed_fraction: float | None = None,
    placement: str = "loop",
    documents: bool = False,
    ep_over_tp: bool = False,
    cp_kv_heads: str = "kv",
    tp_gather_bytes: int | None = None,
) -> dict[str, float]:
    """Bytes `rank` sends per step, by the accounting names of topology/axes.py's table (COMM_AXES: "tp", "cp",
    "pp", FSDP's "dp_shard_cp", HSDP's "dp_replicate", "ep"), in the order of the volumes below.
    act_bytes: the activations' dtype; param_bytes: FSDP's all-gather dtype (mixed precision's param
    dtype); reduce_bytes: the gradient reduction's dtype (tessera reduces in fp32). `shape` is the model's
    ModelShape. routed_fraction: the share of this rank's expert assignments its dispatches and combines
    move to other ranks over the step (`routed_fraction_of` a run's measured rows; None: balanced routing,
    (ep-1)/ep). ep_over_tp: the expert group spans tp too (the module docstring's; `tessera plan` only).
    cp_kv_heads: "query" where another framework repeats K/V to the query heads before attention, so that its cp
    passes carry n_heads / tp heads (`tessera plan` only; tessera's carry the kv heads)."""
    if cp_kv_heads not in ("kv", "query"):
        raise ValueError(f"cp_kv_heads={cp_kv_heads!r}: use kv (the model's kv heads) or query (repeated)")
    if ep_over_tp and not ep_over_tp_applies(layout, sequence_parallel):
        raise ValueError(
            f"ep_over_tp=True folds tp into the expert group, which needs ep, tp and sequence parallel: "
            f"ep={layout.ep}, tp={layout.tp}, sequence_parallel={sequence_parallel}"
        )
    if routed_fraction is not None and not 0 <= routed_fraction <= 1:
        raise ValueError(f"routed_fraction={routed_fraction!r} is a share of the assignments: give a number in [0, 1]")
    cfg = as_shape(shape)
    pp = layout.pp
    n_stages = pp * virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages, layers_per_stage)
    p = layout.index("pp", rank)
    stages = tuple(stages_on_rank(p, pp, virtual, placement))
    n_blocks = sum(layers[st] for st in stages)
    recomputed = (
        n_blocks
        if ac in ("full", "op")
        else (sum(len(range(0, layers[st], 2)) for st in stages) if ac == "selective" else 0)
    )
    step = StepTraffic(
        cfg,
        layout,
        microbatches,
        global_batch // layout.dp // microbatches,
        seq_len // layout.cp,
        n_stages,
        stages,
        n_blocks,
        recomputed,
        sequence_parallel,
        strategy,
        cp_method,
        act_bytes,
        param_bytes,
        reduce_bytes,
        routed_fraction,
        placement,
        documents,
        ep_over_tp,
        cp_kv_heads,
        tp_gather_bytes,
    )
    return {name: fn(step) for name, fn in VOLUMES.items()}


def balanced_routed_fraction(ep: int) -> float:
    """The share of a rank's assignments that balanced routing sends to other ranks' experts: (ep-1)/ep."""
    return (ep - 1) / ep


def routed_fraction_of(calls) -> float:
    """The exact `routed_fraction` of a rank's step from its dispatches, each (rows sent to other ranks, rows
    received from every rank, assignments dispatched[, recomputed]) as parallel/expert.py's AllToAllDispatch
    records them: a dispatch sends its `sent` rows and the combine returns what other ranks sent it (the
    rows received less those kept, the assignments less `sent`), each again in backward unless the call is
    activation checkpointing's recompute; the fraction is what they move over twice the assignments, each
    call weighted as often as it runs (ep_bytes counts a recompute's forward once, the others' twice)."""
    moved = total = 0.0
    for sent, received, rows, *recomputed in calls:
        runs = 1 if recomputed and recomputed[0] else 2
        moved += runs * (sent + received - (rows - sent))
        total += runs * 2 * rows
    if not total:
        raise ValueError(
            "routed_fraction_of: no assignments dispatched; pass the (sent, received, rows) of the step's dispatches"
        )
    return moved / total


@volume("tp")
def tp_bytes(x: StepTraffic) -> float:
    cfg, t, b, s, e = x.cfg, x.layout.tp, x.rows, x.tokens, x.act_bytes
    if t == 1:
        return 0.0
    h = cfg.dim
    act = b * s * h * e
    unit = wire_bytes("all_gather", act, t)  # one gather or reduce-scatter of a block's activations
    replicated_kv = not kv_heads_split(cfg.n_kv_heads, t)
    sp = x.sequence_parallel
    # half of a block's four activation passes each way are gathers (the attention's and the MLP's input forward,
    # their output gradient backward), the other half reduce-scatters (tp_gather_bytes: torchao's FP8 gathers)
    gather = unit
    if sp and x.tp_gather_bytes is not None and not cfg.n_experts:
        gather = wire_bytes("all_gather", b * s * h * x.tp_gather_bytes, t)

    def weight_grads(numel: int) -> float:  # replicated weights' gradients, summed over tp in fp32
        return wire_bytes("all_reduce", numel * FP32_BYTES, t)

    # the attention half: its input and output, forward and backward
    per_block = 2 * (gather + unit) + (weight_grads(2 * cfg.head_dim) if cfg.qk_norm else 0.0)
    if replicated_kv:
        per_block += 2 * weight_grads(cfg.n_kv_heads * cfg.head_dim * (h + (1 if cfg.bias else 0)))
    # replicated weights whose gradients are partial under sequence parallel: two norms, o's bias and a
    # dense MLP down matrix's
    norms_and_biases = 2 * cfg.norm_params + (h if cfg.bias else 0)
    # a recomputed block reissues its forward collectives but the last: torch's checkpoint stops once the
    # last saved tensor is rebuilt, and the block's output collective feeds nothing saved
    again = 2 * gather + unit if sp else wire_bytes("all_reduce", act, t)
    if cfg.n_experts and x.ep_over_tp:  # each rank routes its own shard: only the router's gradient is summed
        per_block += weight_grads(cfg.n_experts * h)
        if cfg.shared_ffn_dim:  # a dense MLP beside the experts stays tp-sharded: input and output
            per_block += 4 * unit
            again += 2 * unit
    elif cfg.n_experts:
        per_block += 4 * unit  # the MoE block's input and output
        k_tokens = b * s * cfg.top_k
        if sp:  # each token's k routing weights (and their gradient) and k expert ids gathered
            routing = wire_bytes("all_gather", k_tokens * max(FP32_BYTES, e), t)
            per_block += 2 * routing + wire_bytes("all_gather", k_tokens * INT64_BYTES, t)
            per_block += weight_grads(cfg.n_experts * h)  # the router, read by each rank's own tokens
            again += routing + wire_bytes("all_gather", k_tokens * INT64_BYTES, t)
        else:  # the routing weights copied to every tp rank: their gradient all-reduced
            per_block += wire_bytes("all_reduce", k_tokens * max(FP32_BYTES, e), t)
        if cfg.shared_ffn_dim:  # a dense MLP beside the experts: input and output
            per_block += 4 * unit
            again += 2 * unit if sp else wire_bytes("all_reduce", act, t)
        elif cfg.moe_aux_loss:  # the auxiliary loss's saved tensors follow the output reduce, which reruns
            again += unit if sp else wire_bytes("all_reduce", act, t)
    else:
        per_block += 2 * (gather + unit)
        norms_and_biases += h if cfg.bias else 0
    per_block += weight_grads(norms_and_biases) if sp else 0.0
    tp = x.n_blocks * per_block + x.recomputed * again
    if x.first:
        tp += 2 * unit * (2 if cfg.learned_positions else 1)
    if x.last:
        tp += 2 * unit + 3 * wire_bytes("all_reduce", b * s * max(4, e), t)
        tp += weight_grads(cfg.norm_params) if sp else 0.0
    return x.microbatches * tp


def cp_pass_heads(cfg, tp: int, cp_kv_heads: str) -> int:
    """The K (or V) heads one rank's cp passes carry: its kv heads (one, replicated, where tp exceeds them), or
    its query heads where another framework repeats K/V to them before attention (cp_kv_heads "query")."""
    if cp_kv_heads == "query":
        return cfg.n_heads // tp
    return cfg.n_kv_heads // tp if kv_heads_split(cfg.n_kv_heads, tp) else 1


@volume("cp")
def cp_bytes(x: StepTraffic) -> float:
    cfg, t, cp, e = x.cfg, x.layout.tp, x.layout.cp, x.act_bytes
    if cp == 1:
        return 0.0
    kv = 2 * x.rows * cp_pass_heads(cfg, t, x.cp_kv_heads) * x.tokens * cfg.head_dim
    acc = max(4, e)
    per_block: float
    per_recompute: float
    if x.cp_method == "ring":
        per_block = (cp - 1) * kv * e * 2 + cp * kv * acc
        per_recompute = (cp - 1) * kv * e
    else:
        per_block = wire_bytes("all_gather", cp * kv * e, cp) + wire_bytes("reduce_scatter", cp * kv * acc, cp)
        per_recompute = wire_bytes("all_gather", cp * kv * e, cp)
    if x.documents:  # each attention call gathers every shard's document ids first
        ids = wire_bytes("all_gather", cp * x.rows * x.tokens * 8, cp)
        per_block, per_recompute = per_block + ids, per_recompute + ids
    if cfg.n_experts and cfg.moe_aux_loss:  # each row's expert counts summed over the sequence's cp ranks
        counts = wire_bytes("all_reduce", x.rows * cfg.n_experts * FP32_BYTES, cp)
        per_block, per_recompute = per_block + counts, per_recompute + counts
    return x.microbatches * (x.n_blocks * per_block + x.recomputed * per_recompute)


@volume("pp")
def pp_bytes(x: StepTraffic) -> float:
    cfg, t = x.cfg, x.layout.tp
    if x.layout.pp == 1:
        return 0.0
    boundary = x.rows * (x.tokens // t if x.sequence_parallel else x.tokens) * cfg.dim * x.act_bytes

    # a stage sends forward to the next and backward to the previous, unless that one is on this rank (the V's turn)
    def other_rank(a: int, b: int) -> bool:
        return stage_rank(a, x.layout.pp, x.placement) != stage_rank(b, x.layout.pp, x.placement)

    sends = sum(
        (st < x.n_stages - 1 and other_rank(st, st + 1)) + (st > 0 and other_rank(st, st - 1)) for st in x.stages
    )
    out: float = x.microbatches * sends * boundary
    if cfg.tied_embeddings and (x.first != x.last):  # the tied embedding's gradient shard, summed over 2 ranks
        shard = fsdp_shard_numel(-(-cfg.vocab_size // t), cfg.dim, x.layout.degree(FSDP.name))
        out += wire_bytes("all_reduce", shard * x.reduce_bytes, 2)
    return out


def _data_groups(x: StepTraffic) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(FSDP2's replicas, ((padded elements of this rank's units, ranks that shard them), ...)): one group of
    dp_shard x cp ranks, and under expert parallel the experts' of dp_shard x cp / ep. NO_SHARD replicates
    over every data-parallel rank, and FSDP2 keeps only cp's ranks (which hold the same rows) as its group."""
    shard, replicas = x.layout.degree(FSDP.name), x.layout.degree(HSDP_REPLICATE)
    if x.strategy == "NO_SHARD":
        shard, replicas = x.layout.cp, x.layout.dp
    if shard * replicas == 1:
        return replicas, ()
    return replicas, padded_numel(x.cfg, x.layout.tp, x.stages, x.n_stages, x.n_blocks, shard, x.layout.ep)


@volume(FSDP.name)
def fsdp_bytes(x: StepTraffic) -> float:
    _, groups = _data_groups(x)
    out = 0.0
    for padded, n in groups:
        if x.layout.pp > 1:
            gathers = 1
        elif x.strategy == "SHARD_GRAD_OP" or n == 1:
            gathers = x.microbatches
        else:
            gathers = 2 * x.microbatches
        out += gathers * wire_bytes("all_gather", padded * x.param_bytes, n) + wire_bytes(
            "reduce_scatter", padded * x.reduce_bytes, n
        )
    return out


@volume(HSDP_REPLICATE)
def replicate_bytes(x: StepTraffic) -> float:
    replicas, groups = _data_groups(x)
    return sum(wire_bytes("all_reduce", padded // n * x.reduce_bytes, replicas) for padded, n in groups)


@volume("ep")
def ep_bytes(x: StepTraffic) -> float:
    """Expert parallel, per MoE block and microbatch (module docstring): the counts all-to-all, the dispatch
    and the combine forward, the combine's and the dispatch's backward, and a recomputed block's forward
    three again; a dispatch or combine moves `routed_fraction` of the b s k assignment rows of h."""
    cfg, ep = x.cfg, x.layout.ep
    if ep == 1 or not cfg.n_experts:
        return 0.0
    tokens: float = x.tokens
    if x.ep_over_tp:  # an ep x tp group, each rank dispatching its sequence-parallel shard
        ep, tokens = ep * x.layout.tp, x.tokens / x.layout.tp
    share = balanced_routed_fraction(ep) if x.routed_fraction is None else x.routed_fraction
    moved = x.rows * tokens * cfg.top_k * share * cfg.dim * x.act_bytes  # one dispatch's or combine's
    counts = wire_bytes("all_to_all", cfg.n_experts * INT64_BYTES, ep)
    forward = counts + 2 * moved
    return x.microbatches * (x.n_blocks * (forward + 2 * moved) + x.recomputed * forward)


# every accounting name of the table has its volume (a new axis: register one above with @volume(its comm name))
if set(VOLUMES) != set(COMM_AXES):
    raise ImportError(
        f"topology/estimators/comm_model.py's volumes {sorted(VOLUMES)} differ from topology/axes.py's accounting "
        f"names {sorted(COMM_AXES)}: give each name of COMM_AXES a @volume(name) function"
    )


def muon_bytes(matrices: list[tuple[int, int]], elem_bytes: int = 4) -> float:
    """Bytes a rank sends per step, on average over its data group, for Muon's orthogonalization (accounted
    as "muon"): for each matrix of `numel` elements sharded over `n` ranks (numel, n), the n - 1 other ranks
    gather their numel / n to the owner and the owner scatters n - 1 pieces back: 2 (n - 1) numel / n
    elements over the group, 2 (n - 1) numel / n^2 per rank (the owner sends the scatter, the others the
    gather; which rank owns what is parallel/muon.py's greedy choice). A matrix whole on one rank moves nothing."""
    return sum(2 * (n - 1) * numel / n**2 * elem_bytes for numel, n in matrices if n > 1)
