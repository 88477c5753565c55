"""An FP8 matmul operand's scaled cast in one pass: y = fp8(clamp(x * scale, -max, max)), rounded to nearest,
ties to even, the scale one for the tensor or one per row or column (tensorwise and rowwise scaling).

torchao's eager cast (float8_training_tensor._ToFloat8ConstrFunc with float8_utils.to_fp8_saturated) runs it as
four kernels with fp32 intermediates, the upcast, the multiply, the clamp and the convert: 27 bytes moved an
element of a bf16 input, where this kernel reads 2 and writes 1 (on the H200's FP8 eager step the casts took
57.9 ms, 14.5%). Under torch.compile inductor fuses torchao's cast itself, so parallel/fp8.py takes this kernel
in eager steps only.

The rounding is done in fp32 arithmetic before the store, so the store converts a value fp8 holds exactly: the
same bits on a GPU, whose conversion rounds to nearest even, and in Triton's CPU interpreter, whose conversion
rounds ties away from zero. Each value v is divided by its fp8 quantum q (a power of two: 2^(e - mantissa bits),
e its exponent, at least the format's least normal one), rounded to an integer by the 1.5 x 2^23 trick (fp32
addition rounds to nearest even, and |v / q| < 2^(mantissa bits + 1) is far below 2^22), and multiplied back; a
zero keeps the sign of v. tests/test_fp8_cast.py holds it to torch's own eager cast bit for bit and to a float64
definition (the nearest of the format's 256 values, ties to the even one), and a NaN to torch's NaN.

The output's memory order is the one torch._scaled_mm takes the operand in (`layout`): torchao's mm makes its first
operand row-major and its second column-major by a copy of the FP8 data (float8_ops.preprocess_addmm), and three of
a linear's six operands reach it in the other order (the weight for the input gradient, the output gradient and the
input for the weight gradient): on the H200's eager FP8 step those copies were 336 strided kernels, 149 ms of its
667. Written in that order by the cast itself, they are not made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_compat import INTERPRET  # noqa: F401  (importing it also fixes triton < 3.8's interpreter)

# (mantissa bits, least normal exponent, largest finite value) of each FP8 format torchao trains in
FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}
BLOCK_ROWS, BLOCK_COLS = 16, 256
TRANSPOSING_BLOCK = 64  # a square tile where the output's contiguous dim is not the input's: both sides coalesce
LAYOUTS = ("row", "col")
# 1.5 x 2^23: v + it - it rounds v to an integer, ties to even, for |v| < 2^22; a constexpr, as compiled Triton
# reads no other global (the interpreter does, so only a GPU caught it: triton 3.6 on an H200, 2026-12-04)
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _scaled_cast_kernel(
    X, S, Y, M, N, stride_xm, stride_xn, stride_sm, stride_sn, stride_ym, stride_yn,
    MANTISSA: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # 64-bit: 2^31 elements and more
    # 64-bit too: a column-major side strides M a column, and cols x M passes 2^31 at large M x N
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    inside = (rows < M) & (cols < N)
    x = tl.load(X + rows * stride_xm + cols * stride_xn, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(S + rows * stride_sm + cols * stride_sn, mask=inside, other=1.0)
    p = x * s
    v = tl.minimum(tl.maximum(p, -FMAX), FMAX)  # (a NaN may come out a number here: its bits are set below)
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    q = ((e - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    r = ((v / q + _ROUNDER) - _ROUNDER) * q
    y = tl.where(r == 0.0, v * 0.0, r)  # -0.0 stays negative, as torch's convert keeps it
    bits = y.to(Y.dtype.element_ty).to(tl.uint8, bitcast=True)
    # a NaN is torch's NaN of its sign (0x7F, 0xFF in both formats): the interpreter's convert gives a number
    negative = p.to(tl.int32, bitcast=True) < 0
    bits = tl.where(p != p, tl.where(negative, 0xFF, 0x7F).to(tl.uint8), bits)
    tl.store(Y + rows * stride_ym + cols * stride_yn, bits.to(Y.dtype.element_ty, bitcast=True), mask=inside)


def scaled_cast_fp8(
    x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, layout: str | None = None
) -> Tensor:
    """x * scale in `dtype`, saturated at its largest finite value, rounded to nearest even; `scale` (fp32)
    broadcasts to x's last two dims: one element, one per row (..., M, 1) or one per column (1, N). The bits
    torchao's eager `to_fp8_saturated(x.to(float32) * scale, dtype)` gives (module doc). `layout` ("row" or
    "col", a 2-D x only): the output's memory order, whatever x's is; None: x's own (a 2-D column-major x's
    column-major, else row-major), the order torchao's elementwise cast keeps."""
    if dtype not in FORMATS:
        raise ValueError(f"scaled_cast_fp8: dtype {dtype} is not one of {', '.join(map(str, FORMATS))}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scaled_cast_fp8: scale is {scale.dtype}; torchao's scales are float32")
    if layout is not None and (layout not in LAYOUTS or x.dim() != 2):
        raise ValueError(f"scaled_cast_fp8: layout={layout!r} needs a 2-D x (got {x.dim()}-D) and one of {LAYOUTS}")
    n = x.shape[-1] if x.dim() else 1
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    if 1 not in x2.stride() and x2.numel() > 1:  # neither dim contiguous (a sliced view): one copy first
        x2 = x2.contiguous()
    if layout is None:
        layout = "col" if x.dim() == 2 and x2.stride(0) == 1 and x2.stride(1) != 1 else "row"
    m = x2.shape[0]
    s2 = scale.expand(x.shape).reshape(m, n) if scale.numel() > 1 else scale.reshape(1, 1).expand(m, n)
    # a broadcast scale keeps stride 0 along what it repeats over; a per-row one (..., M, 1) reshapes to (rows, n)
    # with a stride along the rows only
    y = (
        torch.empty((m, n), dtype=dtype, device=x.device)
        if layout == "row"
        else torch.empty((n, m), dtype=dtype, device=x.device).t()
    )
    mantissa, emin, fmax = FORMATS[dtype]
    same_order = (x2.stride(1) == 1) == (layout == "row")
    block_m, block_n = (BLOCK_ROWS, BLOCK_COLS) if same_order else (TRANSPOSING_BLOCK, TRANSPOSING_BLOCK)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_cast_kernel[grid](
        x2, s2, y, m, n, x2.stride(0), x2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), y.stride(1),
        MANTISSA=mantissa, EMIN=emin, FMAX=fmax, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y if x.dim() == 2 else y.reshape(x.shape)
