"""The planner's step time from calibrated figures: what one rank's training step costs on a device whose
achieved rates were measured (`tessera plan --calibrate`, tessera/calibrate.py), instead of a datasheet
peak times an assumed efficiency.

A calibration holds, per device kind and compute dtype, four measured figures:

    matmul_flops_per_s     forward + backward of the model's own linear layers (x @ W^T, dx, dW) at its
                           shapes and in the compute dtype, the FLOPs of all of them over their summed time
    attention_flops_per_s  tessera's attention forward + backward (causal) at the model's heads, head dim
                           and sequence, counted as the model FLOPs below (6 x heads x head_dim x seq per
                           token and layer)
    memory_bytes_per_s     the bandwidth a block's elementwise operators reach on activation-sized tensors
                           (broadcast multiplies as RMSNorm and RoPE run them, a two-input multiply and add,
                           SiLU, a squared mean; bytes read + written over their time), measured beside a
                           plain copy of the ffn-wide activation (kept as copy_bytes_per_s; on a GPU both at
                           least 256 MiB, so they measure HBM and not the L2). On a CPU thread the mix runs
                           at a fraction of the copy's rate; on a GPU near it
    op_overhead_s          the host's cost of one dispatched operator (Python, modules and autograd
                           included): a plain-torch block at a tiny size, forward and backward, over the
                           operators the dispatcher saw

and the step of one rank is

    device = matmul FLOPs / matmul rate + attention FLOPs / attention rate + memory traffic / bandwidth
    host   = dispatched operators x op overhead
    step   = device + host on a CPU (one thread does both); max(device, host) on a GPU (launches are
             asynchronous, so the host runs ahead of the device)

What it counts, per step (T tokens, L layers, D = dim, Q = heads x head dim, K = kv heads x head dim,
F = ffn dim, V = vocab, P = parameters, e = bytes of the compute dtype), for a model given as a ModelShape
(topology/shapes.py; tessera's LlamaConfig is read by the same names):

    matmul FLOPs     6 x (parameters in matmuls: all but the lookup tables) x T; the output head (the
                     loss's matmul) included, tied or not
    attention FLOPs  6 x L x Q x seq x T (causal: QK^T and PV at half the dense count; backward twice the
                     forward; latent attention's PV at its v head dim, a sliding block's keys at most its
                     window: `attention_flops_per_token`). Activation checkpointing adds its recomputed share
                     to both
    memory traffic   the elementwise operators of tessera's eager step, counted in elements read + written
                     per token: a block's forward 20 D + 11 Q + 9 K + 5 F (two RMSNorms 7 D each, RoPE 9 Q
                     + 9 K, the attention output's copy 2 Q, two residual adds, SiLU and the gate product),
                     plus 2 (Q + K) for repeating K and V to the query heads when there are fewer kv heads;
                     its backward 60 D + 12 Q + 14 K + 9 F (+ 2 (Q + K)); the embedding and the final norm
                     33 D; all x e. Other blocks than Llama's: a GELU MLP's 2 F forward and 3 F backward
                     replace SwiGLU's 5 F and 9 F; qk-norm adds 7 (Q + K) and 24 (Q + K), an RMSNorm's per
                     element; a layer norm's mean adds 3 D forward and 3 D backward per norm; biases add
                     their gradients' sums over the tokens, Q + 2 K + 2 D + F (F per up matrix) backward.
                     An MoE block's F is a token's: top_k x ffn (its experts) + the shared expert's; the
                     matmul FLOPs count its active parameters (ModelShape.matmul_params)
                     (On a GPU tessera's Triton RMSNorm fuses the norms' 62 D per block into
                     about 16 D, and RoPE runs in fp32, about 2.5x its elements above: for the 1b preset the
                     two nearly cancel, 8% apart on this term; the eager counts stand for both. Its Triton
                     SwiGLU moves 3 F forward and 5 F backward where torch's ops move the 5 F and 9 F above:
                     about 15% of this term fewer at the 1b preset, not counted, since the H200 rows the
                     step model is checked on were measured before it; the next GPU run measures it.) The loss:
                     6 passes over the fp32 logits, 24 V bytes per token (+ 6 V for the cast from a 2-byte
                     compute dtype), chunked or not. The optimizer, per parameter of fp32 master weights:
                     the clip reads the gradients and scales them (12 bytes), then AdamW: foreach on a CPU,
                     84 bytes (its eight multi-tensor passes; 96 in all, counted), fused on a GPU, one pass
                     over the parameter, gradient and both moments, 28 bytes (40 in all); with a 2-byte
                     compute dtype FSDP2's casts add 32 bytes (the parameter's cast to its compute copy
                     and that copy's one-rank all-gather, 6 + 4; the gradient's cast to fp32 and its
                     one-rank reduce-scatter into the sharded gradient, 6 + 16)
    operators        (57 + 232 per block (forward and backward, views included)) per microbatch + 7 per
                     parameter tensor + 28 (clip and optimizer), counted; and the trainer's own Python per
                     step (reading the batch, the microbatch split, the schedule, the step's record), costed
                     as 400 operators: fitted, the intercept of the debug preset's measured step over 1, 2
                     and 4 blocks (2-4 ms on a CPU thread; nothing next to a GPU step, where it overlaps)

The counts are those of tessera's eager step on CPU with torch 2.13, counted at the dispatcher (tests/
test_calibration.py recounts a block's and holds them within 25%). Compiled blocks fuse the elementwise
work, so the model over-predicts their step: it is an eager model, and the bench shows compiled rows'
ratio beside the eager ones. Matmuls dominate at scale; the counted terms are what is left at small sizes.
Without a calibration the planner keeps its uncalibrated model (FLOPs at `efficiency` of a datasheet peak).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from tessera.topology.shapes import as_shape

SCHEMA = 1
# clip 12 + fused AdamW (runtime/training/optim.py): 32 counted at the dispatcher on CPU, the CUDA kernel's 28
OPTIMIZER_BYTES_PER_PARAM = {"cpu": 44, "cuda": 40}
MIXED_PRECISION_BYTES_PER_PARAM = 32  # FSDP2 with a 2-byte compute dtype: parameter cast + copy 10, gradient 22
# over the fp32 logits of the chunked loss (the default, parallel/loss.py), reads + writes: the matmul's
# output cast (1), amax (1), subtract and exp in place (4), the row sum (1), the divide (2), the one-hot
# scatter (~0), the mask multiply (2), the cast for the gradient matmuls (1)
LOSS_PASSES = 12
# counted at the dispatcher; the fused AdamW's share: 1 op a tensor and 24 a step with the clip (foreach's: 3 and 32)
OPS_FIXED, OPS_PER_BLOCK, OPS_PER_TENSOR, OPS_OPTIMIZER = 57, 232, 5, 20
OPS_TRAINER = 400  # the trainer's per-step Python, as operators' worth of host time (fitted: module doc)


@dataclass(frozen=True)
class Calibration:
    """Achieved rates of one device kind in one compute dtype (see the module docstring)."""

    device_kind: str
    dtype: str  # "float32" or "bfloat16": the dtype the matmuls were measured in
    matmul_flops_per_s: float
    attention_flops_per_s: float
    memory_bytes_per_s: float
    op_overhead_s: float
    device_type: str  # "cuda" (the host's dispatch runs ahead of the device; fused AdamW) or "cpu"
    # the microbatch the rates were measured at, rows x seq_len (None: not recorded): a GEMM's rate depends on it
    measured_rows: int | None = None
    measured_seq_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("matmul_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"calibration {self.device_kind!r}: {name} {getattr(self, name)!r} must be positive")
        if not self.op_overhead_s >= 0:
            raise ValueError(f"calibration {self.device_kind!r}: op_overhead_s {self.op_overhead_s!r} must be >= 0")
        if self.device_type not in OPTIMIZER_BYTES_PER_PARAM:
            raise ValueError(f"calibration {self.device_kind!r}: device_type {self.device_type!r} must be cpu or cuda")

    @property
    def host_overlaps(self) -> bool:
        """A GPU's launches are asynchronous: the host runs ahead of the device."""
        return self.device_type == "cuda"

    @classmethod
    def from_entry(cls, entry: dict) -> "Calibration":
        """From one entry of a calibration file (its extra fields, such as where it was measured, are kept
        in the file, not here)."""
        # the fields with a default (where it was measured) are read from measured_at, not from the entry
        optional = {name for name, f in cls.__dataclass_fields__.items() if f.default is not MISSING}
        missing = [f for f in cls.__dataclass_fields__ if f not in entry and f not in optional]
        if missing:
            raise ValueError(f"calibration entry lacks {', '.join(missing)}; recalibrate with tessera plan --calibrate")
        measured_at = entry.get("measured_at")
        at: dict = measured_at if isinstance(measured_at, dict) else {}
        return cls(
            **{f: entry[f] for f in cls.__dataclass_fields__ if f not in optional},
            measured_rows=at.get("rows"),
            measured_seq_len=at.get("seq_len"),
        )


