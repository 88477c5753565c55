"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight over the last dim, statistics in float32."""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import _pick_backend


def check_rms_norm_inputs(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be 1-D with the size of x's last dim ({x.shape[-1]})")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device; got {x.device} and {weight.device}")


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    acc_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics (fp64 stays fp64)
    xf = x.to(acc_dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(acc_dtype)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, backend: str | None = None) -> Tensor:
    """RMSNorm over the last dim; CUDA tensors use the Triton kernel, CPU tensors the torch reference."""
    check_rms_norm_inputs(x, weight)
    if _pick_backend(backend, x) == "triton":
        from . import triton_rmsnorm

        return triton_rmsnorm.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
