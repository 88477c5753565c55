"""The loss, outside the model: next-token cross-entropy as a SUM over valid targets, and their count.

The trainer divides the sum by the number of valid targets in the whole global batch (counted on the
host before the step, over every dp and cp rank's rows), so every layout optimizes the same objective
even when targets are masked (-100) unevenly across ranks. A mean of per-rank means would weight a
rank's few valid targets as much as another's many; a sum does not.

With tensor parallel the logits stay split over the vocabulary: each rank holds columns
[vocab_start, vocab_start + V/tp) and the softmax statistics are all-reduced over tp (two (N,) vectors
and the target logits); full logits never meet.

    op                            forward                         backward
    vocab-parallel cross-entropy  all-reduce max, sum-exp, target   local softmax - onehot (no comm)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh

from .tensor import all_reduce_tp, shard_range

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(Function):
    """Per-token cross-entropy from local vocab shards of the logits."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        ctx.input_dtype = logits.dtype
        logits = logits.float() if logits.element_size() < 4 else logits  # fp32 statistics at least
        n, v_local = logits.shape
        local_max = logits.amax(dim=-1) if v_local else logits.new_full((n,), float("-inf"))
        global_max = all_reduce_tp(local_max, group, dist.ReduceOp.MAX)
        exp = torch.exp(logits - global_max.unsqueeze(-1))
        sum_exp = all_reduce_tp(exp.sum(dim=-1), group)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < v_local) & (targets != ignore_index)
        idx = local_target.clamp(0, max(v_local - 1, 0))
        picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) if v_local else logits.new_zeros(n)
        target_logit = all_reduce_tp(torch.where(mine, picked - global_max, torch.zeros_like(picked)), group)
        valid = targets != ignore_index
        loss = torch.where(valid, torch.log(sum_exp) - target_logit, torch.zeros_like(sum_exp))
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[1]:
            grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad *= (grad_loss * valid.to(grad.dtype)).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy_sum(
    local_logits: Tensor, targets: Tensor, vocab_start: int, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """(sum of per-token cross-entropy, count) over non-ignored targets. local_logits (..., V_local) hold
    vocab columns [vocab_start, vocab_start + V_local) of the full logits; targets (...) are global ids."""
    flat = targets.reshape(-1)
    per_token = _VocabParallelCrossEntropy.apply(
        local_logits.reshape(flat.numel(), local_logits.shape[-1]), flat, vocab_start, group, ignore_index
    )
    return per_token.sum(), (flat != ignore_index).sum()


def vocab_parallel_cross_entropy(
    local_logits: Tensor, targets: Tensor, vocab_start: int, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """The mean over this rank's non-ignored targets (for checks; training uses the sum)."""
    total, count = vocab_parallel_cross_entropy_sum(local_logits, targets, vocab_start, group, ignore_index)
    return total / count.clamp(min=1)


def cross_entropy_sum(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """One process (full vocabulary): (sum of cross-entropy over valid targets in fp32, their count)."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(flat.numel(), -1).float(), flat, ignore_index=ignore_index, reduction="sum")
    return total, (flat != ignore_index).sum()


class CrossEntropySum:
    """The loss function of a model on a layout: (logits, targets) -> (sum, count of valid targets).
    With tp_mesh the logits are this rank's vocabulary shard."""

    def __init__(self, vocab_size: int, tp_mesh: DeviceMesh | None = None):
        self.vocab_size = vocab_size
        self.group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.vocab_start = shard_range(vocab_size, tp_mesh.get_local_rank(), tp_mesh.size())[0] if self.group else 0

    def __call__(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if self.group is None:
            return cross_entropy_sum(logits, targets)
        return vocab_parallel_cross_entropy_sum(logits, targets, self.vocab_start, self.group)


def count_valid(targets: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Valid targets in a (global) batch: the denominator of every rank's loss."""
    return int((targets != ignore_index).sum())
