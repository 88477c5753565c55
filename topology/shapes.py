"""A model's sizes as plain numbers (`ModelShape`), the parameter shapes one tensor-parallel rank holds of
them, and FSDP2's rule for cutting them: the pure arithmetic the planner, the memory model and the
communication model count with (checked against the fake-backend build in tests/test_planner.py). No torch
and nothing of tessera.models: a family's spec gives the shape (`spec.shape(config)`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from tessera.topology.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes as plain numbers: what the memory model, the planner, the
    communication model and MFU count with. A family's spec gives it (`ModelSpec.shape(config)`); nothing
    here imports torch or knows a family's module names.

    Per block: a norm, q/k/v/o projections (n_heads x head_dim queries, n_kv_heads x head_dim keys and
    values), optionally a norm over head_dim on q and on k (qk_norm), a second norm, and the MLP: "swiglu"
    (gate, up, down: 3 matrices of dim x ffn_dim) or "gelu" (up, down: 2), or a mixture of experts
    (n_experts > 0: n_experts SwiGLU experts of ffn_dim, top_k of them per token, a router of n_experts x
    dim and a shared expert of shared_ffn_dim; with `moe_bias`, the router and each routed expert have biases,
    as gpt-oss's). `attention_sinks`: a learned logit per query head (gpt-oss). `kv_lora_rank` > 0: multi-head
    latent attention in place of q/k/v (DeepSeek-V3); `n_dense_layers`: an MoE model's first blocks with a dense
    MLP of dense_ffn_dim instead of the experts. Around the blocks: the token
    embedding, `learned_positions` rows of a position table (0: rotary), a final norm and the head (the
    embedding itself when tied)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_dim: int
    mlp: str = "swiglu"  # "swiglu" or "gelu"
    norm: str = "rms"  # "rms" (a weight) or "layer" (weight and bias)
    qk_norm: bool = False
    tied_embeddings: bool = False
    bias: bool = False  # biases on the linear layers
    learned_positions: int = 0
    family: str = "llama"
    # positions the rotary tables cover (their cos and sin, fp32 buffers on every rank; none with learned
    # positions); 0: not known, the planner counts tables of the planned sequence length
    max_seq_len: int = 0
    # mixture of experts (0: a dense MLP): each block's MLP is n_experts experts of ffn_dim, top_k of them
    # per token, a router (n_experts x dim) and a shared expert of shared_ffn_dim (0: none)
    n_experts: int = 0
    top_k: int = 0
    shared_ffn_dim: int = 0
    # MoE blocks add the sequence-level auxiliary loss (models/moe.py): its per-sequence counts are summed over
    # cp, and activation checkpointing's recompute runs on past the block's output reduce to rebuild it
    moe_aux_loss: bool = True
    attention_sinks: bool = False  # one learned logit per query head in each block's attention (gpt-oss)
    moe_bias: bool = False  # the router and every routed expert's matrices have biases (gpt-oss)
    # multi-head latent attention (kv_lora_rank > 0, DeepSeek-V3): queries up from a latent of q_lora_rank (0: one
    # projection of dim), keys and values up from one latent of kv_lora_rank, each latent behind a norm; head_dim
    # is a query or key head's width, qk_rope_head_dim of it rotated (that part of the keys one shared head),
    # v_head_dim a value head's; n_kv_heads = n_heads
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the first n_dense_layers blocks of an MoE model have a dense MLP of dense_ffn_dim (DeepSeek-V3's first 3)
    n_dense_layers: int = 0
    dense_ffn_dim: int = 0
    # a sliding window of attention (gpt-oss): the blocks of `sliding_layers` attend to at most sliding_window keys
    # (a query itself and the window - 1 before it); 0: every block attends to its whole causal past
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # the experts' SwiGLU clamped (gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate and up clamped), which
    # keeps more for backward than silu(gate) * up (topology/estimators/activations.py)
    swiglu_clamp: bool = False

    def __post_init__(self) -> None:
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"ModelShape.mlp {self.mlp!r}: 'swiglu' or 'gelu'")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"ModelShape.norm {self.norm!r}: 'rms' or 'layer'")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelShape.top_k {self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.n_dense_layers and not (self.n_experts and self.n_dense_layers <= self.n_layers):
            raise ValueError(
                f"ModelShape.n_dense_layers {self.n_dense_layers}: the first of an MoE model's n_layers={self.n_layers}"
            )
        if self.sliding_layers and not (
            self.sliding_window > 0 and all(0 <= i < self.n_layers for i in self.sliding_layers)
        ):
            raise ValueError(
                f"ModelShape.sliding_layers {self.sliding_layers}: blocks of n_layers={self.n_layers} with a "
                f"sliding_window > 0 (it is {self.sliding_window})"
            )
        if self.n_experts and self.mlp != "swiglu":
            raise ValueError(
                f"ModelShape.mlp {self.mlp!r} with n_experts={self.n_experts}: experts are SwiGLU, use 'swiglu'"
            )

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def norm_params(self) -> int:
        return self.dim * (2 if self.norm == "layer" else 1)

    def attention_params(self) -> int:
        """One block's attention projections (and latent attention's two norms)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if not self.kv_lora_rank:
            return self.dim * (2 * q + 2 * kv) + (q + 2 * kv + self.dim if self.bias else 0)
        rank, rope = self.kv_lora_rank, self.qk_rope_head_dim
        queries = self.q_lora_rank * (self.dim + 1 + q) if self.q_lora_rank else self.dim * q
        keys_values = self.dim * (rank + rope) + rank + rank * self.n_heads * (self.head_dim - rope + self.v_head_dim)
        return queries + keys_values + self.n_heads * self.v_head_dim * self.dim

    def block_params(self, experts: int | None = None, dense: bool = False) -> int:
        """One block's parameters; `experts`: count that many of an MoE block's experts (default: all);
        `dense`: one of an MoE model's first n_dense_layers, its MLP dense_ffn_dim wide."""
        attn = self.attention_params()
        ffn = self.dense_ffn_dim if dense else self.ffn_dim
        mlp = self.mlp_matrices * self.dim * ffn + ((self.mlp_matrices - 1) * ffn + self.dim if self.bias else 0)
        if self.n_experts and not dense:  # routed experts, the router (biases with `moe_bias`), the shared expert
            mlp = (self.n_experts if experts is None else experts) * self._expert_params()
            mlp += self.n_experts * (self.dim + self.moe_bias) + self.mlp_matrices * self.dim * self.shared_ffn_dim
        sinks = self.n_heads if self.attention_sinks else 0
        return attn + mlp + 2 * self.norm_params + (2 * self.head_dim if self.qk_norm else 0) + sinks

    def _expert_params(self) -> int:
        """One routed expert's parameters: its matrices, and with `moe_bias` a bias per matrix."""
        bias = (self.mlp_matrices - 1) * self.ffn_dim + self.dim if self.moe_bias else 0
        return self.mlp_matrices * self.dim * self.ffn_dim + bias

    def expert_params(self) -> int:
        """The routed experts' parameters over all blocks (what expert parallelism shards)."""
        return (self.n_layers - self.n_dense_layers) * self.n_experts * self._expert_params()

    def num_params(self) -> int:
        """Exact parameter count (unpadded vocabulary; a tied head counted once)."""
        embed = self.vocab_size * self.dim * (1 if self.tied_embeddings else 2)
        blocks = self._blocks(None)
        return blocks + embed + self.learned_positions * self.dim + self.norm_params

    def _blocks(self, experts: int | None) -> int:
        """Every block's parameters, the dense ones apart (`block_params`)."""
        dense = self.n_dense_layers * self.block_params(dense=True) if self.n_dense_layers else 0
        return dense + (self.n_layers - self.n_dense_layers) * self.block_params(experts)

    def matmul_params(self) -> int:
        """Parameters a token's forward multiplies by: all but the lookup tables (token embedding, learned
        positions), the output head included (tied or not); the norms' and biases' few are counted with them,
        as 6 N counts do. An MoE block counts the top_k experts a token runs (its active parameters)."""
        active = self.top_k if self.n_experts else None
        return self._blocks(active) + self.norm_params + self.vocab_size * self.dim


