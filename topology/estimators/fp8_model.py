"""What --fp8 changes in a step, as plain numbers (torch-free): which matmuls run in FP8, at what rate, the
bytes the casts move through memory, and the bytes FSDP2's float8 all-gather saves.

The rule of which layers convert is parallel/fp8.py's: the spec's attention projections and dense MLP
matrices (an MoE block's shared expert; never its routed experts, its router or the output head), each
only when both dims, and the dim tp splits after the split, are multiples of 16; K/V projections replicated
over tp beyond the kv heads stay high precision.

Rates: FP8 matmuls at FP8_MATMUL_SPEEDUP x the bf16 rate, the datasheet's ratio (H100 SXM: 1979 dense FP8
TFLOP/s against 989 bf16), until a GPU calibrates it; every other FLOP at the bf16 rate.
Casts: torchao casts each operand once per gemm it enters (input and weight in the forward; the output
gradient twice, the weight and the input again in the backward), each cast reading the high-precision tensor
twice (its amax, then the scaled cast) and writing one byte an element. tessera's eager step shares an input's
cast among the layers that read it (q, k, v; gate and up) and its amax between forward and backward
(parallel/fp8_shared_casts.py): `cast_bytes_per_step(shared_inputs=recipe)`.
"""

from __future__ import annotations

from tessera.topology.shapes import ModelShape, as_shape

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_MATMUL_SPEEDUP = 2.0
FP8_BYTES = 1


def fp8_layer_groups(shape, tp: int = 1) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """One block's linear layers that run in FP8 (parallel/fp8.py's rule), grouped by the input they read, with
    the op that writes it: the attention's q, k, v ("norm": the normed input), its output projection
    ("attention"), the MLP's gate and up ("norm"), its down projection ("swiglu", or "gelu"). Each layer (out,
    in, the dim tp splits: 0 column-parallel, 1 row-parallel), global dims."""
    cfg: ModelShape = as_shape(shape)
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    groups = [("norm", [(q, cfg.dim, 0)] + ([(kv, cfg.dim, 0)] * 2 if tp <= cfg.n_kv_heads else [])),
              ("attention", [(cfg.dim, q, 1)])]  # fmt: skip
    ffn = cfg.shared_ffn_dim if cfg.n_experts else cfg.ffn_dim
    if ffn:
        groups += [("norm", [(ffn, cfg.dim, 0)] * (cfg.mlp_matrices - 1)), (cfg.mlp, [(cfg.dim, ffn, 1)])]
    kept = [
        (by, [(o, i, s) for o, i, s in g if o % 16 == 0 and i % 16 == 0 and (o, i)[s] % (16 * tp) == 0])
        for by, g in groups
    ]
    return [(by, g) for by, g in kept if g]


def fp8_layers(shape, tp: int = 1) -> list[tuple[int, int, int]]:
    """(out, in, the dim tp splits) of one block's linear layers that run in FP8, in the block's order."""
    return [layer for _, group in fp8_layer_groups(shape, tp) for layer in group]


def fp8_params(shape, tp: int = 1) -> int:
    """The parameters of the whole model whose matmuls run in FP8."""
    cfg = as_shape(shape)
    return cfg.n_layers * sum(o * i for o, i, _ in fp8_layers(cfg, tp))


def fp8_flop_share(shape, seq_len: int, tp: int = 1) -> float:
    """The share of a step's training FLOPs in FP8 matmuls (6 x their parameters per token, of the planner's
    6 N + attention count)."""
    cfg = as_shape(shape)
    total = 6.0 * cfg.matmul_params() + 6.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6.0 * fp8_params(cfg, tp) / total


def blended_peak(fp8_share: float, bf16_peak: float, fp8_peak: float) -> float:
    """The peak FLOP/s of a step whose `fp8_share` of matmul FLOPs run at `fp8_peak` and the rest at `bf16_peak`
    (each FLOP at its own peak: the harmonic mean weighted by the FLOPs)."""
    return 1 / (fp8_share / fp8_peak + (1 - fp8_share) / bf16_peak)


def fp8_time_factor(share: float, speedup: float = FP8_MATMUL_SPEEDUP) -> float:
    """A compute time's factor when `share` of its FLOPs run `speedup` x faster."""
    return 1.0 - share + share / speedup


