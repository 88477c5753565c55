"""What one block keeps for backward, per block kind, for the models whose blocks differ from Llama's: latent
attention (DeepSeek-V3), attention sinks and sliding windows (gpt-oss), dense first layers beside MoE ones,
biased experts and the clamped SwiGLU. Plain numbers, counted from what each module saves (saved-tensor hooks
over a forward; tests/test_planner_memory.py measures the whole rank), and what the same block keeps compiled
(`compiled_block_bytes`, the planner's count under compile or another framework's fused kernels); the planner
(`layer_activation_bytes`) calls `block_activation_bytes` for a shape `uses_block_model` accepts and keeps its
own count for the others.

The attention core takes one of these paths (`attention_path`, as kernels/dispatch.py picks):
- a fused kernel, which saves q, k, v, its output and the LSE: the GPU's Triton kernel; on CPU ATen's flash
  attention where it applies (fp32, one head dim for q, k and v, no window; k and v repeated to the query
  heads), and with sinks ATen's op inside one autograd function (q, k and v at their own heads);
- the blockwise torch reference (kernels/attention_reference.py's `attention_reference`), differentiated by autograd
  through its loop: on CPU with a window or a value head dim apart from q's. Each (query block, key block)
  pair keeps its scores and their exponentials (heads x rows x cols, fp32), its running output and row
  statistics; with grouped-query heads the broadcast matmuls copy k and v to the query heads for every pair.
  `reference_attention_bytes` walks the same loop;
- ring attention under context parallel (q, k, v, the output and the LSE, whatever runs inside).
Which device a planned run's kernels take: the CPU's for fp32 compute (tessera's CPU runs are fp32) or a
calibration of a CPU; a GPU's for the rest (bf16).
"""

from __future__ import annotations

import functools

from tessera.topology.shapes import ModelShape, as_shape, kv_heads_split

REFERENCE_BLOCK = (
    128  # kernels/attention_reference.py's REFERENCE_BLOCK: the reference's key (and windowed query) blocks
)
ACC = 4  # the reference's accumulation dtype (fp32), and the router's scores and weights
INDEX = 8  # int64: the routing's expert ids and sort orders


def uses_block_model(shape: ModelShape) -> bool:
    """Whether a shape's blocks need this module's count (latent attention, sinks, a window, dense layers beside
    MoE ones, biased or clamped experts); Llama's, Qwen3's and Qwen3-MoE's keep the planner's own."""
    s = as_shape(shape)
    return bool(
        s.kv_lora_rank or s.attention_sinks or s.sliding_layers or s.n_dense_layers or s.moe_bias or s.swiglu_clamp
    )


def layer_kind(shape: ModelShape, layer: int) -> tuple[bool, bool]:
    """What tells block `layer`'s count from another block's of the same shape: whether it attends within a
    sliding window, and whether it is one of the dense blocks before the MoE ones (the only places
    `block_activation_bytes` reads `layer`). The planner counts one block of each kind."""
    s = as_shape(shape)
    return layer in s.sliding_layers, layer < s.n_dense_layers


def window_of(shape: ModelShape, layer: int) -> int | None:
    """The sliding window block `layer` attends within (None: its whole causal past)."""
    s = as_shape(shape)
    return s.sliding_window if layer in s.sliding_layers else None


def attention_path(shape: ModelShape, layer: int, cpu: bool, cp: int, e: int) -> str:
    """How block `layer`'s attention core runs, as the kernels' dispatch picks: "ring" under context parallel
    (it saves q, k, v, the output and the LSE whatever runs inside); on CPU the blockwise "reference" with a
    window, a value head dim apart from the query's, or a compute dtype ATen's fused op lacks (it computes
    fp32), "fused_sinks" for sinks otherwise (ATen's op inside one autograd function that saves q, k and v at
    their own heads, the sunk output and LSE), else "fused" (ATen's op, k and v repeated to the query heads);
    "kernel" on a GPU (the Triton kernel: q, k and v at their own heads, the output and the LSE)."""
    s = as_shape(shape)
    if cp > 1:
        return "ring"
    if not cpu:
        return "kernel"
    if window_of(s, layer) is not None or (s.v_head_dim or s.head_dim) != s.head_dim or e < 4:
        return "reference"
    return "fused_sinks" if s.attention_sinks else "fused"


