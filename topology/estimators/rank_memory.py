"""The memory of one rank of a candidate (planner.py's memory paragraph): the model states of the rank
holding the most, FSDP2's gathered copy and the unsharded gradients, the activations a block keeps for backward
times the microbatches in flight, the loss's logits, the buffers; and where --offload puts the states."""

from __future__ import annotations

import functools

from tessera.topology.estimators.activations import (
    block_activation_bytes,
    compiled_block_bytes,
    layer_kind,
    mlp_kept,
    uses_block_model,
)
from tessera.topology.estimators.comm_model import stage_layer_counts
from tessera.topology.memory import get_recipe, offload_split
from tessera.topology.estimators.muon_memory import MUON_RECIPES, muon_extra_bytes

# Defaults, documented in `tessera plan --help`: one H100 SXM (bf16 dense peak), NVLink 4 and 400 Gb/s
from tessera.topology.estimators.plan_inputs import (
    Candidate,
    Hardware,
)
from tessera.topology.schedules.schedule import placement_of, stages_on_rank
from tessera.topology.shapes import (
    ModelShape,
    as_shape,
    chunk_tokens,
    fsdp_shard_numel,
    kv_heads_split,
    layer_shard_groups,
    stage_param_shapes,
)


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
    and up outputs, silu(gate) and the product the down projection reads (ffn / tp each; on a GPU, whose
    Triton SwiGLU keeps no silu(gate), three; a GELU MLP: its up matrix's output and the GELU of it); with
    qk-norm, the q and k norms' inputs and x * rstd; the log-sum-exp (fp32) and the norms' rstd (a layer norm
    keeps its input, mean and rstd instead: F.layer_norm).
    op: matmul and attention outputs (q, k, v, out, the output projection, the MLP's matrices) and the block
    input; the rest recomputed. full: only the block input. (selective checkpoints every other block:
    `_rank_memory` combines them.)
    An MoE block (an estimate, not counted with hooks): each token's top_k assignments keep an MLP's
    tensors each (ffn / tp wide) plus their dispatched input and combined output (dim wide), the router's
    fp32 scores (n_experts per token), and a shared expert a dense MLP's.
    Blocks of another kind (latent attention, sinks, sliding windows, dense layers beside MoE ones, biased or
    clamped experts) are counted per block `layer` without checkpointing by topology/estimators/activations.py, whose
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
    on_cpu = e >= 4 if cpu is None else cpu
    # an MLP's ffn-wide tensors kept without checkpointing, per ffn feature: SwiGLU's gate and up outputs,
    # silu(gate) and the product (4), or on a GPU, where tessera's Triton kernel keeps no silu(gate), 3 (another
    # framework's eager block, torchtitan's, runs torch's ops); GELU's 2
    act = mlp_kept(ups, on_cpu or op_policy != "tessera")
    # the MLP's tensors per token: (kept by the op policy, kept without checkpointing)
    if cfg.n_experts:
        sf = cfg.shared_ffn_dim // tp
        mlp_op = cfg.top_k * (ups * f + h) + ups * sf
        mlp_all = cfg.top_k * (act * f + 2 * h) + act * sf
        small += rows * seq * cfg.n_experts * 4
    else:
        mlp_op, mlp_all = ups * f, act * f
    # ring attention and the GPU's kernel keep q, k and v at their own heads and the output; the CPU's fused
    # op keeps k and v repeated to the query heads
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
    """(kept per microbatch until its backward, transient) on the last stage, for `--loss` (and
    compiled-logits: the whole logits with a compiled cross-entropy, as torchtitan's under compile since 2025-04):
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
    if loss == "compiled-logits":  # one fused kernel each way: the logits and their log-sum-exp kept, the
        # gradient written once in the compute dtype (no fp32 copy of either)
        return float(norm + rows * seq * (vocab * e + 4)), float(rows * seq * vocab * e)
    chunk = chunk_tokens(rows * seq, vocab, hidden=cfg.dim)
    kept = norm + vocab * cfg.dim * 4  # (dh, the gathered output's size, is in `norm`)
    transient = chunk * vocab * (4 + 2 * e) + (vocab * cfg.dim * e if e < 4 else 0)
    return float(kept), float(transient)


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
    # gradients of earlier microbatches, kept while later ones run: under FSDP2 unsharded until the last
    # microbatch's backward syncs them, and in the reduce dtype (fp32: FSDP2 upcasts a gradient it does not
    # reduce yet, to_accumulated_grad_if_needed), the whole stage's from the rank's first backward on
    accumulating = cand.microbatches > 1
    m["unsharded_grads"] = (tp_local * 4.0 if fsdp > 1 else m["gradients"]) if accumulating else 0.0
    # Megatron's DDP with its distributed optimizer (another framework's runs): the bf16 parameters in one buffer
    # the optimizer's all-gather writes in place (no separate sharded copy), the gradients in one buffer of the
    # reduction's dtype (fp32 with grad_reduce_in_fp32, else bf16: hw.grad_reduce_bytes) held the whole step,
    # accumulated in and reduce-scattered in place; the fp32 master and Adam's moments on the rank's 1/dp
    # (`optimizer` above); Adam updates the shard in place
    megatron = hw.data_parallel == "megatron" and stage != 3
    if megatron:
        grads = tp_local * float(hw.grad_reduce_bytes)
        m.update(parameters=tp_local * e, gathered_params=0.0, gradients=grads, unsharded_grads=0.0)
    # a pipeline rank holds its most forwards in flight before its first backward; it holds them again with
    # the gradients only if it runs more forwards than that (the steady state of 1F1B), else the first
    # backward's gradients meet one microbatch fewer in flight
    steady = cand.microbatches * cand.virtual > in_flight if pipelined else True
    cpu = e >= 4 or hw.device_type == "cpu" or (hw.calibration is not None and hw.calibration.device_type == "cpu")
    # one count per checkpointing mode and block kind, not per block: blocks of one kind keep the same bytes
    # (on 48 layers the count per block was 70% of the planner's time)
    per_kind = uses_block_model(cfg)
    counted: dict[tuple, float] = {}

    def act(ac: str, layer: int) -> float:
        # compiled blocks: inductor's partitioner recomputes the elementwise ops in the backward, so a block
        # keeps what tessera's op policy keeps (every matmul and attention output, the block input): the
        # partitioner never recomputes a matmul, unlike torchtitan's per-op SAC, which keeps every other one
        # (the families whose blocks differ count each kind's outputs: compiled_block_bytes)
        policy = hw.ac_policy
        if ac == "none" and hw.compile:
            ac, policy = ("compiled", "tessera") if per_kind else ("op", "tessera")
        key = (ac, policy, layer_kind(cfg, layer) if per_kind and ac in ("none", "compiled") else None)
        if key in counted:
            return counted[key]
        if ac == "compiled":
            counted[key] = compiled_block_bytes(cfg, layer, mb_rows, seq, lay.tp, cand.sequence_parallel, e)
        else:
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
                op_policy=policy,
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
    held = m["activations"] + m["unsharded_grads"]
    if not steady:  # (in_flight - 1 chunks of activations beside the gradients, or in_flight without them)
        held = max(m["activations"], m["activations"] - max(chunk_bytes(c) for c in chunks) + m["unsharded_grads"])
    if megatron:  # its gradient buffer is held from the first backward on, whatever the schedule
        held += m["gradients"]
    backward_start = held + max(m["logits"], m["backward_transient"]) + m["gathered_params"]
    optimizer_step = 2 * m["gradients"]  # the gradients and the optimizer's temporaries of their size
    if megatron:
        optimizer_step = m["gradients"]  # the gradient buffer, which the step reads in place
    if hw.recipe in MUON_RECIPES:  # Muon's own accounting (topology/estimators/muon_memory.py)
        optimizer_step += _muon_memory(m, cfg, cand, hw, pp_rank, fsdp, stage, n_blocks=sum(layers[s] for s in stages))
    if cand.offload != "none":  # the states that leave the GPU (topology/memory.py's offload_split)
        split = offload_split({k: m[k] for k in ("parameters", "gradients", "optimizer")}, cand.offload, hw.recipe)
        m.update({k: split["device"][k] for k in ("parameters", "gradients", "optimizer")})
        m["host_offload"] = split["host"]["total"]  # in host memory, not in the device's total
        # the step runs on the host: the device holds the gradients it copies down (optimizer) or nothing
        optimizer_step = m["gradients"]
    if hw.fault_tolerant and lay.dp_replicate > 1:
        # the one all-reduce between replica groups: the gradient shards weighted and flattened into one fp32
        # buffer (parallel/fault_tolerance.py's reduce: the weighted copies, then their concatenation)
        m["buffers"] += 8 * sharded
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
