"""The primitives that model families and parallel/ share: RMSNorm, rotary positions (looked up by absolute
position, so context-parallel shards rotate at their true positions; plain or with a scaling of the
frequencies, `ROPE_SCALINGS`) and the attention slot. The blocks built from them are in attention.py, mlp.py,
moe.py and decoder.py.

Nothing here knows a family's module names or any parallelism. `CausalAttention` is the module a family puts
in its attention slot (the spec's `attention` pattern): context parallel swaps it for ring or all-gather
attention, and the kernels dispatch inside it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tessera.kernels import document_ids, flash_attention, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def llama3_scaled(
    inv_freq: Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
) -> Tensor:
    """Llama 3.1's RoPE frequencies: wavelengths longer than the original context / low_freq_factor are
    divided by `factor`, shorter than context / high_freq_factor kept, and the band between interpolated."""
    context = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (wavelen >= context / high_freq_factor) & (wavelen <= context / low_freq_factor)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


# RoPE's frequency scalings by config.json's rope_type: (inv_freq, **the scaling's parameters) -> inv_freq.
# A family's variant (YaRN for DeepSeek-V3 and gpt-oss) is one entry here, and Rotary takes it by name.
ROPE_SCALINGS = {"llama3": llama3_scaled}


class Rotary(nn.Module):
    """RoPE tables; looked up by absolute position so sharded sequences rotate at their true positions.
    `scaling`: the parameters of the frequency scaling `ROPE_SCALINGS[rope_type]` (None: plain RoPE)."""

    cos: Tensor  # (max_seq_len, head_dim / 2) fp32 buffers, not persistent (`reset_tables` computes them)
    sin: Tensor

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, scaling: tuple | None = None, rope_type: str = "llama3"
    ):
        super().__init__()
        if scaling and rope_type not in ROPE_SCALINGS:
            raise ValueError(f"rope_type {rope_type!r}: tessera scales RoPE as {', '.join(ROPE_SCALINGS)}")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.scaling = dict(scaling) if scaling else None
        self.rope_type = rope_type
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        device = device or (self.cos.device if self.cos.device.type != "meta" else "cpu")
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim)
        )
        if self.scaling:
            inv_freq = ROPE_SCALINGS[self.rope_type](inv_freq, **self.scaling)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def reset_buffers(self, device: torch.device | str) -> None:
        """Called by init_parameters once the model is on its device (the tables are not parameters)."""
        self.reset_tables(device)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, S, D); positions (S,) absolute token positions, or (B, S) per row (packed documents:
        each document's restart at 0), below max_seq_len (checked by the config, not here: a check would
        sync the host every layer). Pairs (i, i + D/2) rotate together."""
        cos, sin = self.cos, self.sin
        if cos.device != positions.device:  # a model built on meta keeps its tables on CPU until materialized
            cos, sin = cos.to(positions.device), sin.to(positions.device)
        cos, sin = cos[positions], sin[positions]  # (S, D/2), or (B, S, D/2)
        if positions.dim() == 2:  # one table per row, shared by the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.to(x.dtype)


class CausalAttention(nn.Module):
    """The attention op itself, (q, k, v, positions) -> o with q (B, Hq, S, D) and k, v (B, Hkv, S, D), behind
    one module slot: context parallel swaps in ring attention here; everything around it (projections, RoPE)
    stays the same. A family's spec names where these modules sit (`ModelSpec.attention`).

    `positions` as the model got them: (S,) is causal attention over the sequence; (B, S) positions that
    restart at each packed document also mask each token to its own document (`document_ids`)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None) -> Tensor:
        docs = None if positions is None else document_ids(positions, torch.arange(q.shape[2]))
        return flash_attention(q, k, v, causal=True, q_docs=docs)