def entry_key(device_kind: str, dtype: str) -> str:
    return f"{device_kind} | {dtype}"


def find_entry(data: dict, device_kind: str, dtype: str | None = None) -> dict:
    """The entry of a calibration file (parsed JSON) whose device kind contains `device_kind` (case-
    insensitive) and, if given, measured in `dtype`; ValueError naming the entries there are otherwise."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        raise ValueError(
            f"not a tessera calibration file of schema {SCHEMA}; recalibrate with tessera plan --calibrate"
        )
    found = [
        e
        for e in data["entries"].values()
        if device_kind.lower() in str(e.get("device_kind", "")).lower() and (dtype is None or e.get("dtype") == dtype)
    ]
    if not found:
        have = "; ".join(sorted(data["entries"])) or "none"
        raise ValueError(
            f"no calibration for device kind {device_kind!r}{f' in {dtype}' if dtype else ''} (the file holds: "
            f"{have}); run tessera plan --calibrate on such a device"
        )
    return max(found, key=lambda e: e.get("created", ""))


def block_elements_per_token(shape, tp: int = 1) -> float:
    """Elements a block's elementwise operators read and write per token, forward + backward (module doc)."""
    cfg = as_shape(shape)
    D = cfg.dim
    Q = cfg.n_heads * cfg.head_dim // tp
    K = max(1, cfg.n_kv_heads // tp) * cfg.head_dim
    # an MoE block: a token's top_k experts and the shared expert each run a SwiGLU's elementwise ops
    F = ((cfg.top_k * cfg.ffn_dim + cfg.shared_ffn_dim) if cfg.n_experts else cfg.ffn_dim) // tp
    repeat = 2 * (Q + K) if cfg.n_kv_heads < cfg.n_heads else 0
    swiglu = cfg.mlp == "swiglu"
    forward = 20 * D + 11 * Q + 9 * K + (5 if swiglu else 2) * F + repeat
    backward = 60 * D + 12 * Q + 14 * K + (9 if swiglu else 3) * F + repeat
    if cfg.qk_norm:
        forward, backward = forward + 7 * (Q + K), backward + 24 * (Q + K)
    if cfg.norm == "layer":
        forward, backward = forward + 6 * D, backward + 6 * D
    if cfg.bias:
        backward += Q + 2 * K + 2 * D + (cfg.mlp_matrices - 1) * F
    return float(forward + backward)


def matmul_flops_per_token(shape) -> float:
    """6 x the parameters a token multiplies by (ModelShape.matmul_params)."""
    return 6.0 * as_shape(shape).matmul_params()


def attended_keys(seq_len: int, window: int | None = None) -> float:
    """Keys a query attends to on average under a causal mask: seq / 2, or within a sliding `window`
    (w = min(window, seq): the first w queries see 1..w keys, the rest w each) w - w^2 / (2 seq), the same
    seq / 2 once the window covers the sequence, and never more as the window narrows."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops_per_token(shape, seq_len: int) -> float:
    """Causal attention's training FLOPs per token: per block 2 x heads x keys x (qk head dim for the scores
    + v head dim for the weighted sum) forward, three times that with backward, at the keys a query attends
    to (`attended_keys`: seq / 2, fewer in a sliding block). With one head dim: 6 x layers x heads x head_dim
    x seq_len; latent attention's scores run at head_dim (nope + rope), its weighted sum at v_head_dim."""
    cfg = as_shape(shape)
    dims = cfg.head_dim + (cfg.v_head_dim or cfg.head_dim)
    sliding = len(cfg.sliding_layers)
    keys = (cfg.n_layers - sliding) * attended_keys(seq_len) + sliding * attended_keys(seq_len, cfg.sliding_window)
    return 6.0 * cfg.n_heads * dims * keys


