"""Input checks of the kernels, shared by the torch references, the Triton kernels and the dispatcher
(a leaf module: it imports nothing of tessera, so no import circles)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, head_dim); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
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


def check_documents(q: Tensor, k: Tensor, q_docs: Tensor | None, k_docs: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """Document ids: integer (B, Sq) for the queries and (B, Sk) for the keys, non-decreasing along each row
    (packed documents lie back to back; the order is checked where the ids are made, not per call).
    Returns (q_docs, k_docs), or None without documents."""
    if q_docs is None and k_docs is None:
        return None
    if q_docs is None or k_docs is None:
        raise ValueError("document ids need both q_docs and k_docs (or neither)")
    for name, ids, t in (("q_docs", q_docs, q), ("k_docs", k_docs, k)):
        if ids.dim() != 2 or ids.shape[0] != t.shape[0] or ids.shape[1] != t.shape[2]:
            raise ValueError(f"{name} {tuple(ids.shape)} must be (batch, seq) = ({t.shape[0]}, {t.shape[2]})")
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer document ids, not {ids.dtype}")
        if ids.device != t.device:
            raise ValueError(f"{name} is on {ids.device}, the tensors on {t.device}")
    return q_docs, k_docs


def check_rms_norm_inputs(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be 1-D with the size of x's last dim ({x.shape[-1]})")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device; got {x.device} and {weight.device}")