def cast_bytes_per_step(
    shape,
    tokens: float,
    tp: int = 1,
    elem_bytes: int = 2,
    weight_casts: float = 1.0,
    shared_inputs: str | None = None,
    shared_backward: bool = True,
) -> float:
    """Bytes one rank's FP8 casts move through memory in a step where its matmuls see `tokens` tokens (under
    sequence parallel, the tp group's gathered ones): per layer, on its tp-local slices, the input and the
    output gradient cast twice each, the weight twice per forward and backward, `weight_casts` times a step
    (its microbatches; under FSDP2's FP8 all-gather each gather casts only the rank's 1 / fsdp shard, so
    microbatches / fsdp); each cast reads 2 x elem_bytes (its amax, then the scaled cast) and writes one byte.
    `shared_inputs` (the recipe of tessera's eager step, parallel/fp8_shared_casts.py): each input cast once in
    the forward and once in the backward for the layers that read it, its amax found once (tensorwise) or once
    each way (rowwise), and the forward's amax of the down projection's input, and without tp of the normed
    inputs, written beside them by the Triton SwiGLU and RMSNorm (kernels/fp8_amax.py). `shared_backward` False
    (activation checkpointing: the backward's saved inputs are detached copies, one per layer): the backward
    casts each layer's input for itself, its amax included."""
    cfg = as_shape(shape)
    e = elem_bytes
    cast, amax = e + FP8_BYTES, e  # a scaled cast reads and writes; an amax reads
    total = 0.0
    for producer, group in fp8_layer_groups(cfg, tp):
        for out, inp, split in group:
            out_l, in_l = (out // tp, inp) if split == 0 else (out, inp // tp)
            total += (2 * tokens * out_l + 2 * out_l * in_l * weight_casts) * (cast + amax)
            if shared_inputs is None:
                total += 2 * tokens * in_l * (cast + amax)
            elif not shared_backward:
                total += tokens * in_l * (cast + amax)
        if shared_inputs is not None:
            out, inp, split = group[0]
            in_l = inp if split == 0 else inp // tp
            # the producers that note their output's row amaxes; under tp the norm's output reaches q/k/v gathered
            noted = producer == "swiglu" or (producer == "norm" and tp == 1 and cfg.norm == "rms")
            if shared_backward:  # one cast each way; the amax once (tensorwise) or once each way (rowwise)
                amaxes = (1 if shared_inputs == "tensorwise" else 2) - noted
                total += tokens * in_l * (2 * cast + amaxes * amax)
            else:  # the forward's one cast (its amax unless noted); the backward's per layer, above
                total += tokens * in_l * (cast + (1 - noted) * amax)
    return cfg.n_layers * total


def fsdp_param_bytes(shape, elem_bytes: int, recipe: str | None, tp: int) -> float:
    """The mean bytes an element FSDP2 all-gathers: FP8 weights in one byte under tensorwise without tp
    (parallel/parallelize.py's rule), the rest in the compute dtype."""
    cfg = as_shape(shape)
    if recipe != "tensorwise" or tp > 1:
        return float(elem_bytes)
    share = fp8_params(cfg, tp) / cfg.num_params()
    return FP8_BYTES * share + elem_bytes * (1 - share)


def fp8_summary(shape, recipe: str, tp: int = 1, fsdp: int = 1, elem_bytes: int = 2) -> dict[str, float]:
    """What --fp8 changes for `tessera memory`, per rank: the parameters in FP8 linear layers (whose fp32
    master weights, gradients and optimizer state are unchanged), the bytes FSDP2 all-gathers of them per
    gather (FP8 under tensorwise without tp; the compute dtype otherwise) against the compute dtype's, and
    the casts' memory traffic per token its matmuls see."""
    cfg = as_shape(shape)
    params = fp8_params(cfg, tp)
    local = params / tp
    fp8_gather = recipe == "tensorwise" and tp == 1 and fsdp > 1
    gathered = local * (fsdp - 1) / fsdp if fsdp > 1 else 0.0
    return {
        "fp8_params": float(params),
        "params": float(cfg.num_params()),
        "all_gather_bytes_per_gather": gathered * (FP8_BYTES if fp8_gather else elem_bytes),
        "all_gather_bytes_per_gather_without_fp8": gathered * elem_bytes,
        "cast_bytes_per_token": cast_bytes_per_step(cfg, 1.0, tp, elem_bytes)
        - cast_bytes_per_step(cfg, 0.0, tp, elem_bytes),
        "cast_bytes_of_weights_per_microbatch": cast_bytes_per_step(
            cfg, 0.0, tp, elem_bytes, 1 / fsdp if fp8_gather else 1.0
        ),
    }
