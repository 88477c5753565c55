"""RMSNorm's torch reference: y = x / sqrt(mean(x^2) + eps) * weight over the last dim, statistics in
float32 (float64 stays float64). `tessera.kernels.dispatch` chooses between it, torch's fused
`F.rms_norm` and the Triton kernel."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc_dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(acc_dtype)).to(x.dtype)
