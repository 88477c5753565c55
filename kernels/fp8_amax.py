"""The amax of a tensor, known from the kernel that wrote it: max |y| over each row of its last dim, which
an FP8 cast of y would otherwise read y once more to find (torchao's cast reduces it first, then scales).
The Triton RMSNorm writes it beside its output (kernels/triton_rmsnorm.py); parallel/fp8.py's eager cast of a
linear layer's input takes it from there: the row amaxes themselves under rowwise scaling, their max under
tensorwise. Held on the tensor itself, so it lives as long as the tensor does, and tied to the tensor's
version: an in-place change voids it. Torch only; nothing here runs under torch.compile (inductor fuses the
casts into their producers itself).
"""

from __future__ import annotations

from torch import Tensor

_ROW_AMAX = "_tessera_row_amax"


def attach_row_amax(t: Tensor, row_amax: Tensor) -> None:
    """Note on `t` the max |t| of each of its rows (shape t.shape[:-1] + (1,), any float dtype: the values
    are t's own magnitudes), computed from t as it now stands."""
    if tuple(row_amax.shape) != (*t.shape[:-1], 1):
        raise ValueError(f"attach_row_amax: row_amax shape {tuple(row_amax.shape)} for a tensor of {tuple(t.shape)}")
    if t.is_inference():  # (torch.inference_mode) no version counter to tie the note to, and no FP8 backward
        return
    setattr(t, _ROW_AMAX, (t._version, row_amax))


def row_amax(t: Tensor) -> Tensor | None:
    """The row amaxes noted on `t` (attach_row_amax), in t's dtype, or None: none noted, or t changed since."""
    held = getattr(t, _ROW_AMAX, None)
    if held is None or t.is_inference() or held[0] != t._version:
        return None
    return held[1].to(t.dtype)
