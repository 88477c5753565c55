"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied output head.

This is the one-process model. `parallel.parallelize` turns it into a mesh-parallel one by swapping
its linear layers and norms for the parallel layers of `parallel/tensor.py` and setting the
`input_comm` hooks below; the forward code here is the same on every layout. Parameter names follow
Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ..., norm, output).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import flash_attention, rms_norm


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
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
        return asdict(self)


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


class Rotary(nn.Module):
    """RoPE tables; looked up by absolute position so sharded sequences rotate at their true positions."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        device = device or (self.cos.device if self.cos.device.type != "meta" else "cpu")
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, S, D); positions (S,) absolute token positions. Pairs (i, i + D/2) rotate together."""
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len={self.max_seq_len}")
        cos, sin = self.cos[positions], self.sin[positions]  # (S, D/2)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        # the heads this rank computes; parallelize divides them over tp
        self.n_local_heads, self.n_local_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        x = self.input_comm(x)
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        o = flash_attention(q, k, v, causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, self.n_local_heads * self.head_dim))


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
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # the hook that turns final hidden states into a loss; parallelize swaps in the vocab-parallel one
        self.loss_fn = plain_cross_entropy

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens (B, S) -> logits (B, S, V); the local vocab shard (and sequence shard) when parallel."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        return self.output(self.norm(h))

    def loss(self, tokens: Tensor, targets: Tensor, positions: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy over the tokens this rank holds (targets -100 are ignored)."""
        return self.loss_fn(self(tokens, positions), targets)


def plain_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


def build_model(cfg: ModelConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Build the one-process model on `device` ("meta" for dry runs) and initialize it from `seed`."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta" and seed is not None:
        init_weights(model, seed)
    return model


def init_weights(model: Transformer, seed: int) -> None:
    """Initialize every parameter from its own generator, seeded by (seed, parameter name).

    Because each tensor's values depend only on the seed and its name, never on the order modules were
    built in or on the layout, a rank's slice of a parallel parameter is exactly that slice of the
    one-process initialization. Works on the one-process model and on a model built on the meta device,
    parallelized and materialized with `to_empty` (each rank fills its DTensor shards; the full tensor
    exists one parameter at a time). Output projections (wo, w2) are scaled by 1/sqrt(2 * n_layers).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    cfg = model.config
    depth_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # the one-process name seeds the generator
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            full = torch.ones(p.shape)
        else:
            std = cfg.init_std * (depth_scale if name.endswith(("wo.weight", "w2.weight")) else 1.0)
            full = torch.nn.init.trunc_normal_(torch.empty(p.shape), std=std, a=-3 * std, b=3 * std, generator=gen)
        with torch.no_grad():
            if isinstance(p, DTensor):  # a meta-built, parallelized model: keep this rank's piece only
                piece = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(piece.to_local())
            else:
                p.copy_(full.to(p.dtype))
    model.rope.reset_tables(next(model.parameters()).device)
