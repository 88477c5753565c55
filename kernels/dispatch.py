"""The one place that chooses how attention, RMSNorm and SwiGLU's activation run, and checks their inputs.

    flash_attention_backward  one key block's (dq, dk, dv) given the whole softmax's output and LSE:
                      the Triton backward kernels on CUDA; on CPU ATen's fused backward where
                      flash_attention would use ATen and no LSE gradient flows, else the torch reference.
    flash_attention   CUDA: cuDNN's attention through torch's SDPA for the plain calls it computes exactly
                      (16-bit, compute capability >= 9.0, no documents, window, sinks or LSE, causal only
                      with Sq == Sk, deterministic algorithms not asked for: `cudnn_attention.applies`),
                      else the Triton kernel; a shape or dtype the kernel does not take (head_dim > 256,
                      fp64) falls back to torch with a one-time warning. backend="torch" on CUDA: torch's
                      fused SDPA when no LSE is asked for (and Sq == Sk if causal), else the torch reference.
                      CPU: torch's fused CPU flash attention (ATen) when it computes the same thing
                      (fp32/fp64; causal only with Sq == Sk, since its mask is top-left) and the LSE is not
                      asked for, or is asked for with nothing to differentiate; otherwise the blockwise
                      torch reference (differentiable LSE).
    rms_norm          CUDA: the Triton kernel. CPU: torch's fused F.rms_norm for fp32/fp64, else the
                      reference (fp32 statistics for low-precision inputs).
    swiglu            silu(gate) * up. CUDA, eager: the Triton kernels (one pass each way, fp32 inside);
                      compiled or on CPU: torch's ops (inductor fuses them with their neighbours).
    cross_entropy_row_stats, cross_entropy_grad_
                      the chunked loss's softmax (parallel/loss.py): the Triton kernels where
                      `fused_cross_entropy` says so (CUDA, fp16/bf16/fp32 logits), else the torch reference;
                      the loss keeps its own in-place torch passes where the kernels do not run.

Every path takes a value head dim other than q/k's (v (B, Hkv, Sk, Dv); ATen's fused CPU op does not, so
such calls take the reference), a sliding `window` (key blocks outside it skipped where the code is
blockwise; ATen's op takes no window, so CPU calls with one take the reference, by query blocks) and
`q_offset` (where the queries sit among the keys); flash_attention also takes `sinks`, applied once to the
whole softmax's (out, lse) by `apply_sinks` (on CPU, a call without the LSE where ATen's op applies runs it
with the sinks folded into its backward: `sdpa_attention_with_sinks`).

backend="torch" forces the torch implementations, backend="triton" the kernels (on CPU only under
TRITON_INTERPRET=1). The triton modules are imported only when used: CPU training never imports triton.
"""

from __future__ import annotations

import warnings
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cudnn_attention
from .attention_reference import (
    apply_sinks,
    attention_backward_reference,
    attention_reference,
    document_attention,
    document_attention_backward,
    sdpa_attention,
    sdpa_attention_backward,
    sdpa_attention_with_sinks,
    sdpa_supports,
)
from .cross_entropy import cross_entropy_grad_reference_, cross_entropy_row_stats_reference
from .checks import (
    check_attention_inputs,
    check_documents,
    check_rms_norm_inputs,
    check_sinks,
    check_swiglu_inputs,
    check_window,
)
from .rmsnorm import rms_norm_reference

BACKENDS = ("torch", "triton")
_warned: set[str] = set()
_default_backend: str | None = None  # what backend=None means: None picks by device, as described above


def set_default_backend(backend: str | None) -> None:
    """What backend=None means for every later call in this process: None (pick by device), 'torch' or
    'triton'. The training job sets it from --kernels; a library caller can pass backend= per call instead."""
    global _default_backend
    _check_backend(backend)
    _default_backend = backend


def default_backend() -> str | None:
    return _default_backend


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use 'torch' or 'triton'")


def _effective_backend(backend: str | None) -> str | None:
    """The backend a call asked for (checked), else the process default (None: pick by device)."""
    _check_backend(backend)
    return backend or _default_backend


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    backend: str | None = ...,
    q_docs: Tensor | None = ...,
    k_docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
    q_offset: int | None = ...,
) -> Tensor: ...
@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = ...,
    scale: float | None = ...,
    *,
    return_lse: Literal[True],
    backend: str | None = ...,
    q_docs: Tensor | None = ...,
    k_docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
    q_offset: int | None = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    backend: str | None = ...,
    q_docs: Tensor | None = ...,
    k_docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
    q_offset: int | None = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...
