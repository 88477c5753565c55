"""cuDNN's fused attention, through torch's SDPA, for the plain attention calls of a step on a Hopper-class GPU.

Why: at the shapes a training step runs, cuDNN's attention is about twice as fast as the Triton kernel
forward + backward (one H200, torch 2.11, the GPU suite's kernels part: 510-563 TFLOP/s against 256-298,
causal, head dim 128, seq 4k-16k), at FlashAttention-2's bf16 accuracy against float64
(`benchmarks/bench_attention_accuracy.py`, GQA: the same rms errors; single-element maxima of dq and dk up to
1.35x FA2's). It takes none of what the Triton kernel adds: packed documents, a sliding window, sinks, a query
offset other than bottom-right with Sq == Sk, a differentiable LSE (context parallel's ring). `applies`
names exactly the calls it serves; the dispatcher sends every other call to the kernel, and
`--kernels triton` sends all of them there. cuDNN's backward is not deterministic in torch (it has no
deterministic mode there), the Triton kernel's is (dq in a kernel of its own, no atomics): under
`torch.use_deterministic_algorithms(True)` every call goes to the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CUDNN_DTYPES = (torch.bfloat16, torch.float16)
MIN_CAPABILITY = (9, 0)  # measured on Hopper (H100, H200); Ampere keeps the Triton kernel
MAX_HEAD_DIM = 128  # cuDNN's training kernels (forward and backward) up to 128 on every cuDNN 9 torch ships


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability. Read each call, not memoized: dynamo folds this call into a
    constant, where a memo's first write inside a trace would fail its own guard and compile the block twice."""
    return torch.cuda.get_device_capability(device)


def applies(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    window: int | None,
    q_offset: int | None,
    capability: tuple[int, int] | None,
    deterministic: bool = False,
) -> bool:
    """Whether cuDNN's attention computes this call exactly as flash_attention defines it: CUDA tensors of
    one 16-bit dtype on a GPU of compute capability >= 9.0 (`capability`, None off CUDA), one head dim
    (a multiple of 8, at most 128) for q, k and v, no window, and causal only with Sq == Sk aligned
    bottom-right (SDPA's causal mask is top-left, the same one then), and not `deterministic` (torch's
    deterministic algorithms asked for). Documents, sinks and the LSE are the caller's to exclude."""
    sq, sk = q.shape[2], k.shape[2]
    offset = sk - sq if q_offset is None else q_offset
    return (
        not deterministic
        and capability is not None
        and capability >= MIN_CAPABILITY
        and q.is_cuda
        and q.dtype in CUDNN_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= MAX_HEAD_DIM
        and window is None
        and offset == sk - sq
        and (not causal or sq == sk)
    )


def cudnn_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
    """softmax(q k^T * scale) v by torch's SDPA with cuDNN first; flash, memory-efficient and math follow in
    that order, so a shape this cuDNN build turns down still runs (what `applies` admits, cuDNN 9 takes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # lazy: CUDA training only

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    with sdpa_kernel(order, set_priority=True):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