# The fields a config may lack when read by name (`as_shape`): their defaults are Llama's.
_OPTIONAL = tuple(
    f.name
    for f in fields(ModelShape)
    if f.name not in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim")
)


def as_shape(model) -> ModelShape:
    """`model` as a ModelShape: a ModelShape as it is; any other object read by ModelShape's field names
    (tessera's LlamaConfig has them all but the optional ones, whose defaults are Llama's). Another
    family's config is refused: its sizes are what its spec says (`spec_of(config).shape(config)`)."""
    if isinstance(model, ModelShape):
        return model
    try:
        return _read_shape(model)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return _read_shape.__wrapped__(model)


@functools.lru_cache(maxsize=1024)
def _read_shape(cfg) -> ModelShape:
    family = getattr(cfg, "family", "llama")
    lacking = [name for name in _OPTIONAL if not hasattr(cfg, name) and name not in ("family", "max_seq_len")]
    if lacking and family != "llama":
        raise TypeError(
            f"{type(cfg).__name__} (family {family!r}) lacks ModelShape's {', '.join(lacking)}: pass its "
            f"spec's shape, spec_of(config).shape(config), not the config"
        )
    missing = [f.name for f in fields(ModelShape) if f.name not in _OPTIONAL and not hasattr(cfg, f.name)]
    if missing:
        raise TypeError(f"{type(cfg).__name__} is not a model shape: it lacks {', '.join(missing)} (pass a ModelShape)")
    return ModelShape(**{f.name: getattr(cfg, f.name) for f in fields(ModelShape) if hasattr(cfg, f.name)})


