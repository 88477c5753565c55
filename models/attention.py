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

from torch import Tensor, nn

from .layers import CausalAttention, RMSNorm, Rotary


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
    QK-norm, as transformers' modeling_qwen3.py: modules q_norm and k_norm); None: no QK-norm (Llama)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        names: AttentionNames = AttentionNames(),
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.head_dim, self.names = head_dim, names
        self.add_module(names.q, nn.Linear(dim, n_heads * head_dim, bias=False))
        self.add_module(names.k, nn.Linear(dim, n_kv_heads * head_dim, bias=False))
        self.add_module(names.v, nn.Linear(dim, n_kv_heads * head_dim, bias=False))
        self.add_module(names.o, nn.Linear(n_heads * head_dim, dim, bias=False))
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim, qk_norm_eps)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()
        self.core: nn.Module = CausalAttention()
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
        o = self.core(q, k, v, positions)
        return getattr(self, n.o)(o.transpose(1, 2).reshape(B, S, -1))


def attention_tp_plan(names: AttentionNames = AttentionNames(), qk_norm: bool = False) -> tuple[tuple[str, str], ...]:
    """The block's tensor-parallel plan, its module names relative to the block ("" is the block itself): the
    input prepared once for q, k and v, the query heads split, K/V split over kv heads (or replicated), the
    output projection's partial sums reduced, QK-norm on each rank's own heads."""
    plan = (("", "block_input"), (names.q, "colwise"), (names.k, "kv"), (names.v, "kv"), (names.o, "rowwise"))
    return plan + ((("q_norm", "head_norm"), ("k_norm", "head_norm")) if qk_norm else ())
