"""SwiGLU's activation in Triton, h = silu(gate) * up, forward and backward in one kernel each, fp32 inside.

Eager torch runs it as three kernels forward (silu, its product; 5 elements moved per element of h) and four
backward (the product's two gradients, silu's backward: 9), and keeps silu(gate) for the backward, one more
activation the size of h. Here the forward reads gate and up and writes h (3), the backward reads the gradient,
gate and up and writes both gradients (5), and nothing more is kept. One program per row of the last dim, in
chunks: beside h the forward writes the row's max |h| as stored (a NaN if the row holds one), the amax an FP8
cast of h (the down projection's input) would read h again for (kernels/fp8_amax.py). Custom ops with fake
implementations, like the RMSNorm's; kernels/dispatch.py's `swiglu` takes them on CUDA in eager steps (compiled,
inductor fuses the activation into its neighbours, the FP8 cast included).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import check_swiglu_inputs
from .fp8_amax import attach_row_amax
from .triton_compat import INTERPRET  # importing it also fixes triton < 3.8's interpreter

CHUNK = 1024  # the elements of a row one step of a program's loop takes


@triton.jit
def _swiglu_fwd_kernel(G, U, H, AMAX, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    poison = tl.zeros([BLOCK], tl.float32)  # NaN from a row's first NaN on (NaN + x is NaN), else 0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(G + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(H.dtype.element_ty)
        tl.store(H + row * N + cols, h, mask=mask)
        magnitude = tl.where(mask, tl.abs(h.to(tl.float32)), 0.0)
        nan = magnitude != magnitude
        poison += tl.where(nan, magnitude, 0.0)
        amax = tl.maximum(amax, tl.where(nan, 0.0, magnitude))
    # tl.maximum drops NaNs; torch's amax keeps them (a NaN scale, as torchao's cast of h would have)
    tl.store(AMAX + row, tl.max(amax, 0) + tl.sum(poison, 0))


@triton.jit
def _swiglu_bwd_kernel(DH, G, U, DG, DU, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        dh = tl.load(DH + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(DU + row * N + cols, (dh * g * s).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + row * N + cols, (dh * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _warps() -> int:
    return 1 if INTERPRET else 4


@torch.library.custom_op("tessera::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(silu(gate) * up, max |h| of each row of the last dim in fp32)."""
    m, n = math.prod(gate.shape[:-1]), gate.shape[-1]
    if not (m and n):  # nothing to compute: an empty output, and rows of no elements have amax 0
        return gate.new_empty(gate.shape), torch.zeros(m, device=gate.device, dtype=torch.float32)
    g, u = _rows(gate), _rows(up)
    h = torch.empty((m, n), device=gate.device, dtype=gate.dtype)
    amax = torch.empty(m, device=gate.device, dtype=torch.float32)
    _swiglu_fwd_kernel[(m,)](g, u, h, amax, n, BLOCK=min(CHUNK, triton.next_power_of_2(n)), num_warps=_warps())
    return h.view(gate.shape), amax


@swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(math.prod(gate.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("tessera::swiglu_bwd", mutates_args=())
def swiglu_bwd(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if not gate.numel():
        return gate.new_empty(gate.shape), up.new_empty(up.shape)
    d, g, u = _rows(dh), _rows(gate), _rows(up)
    m, n = g.shape
    dg, du = torch.empty_like(g), torch.empty_like(u)
    if m and n:
        _swiglu_bwd_kernel[(m,)](d, g, u, dg, du, n, BLOCK=min(CHUNK, triton.next_power_of_2(n)), num_warps=_warps())
    return dg.view(gate.shape), du.view(up.shape)


@swiglu_bwd.register_fake
def _(dh, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.mark_non_differentiable(output[1])  # the row amaxes: a statistic, no gradient


def _backward(ctx, dh, _damax):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dh.contiguous(), gate, up)


swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up by the fused kernels (module doc), differentiable in both; the output carries its row
    amaxes for an FP8 cast (eager only)."""
    check_swiglu_inputs(gate, up)
    if not gate.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton SwiGLU kernel needs CUDA tensors (got {gate.device}); set TRITON_INTERPRET=1 before "
            f"importing to run it on CPU, or use backend='torch'"
        )
    h, amax = swiglu_fwd(gate, up)
    if not torch.compiler.is_compiling():
        attach_row_amax(h, amax.view(*gate.shape[:-1], 1))
    return h