# ----------------------------------------------------------------------------- the pipeline's stage split
def split_layer_counts(n_layers: int, n_stages: int) -> list[int]:
    """The even split's blocks per stage: the remainder on the first stages (4 over 3: 2,1,1)."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (s < extra) for s in range(n_stages)]


def split_layers(n_layers: int, n_stages: int, layers_per_stage=None) -> list[range]:
    """The block indices of each pipeline stage: `layers_per_stage` (e.g. 3,3,2), or an even split with the
    remainder on the first stages. The one rule: the stage builds, the planner and the communication model
    read it (parallel/pipeline.py re-exports it)."""
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != n_stages:
            raise ValueError(
                f"layers_per_stage={','.join(map(str, counts))} lists {len(counts)} stages; the run has "
                f"{n_stages} (pp x virtual): give one count per stage"
            )
        empty = [s for s, c in enumerate(counts) if c < 1]
        if empty:  # said first: a sum that matches (0,2 of 2 layers) is not what is wrong
            stages = " and ".join(
                [", ".join(map(str, empty[:-1])), str(empty[-1])] if len(empty) > 1 else [str(empty[0])]
            )
            raise ValueError(
                f"layers_per_stage={','.join(map(str, counts))} leaves stage{'s' if len(empty) > 1 else ''} {stages} "
                f"without a layer ({', '.join(str(counts[s]) for s in empty)}); each stage needs at least one"
                + (
                    f" (e.g. layers_per_stage={','.join(map(str, split_layer_counts(n_layers, n_stages)))})"
                    if n_layers >= n_stages
                    else f", and {n_stages} stages need n_layers={n_stages} or more"
                )
            )
        if sum(counts) != n_layers:
            raise ValueError(
                f"layers_per_stage={','.join(map(str, counts))} must be positive counts summing to "
                f"n_layers={n_layers} (they sum to {sum(counts)})"
            )
    else:
        if n_stages > n_layers:
            raise ValueError(
                f"{n_stages} pipeline stages (pp x virtual) but only {n_layers} layers: every stage "
                f"needs a layer; lower `pp`/`virtual` or use n_layers={n_stages} or more"
            )
        counts = split_layer_counts(n_layers, n_stages)
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(start, start + c) for start, c in zip(starts, counts)]


# ----------------------------------------------------------------------------- the kv-heads rule
def kv_heads_split(n_kv_heads: int, tp: int) -> bool:
    """Whether tp splits the K/V heads (tp divides them). Otherwise, when they divide tp, every rank keeps
    the whole K/V projections and uses the one head its query heads read (tessera's ReplicatedHeads)."""
    return n_kv_heads % tp == 0


def kv_heads_fit(n_kv_heads: int, tp: int) -> bool:
    """The one rule tp must keep with the kv heads: split them, or be a multiple of them (replicated)."""
    return kv_heads_split(n_kv_heads, tp) or tp % n_kv_heads == 0


def _kv_local(shape: ModelShape, tp: int) -> int:
    """Output features of the k (or v) projection on one tp rank: kv heads split, or all of them
    replicated when tp exceeds the kv heads (tessera's ReplicatedHeads keeps the whole weight)."""
    return (
        shape.n_kv_heads * shape.head_dim // tp
        if kv_heads_split(shape.n_kv_heads, tp)
        else shape.n_kv_heads * shape.head_dim
    )


# ----------------------------------------------------------------------------- the degree rules
# One copy each, torch-free: parallelize's checks before any process group starts, the planner's verdicts and
# the memory model's shapes all call these.
def check_tensor_parallel(cfg, tp: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
    """Raise ConfigError naming the value and the fix if a model of shape `cfg` (a ModelShape, or a config
    with n_heads, n_kv_heads and ffn_dim) cannot be split over `tp` ranks; `seq_len`: the tokens a cp rank
    holds, which sequence parallel splits over tp."""
    if cfg.n_heads % tp:
        raise ConfigError(
            f"tp={tp} does not divide the {cfg.n_heads} attention heads; use a tp that divides {cfg.n_heads}"
        )
    if not kv_heads_fit(cfg.n_kv_heads, tp):
        raise ConfigError(
            f"tp={tp} and n_kv_heads={cfg.n_kv_heads}: one must divide the other (kv heads are split when tp "
            f"divides them and replicated when they divide tp)"
        )
    if cfg.ffn_dim % tp:
        raise ConfigError(
            f"tp={tp} does not divide the MLP width ffn_dim={cfg.ffn_dim}; use a tp that divides {cfg.ffn_dim}"
        )
    dense = getattr(cfg, "dense_ffn_dim", 0) if getattr(cfg, "n_dense_layers", 0) else 0
    if dense % tp:  # an MoE model's dense first layers (DeepSeek-V3)
        raise ConfigError(
            f"tp={tp} does not divide the dense layers' MLP width dense_ffn_dim={dense}; use a tp that divides {dense}"
        )
    if getattr(cfg, "bias", False) and not kv_heads_split(cfg.n_kv_heads, tp):  # replicated K/V heads: no bias
        raise ConfigError(
            f"tp={tp} exceeds the {cfg.n_kv_heads} kv heads, and the K/V projections have biases (kv heads are "
            f"replicated only without them); use a tp that divides n_kv_heads={cfg.n_kv_heads}"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ConfigError(
            f"sequence parallel needs the sequence length divisible by tp: seq_len={seq_len}, tp={tp}; "
            f"use seq_len={seq_len - seq_len % tp or tp}"
        )


def check_expert_parallel(n_experts: int, ep: int, shard_ranks: int, model: str = "this model") -> None:
    """Raise ConfigError naming the value and the fix if `ep` cannot split a model's `n_experts` (0: a dense
    model, called `model` in the message) or the `shard_ranks` (dp_shard x cp) it borrows."""
    if ep == 1:
        return
    if not n_experts:
        raise ConfigError(
            f"ep={ep} needs a mixture-of-experts model ({model} has no experts); use ep 1, or a "
            f"model with experts such as qwen3-moe-debug"
        )
    if n_experts % ep:
        raise ConfigError(f"ep={ep} does not divide the {n_experts} experts; use a divisor of {n_experts}")
    if shard_ranks % ep:
        raise ConfigError(
            f"ep={ep} must divide dp_shard x cp = {shard_ranks} (the ranks expert parallel borrows); "
            + (
                f"raise `dp` or `cp` to a multiple of {ep} (e.g. dp={ep}), or drop `ep`"
                if shard_ranks == 1
                else f"raise `dp` or `cp`, or use `ep` dividing {shard_ranks}"
            )
        )


def expert_param_shapes(shape, tp: int, ep: int = 1) -> list[tuple[int, int]]:
    """(rows, cols) of one MoE block's routed experts on one rank, in the rows FSDP2 shards (the expert dim):
    gate_proj and up_proj (E / ep, ffn / tp x dim) and down_proj (E / ep, dim x ffn / tp), as
    parallel/expert.py's shard_experts leaves them (experts split over ep, each expert's ffn over tp);
    [] for a dense block."""
    s = as_shape(shape)
    if not s.n_experts:
        return []
    check_expert_parallel(s.n_experts, ep, ep)
    local, f = s.n_experts // ep, s.ffn_dim // tp
    biases = [(local, f)] * (s.mlp_matrices - 1) + [(local, s.dim)] if s.moe_bias else []  # the down bias whole
    return [(local, f * s.dim)] * (s.mlp_matrices - 1) + [(local, s.dim * f)] + biases


def layer_param_shapes(shape, tp: int, ep: int = 1, experts: bool = True) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter of one block on one rank of tp (and ep), in the rows FSDP2 shards (dim 0;
    a vector is (n, 1)): the attention norm (weight, and bias for a layer norm), q, k, v (their biases split
    like them), the qk-norm weights (head_dim each, replicated), o (its bias replicated: added after the sum
    over tp), the MLP norm, then a dense MLP's up matrices (gate and up for SwiGLU, one for GELU; biases
    split) and down matrix (bias replicated), or an MoE block's router (E x dim, replicated), its shared
    expert (split like a dense MLP) and its routed experts (`expert_param_shapes`: E / ep of them).
    `experts=False` leaves the routed experts out: under ep they are an FSDP2 unit of their own, sharded
    over the ranks ep leaves of dp_shard x cp (`layer_shard_groups`)."""
    s = as_shape(shape)
    h, hd = s.dim, s.head_dim
    q, kv, f = s.n_heads * hd // tp, _kv_local(s, tp), s.ffn_dim // tp
    norm = [(h, 1)] * (2 if s.norm == "layer" else 1)
    if s.kv_lora_rank:  # latent attention: the down projections and their norms whole, the heads split
        out = [*norm, *latent_attention_shapes(s, tp)]
    else:
        out = [*norm, (q, h), (kv, h), (kv, h)]
    if s.bias:
        out += [(q, 1), (kv, 1), (kv, 1)]
    if s.qk_norm:
        out += [(hd, 1), (hd, 1)]
    if not s.kv_lora_rank:
        out.append((h, q))
    if s.bias:
        out.append((h, 1))
    if s.attention_sinks:  # split with the query heads
        out.append((q // hd, 1))
    out += norm
    ups = s.mlp_matrices - 1
    if s.n_experts:  # the router (replicated), the shared expert (colwise up, rowwise down), the experts
        sf = s.shared_ffn_dim // tp
        out.append((s.n_experts, h))
        if s.moe_bias:
            out.append((s.n_experts, 1))
        if sf:
            out += [(sf, h)] * ups + [(h, sf)]
        return out + (expert_param_shapes(s, tp, ep) if experts else [])
    out += [(f, h)] * ups + ([(f, 1)] * ups if s.bias else [])
    out.append((h, f))
    if s.bias:
        out.append((h, 1))
    return out


def latent_attention_shapes(shape, tp: int) -> list[tuple[int, int]]:
    """Multi-head latent attention's parameters on one tp rank (models/attention.py's plan): q_a_proj and its
    norm (or no query latent), q_b_proj (or q_proj) on this rank's heads, kv_a_proj_with_mqa and its norm
    whole, kv_b_proj on this rank's heads, o_proj on their values."""
    s = as_shape(shape)
    h, heads, rank = s.dim, s.n_heads // tp, s.kv_lora_rank
    q = [(s.q_lora_rank, h), (s.q_lora_rank, 1), (heads * s.head_dim, s.q_lora_rank)] if s.q_lora_rank else []
    nope = s.head_dim - s.qk_rope_head_dim
    return [
        *(q or [(heads * s.head_dim, h)]),
        (rank + s.qk_rope_head_dim, h),
        (rank, 1),
        (heads * (nope + s.v_head_dim), rank),
        (h, heads * s.v_head_dim),
    ]


def layer_shard_groups(shape, tp: int, ep: int, shards: int) -> list[tuple[list[tuple[int, int]], int]]:
    """One block's parameters on one rank by the FSDP2 group that cuts them, [(shapes, ranks in the group)]:
    the whole block over the `shards` ranks of dp_shard x cp, or under expert parallel the block without its
    routed experts over them and the experts (their own unit) over the shards // ep ranks ep leaves (edp)."""
    if ep == 1 or not as_shape(shape).n_experts:
        return [(layer_param_shapes(shape, tp, ep), shards)]
    if shards % ep:
        raise ValueError(f"ep={ep} must divide the {shards} FSDP ranks of dp_shard x cp; raise `dp` or `cp`")
    return [
        (layer_param_shapes(shape, tp, ep, experts=False), shards),
        (expert_param_shapes(shape, tp, ep), shards // ep),
    ]


def stage_param_shapes(
    shape, tp: int, first: bool, last: bool, n_layers: int, ep: int = 1
) -> list[list[tuple[int, int]]]:
    """One list of (rows, cols) per FSDP unit of a stage on one tp rank: the first stage's token embedding
    (rows split over tp: ceil(V / tp), as torch.chunk cuts them) and learned position table (split the same
    way), the blocks (`layer_param_shapes`, with E / ep experts each), and the last stage's final norm with
    the head. A tied head is the embedding: a stage
    that is first and last holds it once; a later last stage holds a copy (its gradient summed with the
    first stage's), and the unit that holds it goes to FSDP2's root together with the final norm (FSDP2
    shards a shared tensor once)."""
    s = as_shape(shape)
    vocab_rows = -(-s.vocab_size // tp)  # torch.chunk rows: ceil(V / tp)
    embedding = (vocab_rows, s.dim)
    final_norm = [(s.dim, 1)] * (2 if s.norm == "layer" else 1)
    units: list[list[tuple[int, int]]] = []
    if first and not (s.tied_embeddings and last):
        units.append([embedding])
    if first and s.learned_positions:
        units.append([(-(-s.learned_positions // tp), s.dim)])
    units += [layer_param_shapes(s, tp, ep) for _ in range(n_layers)]
    if last:
        units.append([embedding, *final_norm] if s.tied_embeddings else [*final_norm, embedding])
    return units


def fsdp_shard_numel(rows: int, cols: int, shards: int, index: int = 0) -> int:
    """Elements FSDP2 leaves on shard `index` of a (rows, cols) tensor: torch.chunk of dim 0."""
    if shards == 1:
        return rows * cols
    per = -(-rows // shards)
    return max(0, min(per, rows - index * per)) * cols


# fp32 logits one chunk may hold, at least: 2^24 elements (64 MiB). Small enough that the chunk is a few
# percent of the full logits at CPU sizes (and MKL keeps its blocked kernels: below ~32 rows its dh sums over
# the vocabulary measured ~5x less accurate).
CHUNK_ELEMENTS = 2**24
# ... and by default at least this many fp32 logits per element of the hidden states h (N x D): every chunk
# adds its dW (V x D, a weight-sized fp32 pass) once, so the chunk's tokens must outweigh that pass. At the
# floor alone a 128256 vocabulary cut 32768 tokens into 251 chunks of 130, and those passes took 26% of the
# 1b preset's step on an H200 (benchmarks/results/gpu_suite_h200.json); 4 x N x D makes ceil(V / 4D) chunks
# (16 of 2048 tokens there: 1 GiB of fp32 logits beside ~54 GiB of activations).
LOGITS_PER_HIDDEN_ELEMENT = 4


def default_chunk_elements(n_tokens: int, hidden: int) -> int:
    """The default budget of fp32 logits per chunk: max(CHUNK_ELEMENTS, 4 x n_tokens x hidden)."""
    return max(CHUNK_ELEMENTS, LOGITS_PER_HIDDEN_ELEMENT * max(0, n_tokens) * max(0, hidden))


def chunk_tokens(n_tokens: int, vocab_rows: int, chunk_elements: int | None = None, hidden: int = 0) -> int:
    """Tokens per chunk: the fewest chunks whose fp32 logits (tokens x vocab_rows) stay within
    `chunk_elements` (None: `default_chunk_elements(n_tokens, hidden)`), k = ceil(N * V / budget), cut as
    evenly as they go, ceil(N / k) tokens each (at least 1: a vocabulary row wider than the budget still runs
    one token at a time). Under tp `vocab_rows` is the padded shard ceil(V / tp), so every tp rank cuts the
    same chunks and their collectives pair up."""
    if chunk_elements is None:
        chunk_elements = default_chunk_elements(n_tokens, hidden)
    if n_tokens <= 0:
        return 1
    chunks = max(1, math.ceil(n_tokens * max(1, vocab_rows) / max(1, chunk_elements)))
    return max(1, math.ceil(n_tokens / chunks))
