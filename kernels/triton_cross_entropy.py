"""The chunked loss's softmax in Triton: row statistics, then the gradient written over the logits.

The chunked cross-entropy (parallel/loss.py) holds one chunk of logits (rows x V_local, in the compute dtype)
at a time. In torch it upcasts them to fp32 and runs max, subtract, exp, sum, divide, scatter, multiply and
the cast back as separate passes over the chunk: ~14 fp32 reads and writes per logit (on one H200, 1b preset,
~75 ms of a 585 ms step). Two kernels do the same work in three bf16 passes:

    cross_entropy_row_stats    one program per row reads the row once: its max m and sum(exp(x - m)) in
                               fp32, online (each lane keeps its own running max and rescales its sum)
    cross_entropy_grad_        one program per (row, block of columns): (exp(x - M) / S - onehot) * scale,
                               written over the logits in their dtype, from the row's global max M and
                               sum-exp S (all-reduced over tp between the two kernels by the caller)

fp32 arithmetic on the same bf16 logits as the torch path: equal up to float reassociation of the sums.
Custom ops with fake implementations, like the attention and RMSNorm kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_compat import INTERPRET  # importing it also fixes triton < 3.8's interpreter

STATS_BLOCK = 2048  # columns a stats program reads per step of its loop over the row
GRAD_BLOCK = 4096  # columns one gradient program writes


@triton.jit
def _row_stats_kernel(X, ROW_MAX, ROW_SUM, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_x
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        # a lane that has seen only padding subtracts 0, not -inf: exp(-inf) = 0 keeps its sum 0 (not nan)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        running_max = new_max
    row_max = tl.max(running_max, 0)  # finite: every row has V >= 1 real columns
    tl.store(ROW_MAX + row, row_max)
    tl.store(ROW_SUM + row, tl.sum(running_sum * tl.exp(running_max - row_max), 0))


@triton.jit
def _grad_kernel(X, TARGET, SCALE, ROW_MAX, ROW_SUM, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    ptr = X + row.to(tl.int64) * stride_x + cols
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    softmax = tl.exp(x - tl.load(ROW_MAX + row)) / tl.load(ROW_SUM + row)
    grad = tl.where(cols == tl.load(TARGET + row), softmax - 1.0, softmax) * tl.load(SCALE + row)
    tl.store(ptr, grad.to(X.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 1 if INTERPRET else 8


def _rows_contiguous(logits: Tensor) -> None:
    if logits.dim() != 2 or (logits.numel() and logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits of shape {tuple(logits.shape)}, strides {logits.stride()}: need (rows, V) rows")


@torch.library.custom_op("tessera::cross_entropy_row_stats", mutates_args=())
def cross_entropy_row_stats(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(max over each row, sum over the row of exp(x - that max)), fp32, of logits (rows, V) with V >= 1."""
    _rows_contiguous(logits)
    rows, vocab = logits.shape
    row_max = torch.empty(rows, device=logits.device, dtype=torch.float32)
    row_sum = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        _row_stats_kernel[(rows,)](
            logits, row_max, row_sum, logits.stride(0), vocab, BLOCK=STATS_BLOCK, num_warps=_warps(STATS_BLOCK)
        )
    return row_max, row_sum


@cross_entropy_row_stats.register_fake
def _(logits):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tessera::cross_entropy_grad_", mutates_args=("logits",))
def cross_entropy_grad_(logits: Tensor, target: Tensor, scale: Tensor, row_max: Tensor, row_sum: Tensor) -> None:
    """Over logits (rows, V), in place: (exp(x - row_max) / row_sum - [column == target]) * scale, per row.
    target (rows,) int64 is the row's target column in this shard (-1: none here); scale, row_max and row_sum
    (rows,) fp32."""
    _rows_contiguous(logits)
    rows, vocab = logits.shape
    if rows and vocab:
        grid = (rows, triton.cdiv(vocab, GRAD_BLOCK))
        _grad_kernel[grid](
            logits, target, scale, row_max, row_sum, logits.stride(0), vocab, BLOCK=GRAD_BLOCK, num_warps=_warps(1)
        )


@cross_entropy_grad_.register_fake
def _(logits, target, scale, row_max, row_sum):
    return None
