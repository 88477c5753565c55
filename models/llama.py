"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied output head.

The model knows nothing of parallelism. `tessera.parallel.parallelize` makes it mesh-parallel by
swapping its linear layers and norms for the parallel layers of `parallel/tensor.py`, setting the
`input_comm` hooks and (context parallel) the attention `core` slot below; the forward code here is
the same on every layout. Head counts come from the tensors' shapes, never from attributes set from
outside. A pipeline stage is this model with some parts set to None: without `tok_embeddings` the input
is the previous stage's hidden states, without `norm`/`output` the output is hidden states. The loss is
`tessera.parallel.loss`'s: on the logits forward returns, or, given targets, inside the fused output head
that `apply_loss_head` swaps in (never the full logits). Parameter names follow Meta's Llama checkpoints
(tok_embeddings, layers.N.attention.wq, ..., norm, output), and a stage keeps the one-process names.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.kernels import flash_attention, rms_norm


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    init_std: float = 0.02
    # Llama 3.1's "llama3" RoPE scaling: (("factor", f), ("high_freq_factor", h), ("low_freq_factor", l),
    # ("original_max_position_embeddings", n)); None for plain RoPE. A dict is accepted and stored sorted.
    rope_scaling: tuple | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted((k, float(v)) for k, v in self.rope_scaling.items())))
        if self.rope_scaling is not None:
            keys = {k for k, _ in self.rope_scaling}
            need = {"factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings"}
            if keys != need:
                raise ValueError(f"rope_scaling needs exactly {sorted(need)}, got {sorted(keys)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def num_params(self) -> int:
        """Exact parameter count (unpadded vocab)."""
        hd = self.head_dim
        attn = self.dim * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.rope_scaling is None:  # plain RoPE: the dict checkpoints have always held
            del out["rope_scaling"]
        else:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out


BYTE_VOCAB = 258  # 256 byte values + BOS + EOS (the byte-level tokenizer of models.data)

PRESETS: dict[str, ModelConfig] = {
    # runs on a laptop CPU in seconds; heads/kv/ffn divide tp in {1, 2, 4}, vocab 258 exercises padding
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE_VOCAB, ffn_dim=192, max_seq_len=2048),
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=BYTE_VOCAB, ffn_dim=768, max_seq_len=4096),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192),
    # the published Llama 3 / 3.1 shapes
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[key], **overrides) if overrides else PRESETS[key]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def llama3_scaled(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position_embeddings: float) -> Tensor:
    """Llama 3.1's RoPE frequencies: wavelengths longer than the original context / low_freq_factor are
    divided by `factor`, shorter than context / high_freq_factor kept, and the band between interpolated."""
    context = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (wavelen >= context / high_freq_factor) & (wavelen <= context / low_freq_factor)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class Rotary(nn.Module):
    """RoPE tables; looked up by absolute position so sharded sequences rotate at their true positions."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: tuple | None = None):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        device = device or (self.cos.device if self.cos.device.type != "meta" else "cpu")
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim))
        if self.scaling:
            inv_freq = llama3_scaled(inv_freq, **self.scaling)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, S, D); positions (S,) absolute token positions, below max_seq_len (checked by the
        config, not here: a check would sync the host every layer). Pairs (i, i + D/2) rotate together."""
        cos, sin = self.cos[positions], self.sin[positions]  # (S, D/2)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.to(x.dtype)


