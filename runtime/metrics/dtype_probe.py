"""What the matmuls actually ran in: a step's matrix-multiply FLOPs by dtype, read from the tensors.

`MatmulDtypes` is a TorchDispatchMode. Every matrix multiply reaches the dispatcher as an aten op below
autograd (forward and backward alike: mm, addmm, bmm, baddbmm, grouped mm, the fused attention kernels
and tessera's own Triton attention op), so counting there sees the dtype of the operands the hardware
was given, whatever the config said. The trainer runs it over rank 0's first step (one Python call per
operator, for one step only; rank 0 writes the records), and the run's records report the dtype that
carried most of the matmul FLOPs (`compute_dtype`) with the whole breakdown (`matmul_flops_by_dtype`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
    # FP8 matmuls (torch._scaled_mm's operands) by their kind, e4m3 and e5m2 alike
    **{getattr(torch, n): "float8" for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")},
}


def _name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _dtype_name(t: torch.Tensor) -> str:
    """An operand's dtype; torchao's Float8TrainingTensor (whose dtype is its original one) by the FP8 data it
    holds: "float8", or "float8_emulated" when torchao emulates the matmul (fp32 of the dequantized values)."""
    data = getattr(t, "_data", None)
    if isinstance(data, torch.Tensor) and _DTYPE_NAMES.get(data.dtype) == "float8":
        config = getattr(t, "_linear_mm_config", None)
        return "float8_emulated" if config is not None and config.output.emulate else "float8"
    return _name(t.dtype)


def _mm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """2 m n k for a (…, m, k) @ (…, k, n), batch dims included."""
    batch = math.prod(a.shape[:-2]) if a.dim() > 2 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _attention_flops(q: torch.Tensor, k: torch.Tensor, backward: bool) -> int:
    """QK^T and PV of a (B, H, Sq, D) x (B, H, Sk, D) attention (dense count; causal halves it in the
    kernel, which does not change the dtype): 4 B H Sq Sk D forward, 2.5x that in backward."""
    b, h, sq, d = q.shape
    flops = 4 * b * h * sq * k.shape[-2] * d
    return int(flops * 2.5) if backward else flops


# attention kernels by operator name (every overload), each with whether it is a backward; looked up by
# name at each call, so ops registered after the probe starts (tessera's Triton attention is imported at
# its first call, inside step 1) count too
_ATTENTION = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": False,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": True,
    "aten::_scaled_dot_product_flash_attention": False,
    "aten::_scaled_dot_product_flash_attention_backward": True,
    "aten::_scaled_dot_product_efficient_attention": False,
    "aten::_scaled_dot_product_efficient_attention_backward": True,
    "aten::_scaled_dot_product_cudnn_attention": False,
    "aten::_scaled_dot_product_cudnn_attention_backward": True,
    "tessera::flash_attention_fwd": False,
    "tessera::flash_attention_bwd": True,
}
# matmuls by operator name, every overload (mm.out, addmm_ ...): (a, b) at these argument positions
_MATMULS = {
    "aten::mm": 0,
    "aten::bmm": 0,
    "aten::addmm": 1,
    "aten::addmm_": 1,
    "aten::baddbmm": 1,
    "aten::baddbmm_": 1,
    "aten::_grouped_mm": 0,
    "aten::_scaled_mm": 0,
}


# the report of a rank that does not measure (only rank 0 does: it writes the records)
NOT_MEASURED: dict[str, Any] = {"compute_dtype": None, "matmul_flops_by_dtype": None, "matmul_calls_by_dtype": None}


class MatmulDtypes(TorchDispatchMode):
    """Within `with MatmulDtypes() as m:`, m.flops[dtype name] accumulates the matmul FLOPs run in that
    dtype and m.calls[dtype name] their count."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def _count(self, dtype: str, flops: int) -> None:
        self.flops[dtype] += int(flops)
        self.calls[dtype] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        try:
            if name in _MATMULS:
                i = _MATMULS[name]
                a, b = _local(args[i]), _local(args[i + 1])
                if name == "aten::_grouped_mm":  # (tokens, k) x (groups, k, n): each token meets one group
                    self._count(_dtype_name(a), 2 * a.shape[-2 if a.dim() > 1 else 0] * a.shape[-1] * b.shape[-1])
                else:
                    self._count(_dtype_name(a), _mm_flops(a, b))
            elif name in _ATTENTION:
                backward = _ATTENTION[name]  # a backward's first argument is the output gradient
                q, k = _local(args[1 if backward else 0]), _local(args[2 if backward else 1])
                self._count(_name(q.dtype), _attention_flops(q, k, backward))
        except (IndexError, AttributeError, TypeError):  # an overload with other arguments: count the call only
            pass
        return func(*args, **kwargs)

    def report(self) -> dict[str, Any]:
        """{"compute_dtype": the dtype with the most matmul FLOPs (None if none ran), "matmul_flops_by_dtype",
        "matmul_calls_by_dtype"}."""
        flops = dict(self.flops)
        top = max(flops, key=flops.__getitem__) if flops else None
        return {"compute_dtype": top, "matmul_flops_by_dtype": flops, "matmul_calls_by_dtype": dict(self.calls)}
