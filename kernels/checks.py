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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same shape but for the head dim (batch, kv heads, seq); got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
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


def check_window(window: int | None, causal: bool) -> None:
    """A sliding window: a positive number of tokens, over a causal mask (it looks back from each query)."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window={window!r} must be a whole number of at least 1; use a positive number of tokens or None"
        )
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window looks back from each query)")


def check_sinks(sinks: Tensor | None, q: Tensor) -> None:
    """Attention sinks: one logit per query head, (Hq,) -- this rank's heads under tensor parallel."""
    if sinks is None:
        return
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(
            f"sinks {tuple(sinks.shape)} must be one logit per query head, ({q.shape[1]},); under tensor "
            f"parallel pass this rank's heads' sinks"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}; move them to one device")


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


def check_swiglu_inputs(gate: Tensor, up: Tensor) -> None:
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dim (the features); got 0-d tensors")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must share a dtype and a device; got {gate.dtype} on {gate.device} and {up.dtype} on "
            f"{up.device}"
        )
