"""Attention: `flash_attention(q, k, v, causal, scale, return_lse)` with a torch reference beside the kernel.

Shapes: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) with Hq a multiple of Hkv (grouped-query attention:
query head h reads kv head h // (Hq // Hkv)). Causal masking is aligned bottom-right, as in
FlashAttention-2: query i sees key j when j <= i + (Sk - Sq); with Sq == Sk that is the usual lower
triangle. The log-sum-exp (natural log, float32 -- float64 for float64 inputs -- shape (B, Hq, Sq)) is what ring attention needs to
merge partial results.

The torch reference is blockwise over keys with an online softmax (the algorithm of the kernel, in
plain differentiable torch), so CPU training and the kernel tests share one definition of the numbers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

REFERENCE_BLOCK = 128


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) for grouped-query attention"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None, block: int = REFERENCE_BLOCK
) -> tuple[Tensor, Tensor]:
    """Blockwise attention in torch; returns (out in q's dtype, lse float32). Differentiable in q, k, v."""
    check_attention_inputs(q, k, v)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    # (B, Hkv, group, Sq, D): the query heads that share a kv head sit together, so k/v broadcast
    qf = q.to(acc_dtype).reshape(B, Hkv, group, Sq, D) * scale
    kf, vf = k.to(acc_dtype).unsqueeze(2), v.to(acc_dtype).unsqueeze(2)
    rows = torch.arange(Sq, device=q.device).view(Sq, 1) + (Sk - Sq)
    opts = dict(device=q.device, dtype=acc_dtype)
    m = torch.full((B, Hkv, group, Sq, 1), float("-inf"), **opts)
    l = torch.zeros((B, Hkv, group, Sq, 1), **opts)
    acc = torch.zeros((B, Hkv, group, Sq, D), **opts)
    for start in range(0, Sk, block):
        stop = min(start + block, Sk)
        if causal and start > Sq - 1 + (Sk - Sq):
            break  # every later key is masked for every query
        s = qf @ kf[..., start:stop, :].transpose(-1, -2)
        if causal:
            cols = torch.arange(start, stop, device=q.device).view(1, -1)
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # rows with nothing visible yet keep m = -inf; shift by 0 there to avoid inf - inf
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ vf[..., start:stop, :]
        m = m_new
    empty = l == 0  # queries that see no key at all (causal with Sk < Sq): output 0, lse -inf
    out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(l), l))
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, torch.ones_like(l), l)))
    return out.reshape(B, Hq, Sq, D).to(q.dtype), lse.reshape(B, Hq, Sq)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Softmax(q k^T) v with every head materialized: the definition the other implementations are tested against."""
    group = q.shape[1] // k.shape[1]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(group, dim=1).to(acc_dtype)
    v = v.repeat_interleave(group, dim=1).to(acc_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.to(acc_dtype) @ k.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - Sq)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ v).to(q.dtype), lse


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over (B, H, S, D) tensors; CUDA tensors use the Triton kernel, CPU tensors the torch
    reference. backend="torch" or "triton" forces one (Triton on CPU needs TRITON_INTERPRET=1)."""
    check_attention_inputs(q, k, v)
    backend = _pick_backend(backend, q)
    if backend == "triton":
        from . import triton_attention

        out, lse = triton_attention.attention(q, k, v, causal, scale)
    else:
        out, lse = attention_reference(q, k, v, causal, scale)
    return (out, lse) if return_lse else out


def _pick_backend(backend: str | None, x: Tensor) -> str:
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r}; use 'torch' or 'triton'")
    return backend
