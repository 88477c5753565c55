"""Fused attention and RMSNorm: Triton kernels beside their torch references, dispatched in one place."""

from .attention import attention_reference, naive_attention
from .dispatch import flash_attention, rms_norm
from .rmsnorm import rms_norm_reference

__all__ = ["flash_attention", "attention_reference", "naive_attention", "rms_norm", "rms_norm_reference"]
