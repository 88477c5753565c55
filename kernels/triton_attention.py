"""Flash attention in Triton: forward with the log-sum-exp, backward (dq, dk, dv), grouped-query heads, a
value head dim of its own, a sliding window, packed documents. The kernels are in triton_attention_kernels.

Both passes are torch.library custom ops with fake implementations, so torch.compile and meta-device
dry runs see shapes without running a kernel. On CPU tensors they run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from .checks import check_attention_inputs, check_documents, check_window
from .triton_attention_kernels import (
    LOG2E,
    MAX_HEAD_DIM,
    _attention_bwd_dkdv_kernel,
    _attention_bwd_dq_kernel,
    _attention_fwd_kernel,
    block_d,
)
from .triton_compat import INTERPRET


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs keep full precision (no TF32)


def kernel_refusal(q: Tensor, v: Tensor | None = None) -> str | None:
    """Why the kernel cannot take these inputs (None: it can)."""
    for name, t in (("head_dim", q), ("value head_dim", v)):
        if t is not None and t.shape[-1] > MAX_HEAD_DIM:
            return f"{name} {t.shape[-1]} is above the Triton attention kernel's {MAX_HEAD_DIM}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the Triton attention kernel (fp16, bf16, fp32)"
    return None


def check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    check_attention_inputs(q, k, v)
    refusal = kernel_refusal(q, v)
    if refusal is not None:
        raise ValueError(f"{refusal}; use backend='torch'")
    if not q.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton attention kernel needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 before "
            f"importing to run it on CPU, or use backend='torch'"
        )


def _doc_args(q: Tensor, k: Tensor, q_docs: Tensor | None, k_docs: Tensor | None) -> tuple[Tensor, Tensor, bool]:
    """The kernels' document-id pointers (int32, contiguous); without documents two unused placeholders."""
    docs = check_documents(q, k, q_docs, k_docs)
    if docs is None:
        empty = torch.zeros(1, dtype=torch.int32, device=q.device)
        return empty, empty, False
    return docs[0].to(torch.int32).contiguous(), docs[1].to(torch.int32).contiguous(), True


def _bounds(q: Tensor, k: Tensor, causal: bool, window: int | None, q_offset: int | None) -> dict:
    """The kernels' alignment arguments: q_off (query row 0's key position), the window and its switch."""
    check_window(window, causal)
    q_off = k.shape[2] - q.shape[2] if q_offset is None else int(q_offset)
    return {"q_off": q_off, "window": 0 if window is None else int(window), "WINDOW": window is not None}


@torch.library.custom_op("tessera::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    o = q.new_empty((B, Hq, Sq, Dv))
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    qd, kd, docs = _doc_args(q, k, q_docs, k_docs)
    bounds = _bounds(q, k, causal, window, q_offset)
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _attention_fwd_kernel[grid](
        q, k, v, o, lse, qd, kd, scale * LOG2E,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        Hq, Hq // Hkv, Sq, Sk, bounds["q_off"], bounds["window"],
        CAUSAL=causal, WINDOW=bounds["WINDOW"], DOCS=docs,
        HEAD_DIM=D, BLOCK_D=block_d(D), V_DIM=Dv, BLOCK_DV=block_d(Dv), PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return o, lse


@flash_attention_fwd.register_fake
def _(q, k, v, causal, scale, q_docs=None, k_docs=None, window=None, q_offset=None):
    # contiguous, as the kernel writes them: empty_like would copy a transposed q's strides, and inductor
    # checks the real outputs' strides against these
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tessera::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    # delta_i = sum_d dO_i,d O_i,d - dLSE_i: the row term of the softmax gradient (dLSE from ring merges)
    delta = ((do.float() * o.float()).sum(-1) - dlse.float()).contiguous()
    lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qd, kd, docs = _doc_args(q, k, q_docs, k_docs)
    bounds = _bounds(q, k, causal, window, q_offset)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    meta = dict(
        CAUSAL=causal, WINDOW=bounds["WINDOW"], DOCS=docs, HEAD_DIM=D, BLOCK_D=block_d(D), V_DIM=Dv,
        BLOCK_DV=block_d(Dv), PRECISION=_precision(q.dtype),
    )  # fmt: skip
    _attention_bwd_dkdv_kernel[lambda meta: (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, qd, kd, scale * LOG2E, scale, *strides,
        Hq, Hkv, Hq // Hkv, Sq, Sk, bounds["q_off"], bounds["window"], **meta,
    )  # fmt: skip
    _attention_bwd_dq_kernel[lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)](
        q, k, v, do, lse, delta, dq, qd, kd, scale * LOG2E, scale, *strides,
        Hq, Hq // Hkv, Sq, Sk, bounds["q_off"], bounds["window"], **meta,
    )  # fmt: skip
    return dq, dk, dv


@flash_attention_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, q_docs=None, k_docs=None, window=None, q_offset=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernels write


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, q_docs, k_docs, window, q_offset = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_docs, k_docs)
    ctx.causal, ctx.scale, ctx.window, ctx.q_offset = causal, scale, window, q_offset


def _backward(ctx, do, dlse):
    q, k, v, o, lse, q_docs, k_docs = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = flash_attention_bwd(
        do, q, k, v, o, lse, dlse, ctx.causal, ctx.scale, q_docs, k_docs, ctx.window, ctx.q_offset
    )
    return dq, dk, dv, None, None, None, None, None, None


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) from the Triton kernels; differentiable in q, k, v (through out and lse). Document ids
    (B, Sq) and (B, Sk), the window and q_offset as in tessera.kernels.flash_attention."""
    check_kernel_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return flash_attention_fwd(q, k, v, causal, scale, q_docs, k_docs, window, q_offset)


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    causal: bool,
    scale: float,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one key block given the whole softmax's o and lse (ring attention's backward)."""
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    return flash_attention_bwd(do, q, k, v, o, lse, dlse, causal, scale, q_docs, k_docs, window, q_offset)