@functools.lru_cache(maxsize=4096)
def reference_attention_bytes(
    rows: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    v_head_dim: int,
    window: int | None,
    lse_used: bool,
) -> float:
    """Bytes the blockwise reference keeps for backward over causal self-attention of `seq` tokens (its query
    copy, the pairs' scores, exponentials, running outputs and statistics, k and v as the matmuls read them;
    not the output it returns), as its loop runs: one query block without a window, else blocks of 128 rows,
    each over the key blocks its window reaches. `lse_used`: the LSE is differentiated (sinks), so its log is
    kept too."""
    group = q_heads // kv_heads
    per_row = rows * q_heads  # one value per (row, head)
    total = float(per_row * seq * head_dim * ACC)  # the scaled fp32 query copy every score matmul reads
    if group == 1:  # k and v read as views (fp32) or fp32 copies: once
        total += rows * kv_heads * seq * (head_dim + v_head_dim) * ACC
    q_block = seq if window is None else REFERENCE_BLOCK
    for r0 in range(0, seq, q_block):
        r = min(r0 + q_block, seq) - r0
        hi = min(seq, r0 + r)  # causal, bottom-right with equal lengths
        lo = 0 if window is None else max(0, r0 - window + 1)
        for start in range(lo, hi, REFERENCE_BLOCK):
            c = min(start + REFERENCE_BLOCK, hi) - start
            total += 2 * per_row * r * c * ACC  # the (masked) scores amax reads and their exponentials
            total += r * c  # the causal (or window) mask, bool
            total += per_row * r * (4 * ACC + 1)  # running max, block max, rescale, sum; the -inf test (bool)
            total += per_row * r * v_head_dim * ACC  # the running output the rescale multiplies
            if group > 1:  # the broadcast matmuls copy this key block's k and v to the query heads
                total += per_row * c * (head_dim + v_head_dim) * ACC
        total += per_row * r * (v_head_dim * ACC + ACC + 1)  # the output's division: sum and empty rows
        if lse_used:
            total += per_row * r * ACC  # the LSE's log
    return total


def sinks_bytes(rows: int, q_heads: int, seq: int, v_head_dim: int, e: int) -> float:
    """The sinks' merge (kernels' apply_sinks): the output it rescales (compute dtype), the new LSE, the factor
    and its exponential (fp32), and the -inf test."""
    return float(rows * q_heads * seq * (v_head_dim * e + 3 * ACC + 1))


