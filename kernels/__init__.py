"""Fused attention and RMSNorm: Triton kernels beside their torch references, dispatched in one place."""

from .attention import attention_backward_reference, attention_reference, naive_attention
from .dispatch import flash_attention, flash_attention_backward, rms_norm
from .rmsnorm import rms_norm_reference

__all__ = ["flash_attention", "flash_attention_backward", "attention_reference", "attention_backward_reference",
           "naive_attention", "rms_norm", "rms_norm_reference"]
