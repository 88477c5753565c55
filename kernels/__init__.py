"""Fused attention and RMSNorm: Triton kernels beside their torch references, dispatched by device."""

from .attention import attention_reference, flash_attention, naive_attention
from .rmsnorm import rms_norm, rms_norm_reference

__all__ = ["flash_attention", "attention_reference", "naive_attention", "rms_norm", "rms_norm_reference"]
