"""Fused RMSNorm in Triton: forward and backward, fp32 statistics.

Forward: one program per row reads the row once, computes rstd = 1/sqrt(mean(x^2) + eps) in fp32, writes
y = x * rstd * w and saves rstd, and writes max |y| of the row as stored (a NaN if the row holds one): the amax
an FP8 cast of y would read y again for (kernels/fp8_amax.py), which an eager FP8 step's q/k/v or gate/up casts
take instead. Backward: each program takes a strided set of rows, writes
dx = rstd * (w*dy - xhat * mean(w*dy*xhat)) for each, and accumulates its partial dw = sum(dy * xhat)
in fp32; the partials (one row per program) are summed at the end. Works on any (..., N) tensor, e.g.
the local shard of a sequence-parallel activation. Custom ops with fake implementations, like attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import check_rms_norm_inputs
from .fp8_amax import attach_row_amax
from .triton_compat import INTERPRET  # importing it also fixes triton < 3.8's interpreter

MAX_FUSED_WIDTH = 65536  # one row must fit one program's registers/shared memory


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, AMAX, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row x stride passes 2^31 at 262,144 rows of 8192
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=mask)
    tl.store(RSTD + row, rstd)
    magnitude = tl.where(mask, tl.abs(y.to(tl.float32)), 0.0)
    # tl.max drops NaNs; torch's amax keeps them (and so a NaN scale, as torchao's cast of y would have): a row
    # holding one stores its sum, a NaN
    nans = tl.sum((magnitude != magnitude).to(tl.int32), 0)
    tl.store(AMAX + row, tl.where(nans > 0, tl.sum(magnitude, 0), tl.max(magnitude, 0)))


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, M, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for row in range(pid, M, programs):  # 64-bit rows, as in the forward: the bounds promote to pid's type
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, 0) / N
        dx = (wdy - xhat * c) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)


def _rows(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block(n: int) -> int:
    if n > MAX_FUSED_WIDTH:
        raise ValueError(
            f"rows of {n} features exceed the fused RMSNorm limit of {MAX_FUSED_WIDTH}; use backend='torch'"
        )
    return triton.next_power_of_2(n)


def _warps(block: int) -> int:
    return 1 if INTERPRET else min(max(block // 256, 1), 16)


@torch.library.custom_op("tessera::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, rstd, max |y| of each row), the last two fp32 of one element a row."""
    x2 = _rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    amax = torch.empty(M, device=x.device, dtype=torch.float32)
    block = _block(N)
    if M:
        _rms_norm_fwd_kernel[(M,)](
            x2, weight.contiguous(), y, rstd, amax, x2.stride(0), y.stride(0), N, eps, BLOCK=block,
            num_warps=_warps(block),
        )  # fmt: skip
    return y.view(x.shape), rstd, amax


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    # contiguous, as the kernel writes y (empty_like would copy a non-contiguous x's strides)
    rows = x.numel() // max(x.shape[-1], 1)
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tessera::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    x2, dy2 = _rows(x), _rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if INTERPRET or not x.is_cuda:
        programs = max(1, min(M, 4))
    else:
        programs = max(1, min(M, torch.cuda.get_device_properties(x.device).multi_processor_count * 4))
    partial = torch.zeros((programs, N), device=x.device, dtype=torch.float32)
    block = _block(N)
    if M:
        _rms_norm_bwd_kernel[(programs,)](
            dy2,
            x2,
            weight.contiguous(),
            rstd,
            dx,
            partial,
            dy2.stride(0),
            x2.stride(0),
            dx.stride(0),
            M,
            N,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)  # contiguous, as the kernel writes


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1], output[2])  # rstd and the row amaxes: statistics, no gradient


def _backward(ctx, dy, _drstd, _damax):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    check_rms_norm_inputs(x, weight)
    if not x.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton RMSNorm kernel needs CUDA tensors (got {x.device}); set TRITON_INTERPRET=1 before "
            f"importing to run it on CPU, or use backend='torch'"
        )
    if x.dtype != weight.dtype:
        weight = weight.to(x.dtype)
    y, _, amax = rms_norm_fwd(x, weight, float(eps))
    if not torch.compiler.is_compiling():  # compiled, inductor fuses the casts into their producers itself
        attach_row_amax(y, amax.view(*x.shape[:-1], 1))
    return y