def step_parts(
    shape,
    cal: Calibration,
    tokens: int,
    seq_len: int,
    params: float,
    param_tensors: int,
    layers: int,
    dtype_bytes: int,
    recompute: float = 0.0,
    share: float = 1.0,
    microbatches: int = 1,
) -> dict[str, float]:
    """Seconds of one rank's step by component: matmul, attention, memory, host, and "step" (their
    combination, module doc). `tokens` and `seq_len` are the step's whole (global) figures, `share` the
    fraction of the model FLOPs and traffic this rank does (1 / ranks for an even split); `params` and
    `param_tensors` are what this rank's optimizer steps; `layers` the blocks it runs; `recompute` the
    share of FLOPs activation checkpointing adds; `microbatches` how often it runs each of its blocks."""
    cfg = as_shape(shape)
    e = dtype_bytes
    matmul = matmul_flops_per_token(cfg) * tokens * share * (1 + recompute) / cal.matmul_flops_per_s
    attention = attention_flops_per_token(cfg, seq_len) * tokens * share * (1 + recompute) / cal.attention_flops_per_s
    activations = (cfg.n_layers * block_elements_per_token(cfg) + 33 * cfg.dim) * e * tokens * share
    loss = (LOSS_PASSES * 4 + (6 if e == 2 else 0)) * cfg.vocab_size * tokens * share
    optimizer = params * (
        OPTIMIZER_BYTES_PER_PARAM[cal.device_type] + (MIXED_PRECISION_BYTES_PER_PARAM if e == 2 else 0)
    )
    traffic = activations + loss + optimizer
    memory = traffic / cal.memory_bytes_per_s
    ops = (
        OPS_TRAINER
        + (OPS_FIXED + OPS_PER_BLOCK * layers) * microbatches
        + OPS_PER_TENSOR * param_tensors
        + OPS_OPTIMIZER
    )
    host = ops * cal.op_overhead_s
    device = matmul + attention + memory
    step = max(device, host) if cal.host_overlaps else device + host
    return {
        "matmul": matmul,
        "attention": attention,
        "memory": memory,
        "host": host,
        "step": step,
        "memory_traffic_bytes": traffic,
        "operators": float(ops),
    }