def _attention_bytes(
    s: ModelShape, layer: int, rows: int, seq: int, sp: int, tp: int, e: int, cpu: bool, cp: int
) -> float:
    """One block's attention (its input norm through the output projection's input), bytes."""
    h = s.dim
    heads = s.n_heads // tp
    dv = s.v_head_dim or s.head_dim
    norm = float(rows * sp * (2 * h * e + ACC))  # the input norm's input and x * rstd, and rstd
    path = attention_path(s, layer, cpu, cp, e)
    if s.kv_lora_rank:
        # latent attention: the down projections read the norm's output on this rank's tokens (replicated
        # under tp); the latents (kv_a's output, the q latent) and their norms' x * rstd and rstd; the latents'
        # concatenation (gathered over the sequence under sp) that the head-split up projections read
        rank, rope = s.kv_lora_rank, s.qk_rope_head_dim
        q_in = s.q_lora_rank or h
        latents = sp * (h + rank + rope + rank) * e + sp * ACC
        if s.q_lora_rank:
            latents += sp * 2 * s.q_lora_rank * e + sp * ACC
        latents += seq * (q_in + rank + rope) * e
        kv_heads, k_dim = heads, s.head_dim
        # k (the nope part and the shared rope part expanded to every head) and v made contiguous
        kv = seq * heads * (s.head_dim + dv) * e
        attn = norm + rows * latents
    else:
        kv_heads = s.n_kv_heads // tp if kv_heads_split(s.n_kv_heads, tp) else 1
        k_dim = s.head_dim
        attn = norm + rows * seq * h * e  # the norm's output, which q, k and v read (gathered under sp)
        if s.qk_norm:
            attn += rows * seq * (2 * (heads + kv_heads) * s.head_dim * e + (heads + kv_heads) * ACC)
        kv = seq * kv_heads * (s.head_dim + dv) * e  # k after RoPE and v, as ring or fused attention keep them
    lse = rows * seq * heads * ACC
    if path == "reference":
        # (k and v themselves only as the reference reads them: views or fp32 copies, counted there)
        attn += reference_attention_bytes(rows, heads, kv_heads, seq, k_dim, dv, window_of(s, layer), s.attention_sinks)
        if s.attention_sinks:
            attn += sinks_bytes(rows, heads, seq, dv, e)
    elif path == "fused":  # q, k and v repeated to the query heads, the output, the LSE
        attn += rows * seq * heads * (2 * s.head_dim + 2 * dv) * e + lse
    else:  # ring, fused_sinks, kernel: q, k and v at their own heads, the output, the LSE
        attn += rows * (seq * heads * (s.head_dim + dv) * e + kv) + lse
        if s.attention_sinks and path != "fused_sinks":  # the merge after them keeps the same output
            attn += sinks_bytes(rows, heads, seq, dv, e) - rows * seq * heads * dv * e
    return attn + rows * seq * heads * dv * e  # the output's (B, S, heads x dv) copy the output projection reads


def mlp_kept(ups: int, cpu: bool) -> int:
    """The ffn-wide tensors an MLP of `ups` up matrices keeps for its backward, eager (per ffn feature and
    token): SwiGLU's (2 up matrices) gate and up outputs, silu(gate) and the product torch's ops keep, 4; on a
    GPU the Triton SwiGLU's (kernels/triton_swiglu.py) gate, up and the product, 3; GELU's up output and its
    GELU, 2."""
    return 3 if ups == 2 and not cpu else 2 * ups