def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
    q_offset: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq % Hkv == 0; causal aligned
    bottom-right. Returns out (B, Hq, Sq, Dv) in q's dtype, and with return_lse the log-sum-exp (B, Hq, Sq),
    fp32 (fp64 for fp64 inputs), natural log. Differentiable in q, k, v (and sinks) through out and lse.

    Packed documents: `q_docs` (B, Sq) and `k_docs` (B, Sk) integer document ids, non-decreasing along each
    row (k_docs defaults to q_docs); a query then sees only keys of its own document. The Triton kernel
    skips the tiles no query of which sees any key; on CPU each document runs on its own (the fused path).

    `window` (tokens, causal only): query i, at absolute position p_i = i + q_offset among the keys, sees
    key j iff j <= p_i and p_i - j < window -- transformers' sliding window (gpt-oss, Mistral: kv_idx >
    q_idx - sliding_window); window=1 is each token alone. Key blocks wholly outside every query's window
    are skipped, not masked. `q_offset` (default Sk - Sq, bottom-right) places the queries among the keys:
    context parallel passes each block's true offset. With documents the window applies within each one.

    `sinks` (Hq,): gpt-oss's attention sinks, a learned logit per query head in the softmax's denominator
    (`apply_sinks` on this call's (out, lse)); the returned lse includes them."""
    check_attention_inputs(q, k, v)
    check_window(window, causal)
    check_sinks(sinks, q)
    if (
        sinks is not None
        and not return_lse
        and q_docs is None
        and _effective_backend(backend) is None
        and sdpa_supports(q, k, v, causal, window, q_offset)
    ):
        return sdpa_attention_with_sinks(q, k, v, sinks, causal, scale)  # the model's call on CPU, fused
    if sinks is not None:
        o, lse = flash_attention(
            q,
            k,
            v,
            causal,
            scale,
            return_lse=True,
            backend=backend,
            q_docs=q_docs,
            k_docs=k_docs,
            window=window,
            q_offset=q_offset,
        )
        o, lse = apply_sinks(o, lse, sinks)
        return (o, lse) if return_lse else o
    if q_docs is not None and k_docs is None:
        k_docs = q_docs
    docs = check_documents(q, k, q_docs, k_docs)
    backend = _effective_backend(backend)
    if (
        backend is None
        and q.is_cuda
        and docs is None
        and not return_lse
        and cudnn_attention.applies(
            q,
            k,
            v,
            causal,
            window,
            q_offset,
            cudnn_attention.device_capability(q.device),
            torch.are_deterministic_algorithms_enabled(),
        )
    ):
        return cudnn_attention.cudnn_attention(q, k, v, causal, scale)
    if backend == "triton" or (backend is None and q.is_cuda):
        from . import triton_attention  # lazy: triton is optional (Linux only; CPU runs never load it)

        refusal = triton_attention.kernel_refusal(q, v)
        if refusal is None:
            out, lse = triton_attention.attention(q, k, v, causal, scale, q_docs, k_docs, window, q_offset)
            return (out, lse) if return_lse else out
        if backend == "triton":
            raise ValueError(f"{refusal}; use backend='torch'")
        _warn_once(refusal, f"{refusal}: falling back to torch's attention (slower) for these inputs")
    bottom_right = q_offset is None or q_offset == k.shape[2] - q.shape[2]
    if docs is not None:
        grad_lse = return_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if backend == "torch":
            out, lse = attention_reference(
                q, k, v, causal, scale, q_docs=q_docs, k_docs=k_docs, window=window, q_offset=q_offset
            )
        else:
            out, lse = document_attention(q, k, v, *docs, causal, scale, grad_lse, window, q_offset)
        return (out, lse) if return_lse else out
    if (
        backend == "torch"
        and q.is_cuda
        and not return_lse
        and window is None
        and (not causal or (q.shape[2] == k.shape[2] and bottom_right))
    ):
        # torch on CUDA: its fused SDPA (flash / cuDNN / efficient), whose causal mask is top-left (Sq == Sk here)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    elif backend is None and sdpa_supports(q, k, v, causal, window, q_offset):
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if not return_lse:
            return sdpa_attention(q, k, v, causal, scale)[0]
        if not needs_grad:  # its LSE has no autograd: fine when nothing will differentiate it (ring forward)
            return sdpa_attention(q, k, v, causal, scale)
    out, lse = attention_reference(q, k, v, causal, scale, window=window, q_offset=q_offset)
    return (out, lse) if return_lse else out


def flash_attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dlse: Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    q_offset: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention over this key block, given the output `o` and `lse` of the whole
    softmax the block is part of (ring attention's backward; with sinks, the o and lse after them: a sink
    adds no value, so the block's gradient is the plain one at the sunk softmax). CUDA: the Triton backward
    kernels; CPU: the blockwise torch reference. Document ids, window and q_offset as in flash_attention."""
    check_attention_inputs(q, k, v)
    check_window(window, causal)
    if q_docs is not None and k_docs is None:
        k_docs = q_docs
    docs = check_documents(q, k, q_docs, k_docs)
    backend = _effective_backend(backend)
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else float(scale)
    if backend == "triton" or (backend is None and q.is_cuda):
        from . import triton_attention  # lazy: triton is optional (Linux only; CPU runs never load it)

        refusal = triton_attention.kernel_refusal(q, v)
        if refusal is None:
            dlse = torch.zeros_like(lse) if dlse is None else dlse
            return triton_attention.attention_backward(
                do, q, k, v, o, lse, dlse, causal, scale, q_docs, k_docs, window, q_offset
            )
        if backend == "triton":
            raise ValueError(f"{refusal}; use backend='torch'")
        _warn_once(refusal, f"{refusal}: falling back to torch's attention (slower) for these inputs")
    if docs is not None:
        if backend == "torch":
            return attention_backward_reference(
                do,
                q,
                k,
                v,
                o,
                lse,
                dlse,
                causal,
                scale,
                q_docs=q_docs,
                k_docs=k_docs,
                window=window,
                q_offset=q_offset,
            )
        return document_attention_backward(do, q, k, v, o, lse, dlse, *docs, causal, scale, window, q_offset)
    if backend is None and dlse is None and sdpa_supports(q, k, v, causal, window, q_offset):
        return sdpa_attention_backward(do, q, k, v, o, lse, causal, scale)
    return attention_backward_reference(do, q, k, v, o, lse, dlse, causal, scale, window=window, q_offset=q_offset)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, backend: str | None = None) -> Tensor:
    """RMSNorm over the last dim, differentiable in x and weight."""
    check_rms_norm_inputs(x, weight)
    backend = _effective_backend(backend)
    if backend == "triton" or (backend is None and x.is_cuda):
        from . import triton_rmsnorm  # lazy: triton is optional (Linux only; CPU runs never load it)

        return triton_rmsnorm.rms_norm(x, weight, eps)
    if backend is None and x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_reference(x, weight, eps)


def swiglu(gate: Tensor, up: Tensor, backend: str | None = None) -> Tensor:
    """silu(gate) * up, differentiable in both: the fused Triton kernels (kernels/triton_swiglu.py) where asked,
    or by default on CUDA in an eager step (compiled, inductor fuses torch's ops with their neighbours); torch's
    ops elsewhere."""
    check_swiglu_inputs(gate, up)
    backend = _effective_backend(backend)
    if backend == "triton" or (backend is None and gate.is_cuda and not torch.compiler.is_compiling()):
        from . import triton_swiglu  # lazy: triton is optional (Linux only; CPU runs never load it)

        return triton_swiglu.swiglu(gate, up)
    return F.silu(gate) * up


FUSED_CROSS_ENTROPY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_cross_entropy(logits: Tensor, backend: str | None = None) -> bool:
    """Whether the chunked loss's softmax over these logits runs in the Triton kernels: backend='triton', or
    the default on CUDA, for fp16/bf16/fp32 logits (fp64 stays in torch)."""
    backend = _effective_backend(backend)
    triton_asked = backend == "triton" or (backend is None and logits.is_cuda)
    return triton_asked and logits.dtype in FUSED_CROSS_ENTROPY_DTYPES


def cross_entropy_row_stats(logits: Tensor, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """(max over each row, sum over the row of exp(x - max)) of logits (rows, V), fp32 (fp64 for fp64)."""
    if fused_cross_entropy(logits, backend):
        from . import triton_cross_entropy  # lazy: triton is optional (CPU runs never load it)

        return triton_cross_entropy.cross_entropy_row_stats(logits)
    return cross_entropy_row_stats_reference(logits)


def cross_entropy_grad_(
    logits: Tensor, target: Tensor, scale: Tensor, row_max: Tensor, row_sum: Tensor, backend: str | None = None
) -> None:
    """Over logits (rows, V), in place: (exp(x - row_max) / row_sum - [column == target]) * scale, per row;
    target (rows,) int64 is each row's target column in this shard, -1 where it is in none."""
    if fused_cross_entropy(logits, backend):
        from . import triton_cross_entropy  # lazy: triton is optional (CPU runs never load it)

        triton_cross_entropy.cross_entropy_grad_(logits, target, scale, row_max, row_sum)
    else:
        cross_entropy_grad_reference_(logits, target, scale, row_max, row_sum)
