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
from typing import Callable

import torch
from torch import Tensor, nn

from tessera.kernels import document_ids, flash_attention, rms_norm
from tessera.kernels.checks import check_window


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


def yarn_scaled(
    inv_freq: Tensor,
    theta: float,
    factor: float,
    original_max_position_embeddings: float,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> tuple[Tensor, float]:
    """YaRN (as transformers' `_compute_yarn_parameters`): frequencies that turn fewer than `beta_slow` times
    over the original context divided by `factor`, more than `beta_fast` times kept, a linear ramp over the
    dimensions between (`truncate`: the ramp's ends rounded outward to whole dimensions; gpt-oss has False).
    The attention factor multiplies cos and sin: given, else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (DeepSeek-V3: 1.0), else 0.1 ln(factor) + 1."""
    dim = 2 * inv_freq.shape[0]
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = beta_fast or 32.0, beta_slow or 1.0  # 0 means the default, as in transformers

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: the original frequency, 0: divided by factor
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 without scaling): the attention factor's parts,
    and DeepSeek-V3's softmax scale multiplier (mscale_all_dim, squared)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(inv_freq: Tensor, theta: float, **scaling: float) -> tuple[Tensor, float]:
    return llama3_scaled(inv_freq, **scaling), 1.0


# RoPE's frequency scalings by config.json's rope_type: (float64 inv_freq, theta, **the scaling's parameters) ->
# (inv_freq, the factor that multiplies cos and sin). A family's variant is one entry here (YaRN: DeepSeek-V3's
# and gpt-oss's), and Rotary takes it by name.
ROPE_SCALINGS: dict[str, Callable[..., tuple[Tensor, float]]] = {"llama3": _llama3, "yarn": yarn_scaled}


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
        factor = 1.0  # YaRN's attention factor multiplies cos and sin (transformers' attention_scaling)
        if self.scaling:
            inv_freq, factor = ROPE_SCALINGS[self.rope_type](inv_freq, self.theta, **self.scaling)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        self.cos, self.sin = (angles.cos() * factor).float(), (angles.sin() * factor).float()

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
    """The attention op itself, (q, k, v, positions) -> o with q (B, Hq, S, D), k (B, Hkv, S, D) and v (B, Hkv,
    S, Dv), behind one module slot: context parallel swaps in ring attention here (keeping `window`);
    everything around it (projections, RoPE) stays the same. A family's spec names where these modules sit
    (`ModelSpec.attention`).

    `positions` as the model got them: (S,) is causal attention over the sequence; (B, S) positions that
    restart at each packed document also mask each token to its own document (`document_ids`).
    `window`: a sliding window of that many tokens (a token sees itself and the window - 1 before it; None:
    the whole causal past). `sinks` (Hq,): attention sinks, a learned logit per query head in the softmax's
    denominator (the block owns the parameter and passes it; see tessera.kernels.apply_sinks)."""

    def __init__(self, window: int | None = None):
        super().__init__()
        check_window(window, causal=True)
        self.window = window

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        docs = None if positions is None else document_ids(positions, torch.arange(q.shape[2]))
        return flash_attention(q, k, v, causal=True, q_docs=docs, window=self.window, sinks=sinks)

    def extra_repr(self) -> str:
        return "" if self.window is None else f"window={self.window}"