def _mlp_bytes(s: ModelShape, layer: int, rows: int, seq: int, sp: int, tp: int, e: int, cpu: bool = True) -> float:
    """One block's MLP half (its norm through the down projection's input), bytes; on a GPU (`cpu` False) the
    Triton SwiGLU keeps no silu(gate) (mlp_kept)."""
    h = s.dim
    norm = rows * sp * (2 * h * e + ACC) + rows * seq * h * e  # the norm, and its output the matmuls read
    ups = s.mlp_matrices - 1
    act = mlp_kept(ups, cpu)
    if not s.n_experts or layer < s.n_dense_layers:
        f = (s.dense_ffn_dim if s.n_experts else s.ffn_dim) // tp
        return norm + rows * seq * act * f * e  # gate and up outputs, silu(gate) (not on a GPU), the product
    f, k, E = s.ffn_dim // tp, s.top_k, s.n_experts
    # the router on this rank's tokens: its scores, chosen ids, weights and their sum (fp32, int64)
    router = rows * sp * (E * ACC + k * INDEX + (k + 1) * ACC)
    # each assignment: the sort orders (int64), its weight, its dispatched input, the experts' output and the
    # weighted one; SwiGLU's gate and up outputs, silu(gate) and the product; the clamped SwiGLU also keeps its
    # fused gate_up output and (up + 1), the clamped gate and sigmoid; biased experts their rows' bias indices
    # (the clamped SwiGLU runs in torch's ops everywhere: its experts keep silu's share on a GPU too)
    per_assignment = 2 * INDEX + ACC + 3 * h * e + (2 * ups if s.swiglu_clamp else act) * f * e
    if s.swiglu_clamp:
        per_assignment += 3 * f * e
    if s.moe_bias:
        per_assignment += 2 * INDEX
    shared = rows * seq * act * (s.shared_ffn_dim // tp) * e
    return norm + router + rows * seq * k * per_assignment + shared


def block_activation_bytes(
    shape: ModelShape, layer: int, rows: int, seq: int, tp: int, sequence_parallel: bool, e: int, cpu: bool, cp: int = 1
) -> float:
    """Bytes block `layer` keeps for backward without checkpointing, for `rows` sequences of `seq` local tokens
    on one tp rank (seq / tp of them under sequence parallel where a block runs on its own tokens): its
    attention (`takes_reference` picks the core's path; `cpu`: the CPU's paths) and its MLP (dense, or the
    experts with `top_k` assignments per token)."""
    s = as_shape(shape)
    sp = seq // tp if sequence_parallel else seq
    return float(
        _attention_bytes(s, layer, rows, seq, sp, tp, e, cpu, cp) + _mlp_bytes(s, layer, rows, seq, sp, tp, e, cpu)
    )


def compiled_block_bytes(
    shape: ModelShape, layer: int, rows: int, seq: int, tp: int, sequence_parallel: bool, e: int
) -> float:
    """Bytes block `layer` keeps for backward when it is compiled (or fused as Transformer Engine's are): the
    outputs of its matmuls and of its attention core, and its input. Inductor's partitioner recomputes the
    elementwise ops in the backward (norms, RoPE, the activation and its clamp, the sinks' merge, the routing's
    arithmetic) and never a matmul, so a compiled block keeps what tessera's `--ac op` keeps; the count per
    block kind, as `block_activation_bytes` counts the same block eager:
    - attention (`seq` tokens: a context-parallel rank's own): q, k and v out of their projections (latent
      attention: the down projections' latents on this rank's tokens and the up projections' per-head
      outputs), the core's output and fp32 LSE, the output projection's output;
    - MLP: the up matrices' outputs and the down projection's; an MoE block each assignment's (the grouped
      matmuls') with its routing kept (sort orders, weight), the router's fp32 scores, a shared expert's as a
      dense MLP's;
    - the norms' fp32 rstd, which the recomputed norms read."""
    s = as_shape(shape)
    h = s.dim
    sp = seq // tp if sequence_parallel else seq
    heads = s.n_heads // tp
    dv = s.v_head_dim or s.head_dim
    ups = s.mlp_matrices - 1
    kept = sp * h * e + 2 * sp * ACC  # the block input; the two norms' rstd
    if s.kv_lora_rank:
        rank, rope = s.kv_lora_rank, s.qk_rope_head_dim
        latents = (s.q_lora_rank + rank + rope) * sp * e  # q_a's (when queries have a latent) and kv_a's outputs
        ups_out = seq * heads * (s.head_dim + (s.head_dim - rope) + dv) * e  # q_b's, and kv_b's (k's nope, v)
        projections = latents + ups_out
    else:
        kv = (s.n_kv_heads // tp if kv_heads_split(s.n_kv_heads, tp) else 1) * s.head_dim
        projections = seq * (heads * s.head_dim + 2 * kv) * e
    core = seq * heads * (dv * e + ACC)  # the core's output and its LSE
    attention = projections + core + sp * h * e  # and the output projection's output
    if not s.n_experts or layer < s.n_dense_layers:
        f = (s.dense_ffn_dim if s.n_experts else s.ffn_dim) // tp
        mlp = seq * ups * f * e + sp * h * e
    else:
        f, k = s.ffn_dim // tp, s.top_k
        router = sp * (s.n_experts * ACC + k * INDEX + (k + 1) * ACC)
        per_assignment = 2 * INDEX + ACC + (ups * f + h) * e  # routing; the grouped matmuls' outputs
        shared = seq * ups * (s.shared_ffn_dim // tp) * e + (sp * h * e if s.shared_ffn_dim else 0)
        mlp = router + seq * k * per_assignment + shared
    return float(rows * (kept + attention + mlp))