class CoreAttention(nn.Module):
    """The attention op itself, (q, k, v) -> o, behind one module slot: context parallel swaps in ring
    attention here; everything around it (projections, RoPE) stays the same."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flash_attention(q, k, v, causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()
        self.core: nn.Module = CoreAttention()

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        x = self.input_comm(x)
        B, S, _ = x.shape
        # heads from the shapes: a tensor-parallel rank holds n_heads / tp of them
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        o = self.core(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.input_comm: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_comm(x)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, inputs: Tensor, positions: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """tokens (B, S) -> logits (B, S, V): the local vocab shard (and sequence shard) when parallel.

        A stage without `tok_embeddings` takes hidden states (B, S, dim) instead of tokens; one without
        `output` returns hidden states. `positions` (S,) are the tokens' global positions (default
        0..S-1); a context-parallel rank passes those of the chunks it holds. With `targets` (B, S) the
        output module computes the loss itself and (loss sum over valid targets, their count) is returned
        instead of logits: that needs the fused head that `tessera.parallel.loss.apply_loss_head` installs
        (parallelize does, with --loss chunked), which never materializes the full logits."""
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        h = self.tok_embeddings(inputs) if self.tok_embeddings is not None else inputs
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        if self.norm is not None:
            h = self.norm(h)
        if targets is None:
            return self.output(h) if self.output is not None else h
        if self.output is None:
            raise ValueError("targets given to a model part without the output head (a pipeline stage before the "
                             "last): pass targets to the last stage only")
        if not getattr(self.output, "takes_targets", False):
            raise TypeError(f"Transformer.forward(targets=...) needs the fused loss head, and `output` is a "
                            f"{type(self.output).__name__}: install it with tessera.parallel.loss.apply_loss_head(model) "
                            f"(parallelize does, with --loss chunked), or call model(inputs) and a loss on the logits")
        return self.output(h, targets)


def build_model(cfg: ModelConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Build the one-process model on `device` and initialize it from `seed`; on "meta" nothing is
    allocated (parallelize it, `to_empty` on the real device, then `init_weights`)."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta" and seed is not None:
        init_weights(model, seed)
    return model


INIT_TILE = (256, 256)  # rows x columns drawn by one generator


def param_init_std(name: str, cfg: ModelConfig) -> float | None:
    """The truncated-normal std of a parameter (None: ones, the norms). Output projections (wo, w2) are
    scaled by 1/sqrt(2 * n_layers)."""
    if name.endswith("norm.weight"):
        return None
    return cfg.init_std * (1.0 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)


def init_region(name: str, shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...], std: float | None,
                seed: int, out: Tensor | None = None) -> Tensor:
    """The values of rows/columns [offset, offset + size) of parameter `name` (global `shape`), written
    into `out` (any dtype and device) or a new float32 tensor.

    The global tensor is cut into fixed INIT_TILE tiles, each drawn from its own generator seeded by
    (seed, name, tile); a region draws only the tiles it covers. So every rank's shard equals that slice
    of the one-process initialization, and no rank ever holds more than its shard plus one tile."""
    if out is None:
        out = torch.empty(size)
    if std is None:
        return out.fill_(1.0)
    if len(shape) > 2:
        raise ValueError(f"{name}: init_region handles 1-D and 2-D parameters, not shape {tuple(shape)}")
    shape2 = (shape[0], shape[1] if len(shape) == 2 else 1)
    off2 = (offset[0], offset[1] if len(shape) == 2 else 0)
    size2 = (size[0], size[1] if len(shape) == 2 else 1)
    view = out.view(size2)
    (tr, tc) = INIT_TILE
    for i in range(off2[0] // tr, -(-(off2[0] + size2[0]) // tr)):
        for j in range(off2[1] // tc, -(-(off2[1] + size2[1]) // tc)):
            r0, c0 = i * tr, j * tc
            tile_shape = (min(tr, shape2[0] - r0), min(tc, shape2[1] - c0))
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{i}/{j}".encode())) % 2**63)
            tile = torch.nn.init.trunc_normal_(torch.empty(tile_shape), std=std, a=-3 * std, b=3 * std, generator=gen)
            # the part of the tile inside the region
            a0, a1 = max(r0, off2[0]), min(r0 + tile_shape[0], off2[0] + size2[0])
            b0, b1 = max(c0, off2[1]), min(c0 + tile_shape[1], off2[1] + size2[1])
            view[a0 - off2[0] : a1 - off2[0], b0 - off2[1] : b1 - off2[1]] = tile[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0]
    return out


def local_region(p: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of the piece of `p` this rank holds (the whole tensor if not a DTensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return (0,) * p.dim(), tuple(p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset), tuple(size)


def init_weights(model: Transformer, seed: int) -> None:
    """Initialize every parameter this rank holds from the seed (see `init_region`): the one-process
    model, or a model built on the meta device, parallelized and materialized with `to_empty`, whose
    DTensor shards are filled from the tiles they cover. Values depend only on the seed and the
    parameter's one-process name, never on the layout or the order modules were built in."""
    from torch.distributed.tensor import DTensor

    cfg = model.config
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # the one-process name seeds the generators
        local = p.to_local() if isinstance(p, DTensor) else p
        offset, size = local_region(p)
        if tuple(local.shape) != tuple(size):
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the region {size} at {offset}")
        with torch.no_grad():  # in place, tile by tile: no shard-sized temporary
            if local.is_contiguous():
                init_region(name, tuple(p.shape), offset, size, param_init_std(name, cfg), seed, out=local)
            else:
                local.copy_(init_region(name, tuple(p.shape), offset, size, param_init_std(name, cfg), seed))
    model.rope.reset_tables(next(model.parameters()).device)
