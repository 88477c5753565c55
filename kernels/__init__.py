"""Fused attention and RMSNorm: Triton kernels beside their torch references, dispatched in one place."""

from .attention_reference import (
    apply_sinks,
    attention_backward_reference,
    attention_reference,
    document_ids,
    naive_attention,
)
from .dispatch import default_backend, flash_attention, flash_attention_backward, rms_norm, set_default_backend
from .rmsnorm import rms_norm_reference

__all__ = [
    "flash_attention",
    "flash_attention_backward",
    "apply_sinks",
    "attention_reference",
    "attention_backward_reference",
    "naive_attention",
    "document_ids",
    "rms_norm",
    "rms_norm_reference",
    "set_default_backend",
    "default_backend",
]
