"""Attention blocks the model families share, each with the tensor-parallel plan of its own modules.

A block takes the normalized hidden states and the model's rotary tables, (x, rope, positions) -> output, and has
two slots that parallel/ fills (the identity and the plain op on one process), and one that generation fills:
    input_comm   the hidden states every column-parallel projection reads: copied to / gathered over tp
    core         the attention op (layers.CausalAttention): ring or all-gather attention under cp
    kv_cache     None, or while generating a models/kv_cache.py KVCache: the new tokens' rotated keys and
                 values appended to the prefix's, the queries attending to all of them (causal, bottom-right)
Head counts come from the tensors' shapes (a tensor-parallel rank holds n_heads / tp of them), never from
attributes set from outside. The projections are named by the family (`AttentionNames`: Hugging Face's by
default), so a family's checkpoints and plans keep their parameter names. DeepSeek-V3's latent attention and
gpt-oss's sinks and sliding windows are further blocks here with the same slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .layers import CausalAttention, RMSNorm, Rotary
from .spec import TPPlan


class AttentionNames(NamedTuple):
    """The projections' module names (Hugging Face's by default)."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"


def check_heads(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """ValueError for head counts grouped-query attention with RoPE cannot take (a config's __post_init__)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with n_kv_heads K/V heads shared by groups of query heads (GQA), RoPE on q and k.
    `qk_norm_eps`: q and k RMS-normalized over head_dim before RoPE, one weight shared by every head (Qwen3's
    QK-norm, as transformers' modeling_qwen3.py: modules q_norm and k_norm); None: no QK-norm (Llama).
    gpt-oss's options (transformers' GptOssAttention): `bias`, biases on q, k, v and o; `sinks`, a learned
    logit per query head in the softmax's denominator (the parameter `sinks`, split over tp with the query
    heads: `head_params`); `window`, a sliding window of that many tokens (None: the whole causal past)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        names: AttentionNames = AttentionNames(),
        qk_norm_eps: float | None = None,
        bias: bool = False,
        sinks: bool = False,
        window: int | None = None,
    ):
        super().__init__()
        self.head_dim, self.names = head_dim, names
        self.add_module(names.q, nn.Linear(dim, n_heads * head_dim, bias=bias))
        self.add_module(names.k, nn.Linear(dim, n_kv_heads * head_dim, bias=bias))
        self.add_module(names.v, nn.Linear(dim, n_kv_heads * head_dim, bias=bias))
        self.add_module(names.o, nn.Linear(n_heads * head_dim, dim, bias=bias))
        self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.head_params: tuple[str, ...] = ("sinks",) if sinks else ()  # one value per query head
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim, qk_norm_eps)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()
        self.core: nn.Module = CausalAttention() if window is None else CausalAttention(window=window)
        self.kv_cache: nn.Module | None = None  # a KVCache while generating (models/kv_cache.py)

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        x = self.input_comm(x)
        B, S, _ = x.shape
        n = self.names
        q = getattr(self, n.q)(x).view(B, S, -1, self.head_dim)
        k = getattr(self, n.k)(x).view(B, S, -1, self.head_dim)
        v = getattr(self, n.v)(x).view(B, S, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # QK-norm over each head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        if self.kv_cache is not None:  # incremental decoding: the prefix's keys and values, then these
            k, v = self.kv_cache(k, v)
        if self.sinks is None:
            o = self.core(q, k, v, positions)
        else:  # this rank's heads' sinks (a DTensor's shard under tp)
            sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks
            o = self.core(q, k, v, positions, sinks=sinks)
        return getattr(self, n.o)(o.transpose(1, 2).reshape(B, S, -1))


def attention_tp_plan(
    names: AttentionNames = AttentionNames(), qk_norm: bool = False, sinks: bool = False
) -> tuple[tuple[str, str], ...]:
    """The block's tensor-parallel plan, its module names relative to the block ("" is the block itself): the
    input prepared once for q, k and v (and the sinks split with the query heads), the query heads split, K/V
    split over kv heads (or replicated), the output projection's partial sums reduced, QK-norm on each rank's
    own heads."""
    block = "block_input_heads" if sinks else "block_input"
    plan = (("", block), (names.q, "colwise"), (names.k, "kv"), (names.v, "kv"), (names.o, "rowwise"))
    return plan + ((("q_norm", "head_norm"), ("k_norm", "head_norm")) if qk_norm else ())


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3's MLA, as transformers' DeepseekV3Attention, its module names):
    queries from a low-rank latent (q_a_proj -> q_a_layernorm -> q_b_proj; `q_lora_rank` None: one q_proj), keys
    and values from one latent shared by every head (kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj). Each
    head's query and key are a part without position (qk_nope_head_dim) and a rotated part (qk_rope_head_dim);
    the keys' rotated part is one head that every head shares. Values are v_head_dim wide (the core takes v
    of another width than q and k).

    `rope_interleave` (DeepSeek's checkpoints): the rotated dims pair as (x0, x1), (x2, x3), ...; they are
    de-interleaved before RoPE, as transformers' apply_rotary_pos_emb_interleave, whose output is laid out
    that way too. `softmax_scale`: (qk_nope + qk_rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2
    (the family computes it); q is scaled so the core's own 1/sqrt(head dim) gives it.

    Tensor parallel (`latent_attention_tp_plan`): the down projections and their norms run before `input_comm`
    on the tokens as the residual stream holds them, replicated (small, and their latent is what every head
    reads), so their gradients are whole on each rank like a norm's; `input_comm` copies (or gathers over the
    sequence) the latents, narrower than the hidden states, once for the head-split projections. The
    `kv_cache` slot holds the expanded keys and values of this rank's heads."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rope_interleave: bool = True,
        latent_eps: float = 1e-6,
    ):
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleave = rope_interleave
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        # the core scales by qk_head_dim^-0.5 itself
        self.q_scale = softmax_scale * qk_head_dim**0.5
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_b_proj: nn.Module | None = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.input_comm: nn.Module = nn.Identity()  # on the latents: see the class docstring
        self.core: nn.Module = CausalAttention()
        self.kv_cache: nn.Module | None = None

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latents = [self.kv_a_layernorm(kv_nope), k_rot]
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            latents.insert(0, self.q_a_layernorm(self.q_a_proj(x)))
        else:  # q_proj reads the hidden states themselves
            latents.insert(0, x)
        q_in, kv_nope, k_rot = self.input_comm(torch.cat(latents, dim=-1)).split(
            [latents[0].shape[-1], self.kv_lora_rank, self.rope_dim], dim=-1
        )
        B, S, _ = q_in.shape
        q_up = self.q_b_proj if self.q_b_proj is not None else self.q_proj
        assert q_up is not None
        q = q_up(q_in).view(B, S, -1, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        k_nope, v = (self.kv_b_proj(kv_nope).view(B, S, -1, self.nope + self.v_head_dim).transpose(1, 2)).split(
            [self.nope, self.v_head_dim], dim=-1
        )
        q_rot, k_rot = rope(self._pairs(q_rot), positions), rope(self._pairs(k_rot.unsqueeze(1)), positions)
        H = q.shape[1]  # this rank's heads
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, H, S, self.rope_dim)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.kv_cache is not None:  # incremental decoding: the prefix's keys and values, then these
            k, v = self.kv_cache(k, v)
        o = self.core(q, k, v.contiguous(), positions)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

    def _pairs(self, x: Tensor) -> Tensor:
        """The rotated dims as Rotary pairs them, (i, i + D/2): de-interleaved from (2i, 2i + 1) if interleaved."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.rope_interleave else x


def latent_attention_tp_plan() -> TPPlan:
    """LatentAttention's tensor-parallel plan, relative to the block: the heads split (q_b_proj, or q_proj,
    and kv_b_proj on their output features, o_proj on its input features: one reduce); the down projections
    q_a_proj and kv_a_proj_with_mqa and their norms replicated, as the decoder's norms are (they are small,
    and their latent is what every head reads); the latents prepared once (`input_comm`, "block_input").
    A block has q_proj or the q_a/q_b pair: the other's rules match nothing."""
    return (
        ("", "block_input"),
        ("q_proj", "colwise"),
        ("q_a_proj", "replicated"),
        ("q_a_layernorm", "norm"),
        ("q_b_proj", "colwise"),
        ("kv_a_proj_with_mqa", "replicated"),
        ("kv_a_layernorm", "norm"),
        ("kv_b_proj", "colwise"),
        ("o_proj", "rowwise"),
    )
