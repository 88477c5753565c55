"""Tensor parallel (Megatron style) with sequence parallel, over the "tp" submesh.

Parameters are DTensors on the tp mesh (Shard for split weights, Replicate for norms), so FSDP2, DCP
and the grad-norm clipping see their global shapes; compute runs on `to_local()` tensors, and every
collective is one of the small autograd Functions below, so what runs where is visible:

    op                      forward                     backward
    copy_to_tp              identity                    all-reduce
    reduce_from_tp          all-reduce                  identity
    gather_sequence         all-gather (seq dim)        reduce-scatter (seq dim)
    scatter_sequence        reduce-scatter (seq dim)    all-gather (seq dim)

A block is [input comm] -> column-parallel layers -> local math -> row-parallel layer [output comm].
Without sequence parallel the input comm is copy_to_tp and the output comm an all-reduce; with it the
residual stream and norms hold S/tp tokens, the input comm all-gathers and the output reduce-scatters.
Split weights follow torch.chunk along the split dim, so a vocab that tp does not divide is split into
ceil(V/tp) rows per rank (padding to a multiple of tp, never materialized) and keeps its logical shape,
which lets checkpoints move between tp degrees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from tessera.kernels import rms_norm
from tessera.topology.shapes import check_tensor_parallel  # re-exported: the rule lives with the shapes

from .comm import collective

__all__ = ["check_tensor_parallel", "shard_range", "all_reduce_tp", "full_tensor"]

SEQ_DIM = 1  # activations are (batch, seq, features)

# torch 2.13 renamed the flat-tensor collectives; 2.11 (the GPU machines) only has the old names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- collectives with autograd
def all_reduce_tp(x: Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    x = x.contiguous().clone()
    with collective("all_reduce", "tp", group):
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    with collective("all_gather", "tp", group):
        _all_gather_flat(out, x, group=group)
    # contiguous once here: a strided view would make every column-parallel matmul that reads it save
    # its own contiguous copy for backward (three for q, k and v)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % size:
        raise ValueError(
            f"cannot reduce-scatter {x.shape[0]} positions over {size} tp ranks; the sequence must divide tp"
        )
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    with collective("reduce_scatter", "tp", group):
        _reduce_scatter_flat(out, x, group=group)
    return out.movedim(0, dim)


class _CopyToTP(Function):
    """Identity forward, all-reduce of the gradient backward; `in_fp32`: the partial sums are added in
    fp32 and rounded to the gradient's dtype once (a replicated weight's gradient: the precision policy
    reduces gradients in fp32, as the one-process matmul over all tokens rounds its fp32 sum once)."""

    @staticmethod
    def forward(ctx, x, group, in_fp32=False):
        ctx.group, ctx.in_fp32 = group, in_fp32
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.in_fp32:
            return all_reduce_tp(grad.float(), ctx.group).to(grad.dtype), None, None
        return all_reduce_tp(grad, ctx.group), None, None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_tp(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ScatterSequence(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _CopyToTP.apply(x, group)


def copy_weight_to_tp(weight: Tensor, group: dist.ProcessGroup) -> Tensor:
    """A replicated weight (norm, bias, replicated kv heads) read by every tp rank's tokens or heads."""
    return _CopyToTP.apply(weight, group, True)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _GatherSequence.apply(x, group)


def scatter_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ScatterSequence.apply(x, group)


class BlockInput(nn.Module):
    """The one collective in front of a block's column-parallel layers."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)

    def extra_repr(self) -> str:
        return "all-gather sequence (reduce-scatter grad)" if self.sequence_parallel else "copy (all-reduce grad)"


# ----------------------------------------------------------------------------- layers
def shard_range(full: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank's piece when `full` rows are split as torch.chunk / DTensor Shard split them."""
    chunk = -(-full // size)
    # sym_min: a simulated world's rank is one int per simulated rank, which Python's min cannot compare
    start = torch.sym_min(rank * chunk, full)
    return start, torch.sym_min(start + chunk, full)


def _shard_param(weight: Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """An nn.Parameter of the DTensor (modules register it as a parameter)."""
    # every rank holds the same one-process weight, so each slices its own piece: no communication
    param = nn.Parameter(distribute_tensor(weight.detach(), mesh, [placement], src_data_rank=None))
    # nn.Parameter of a tensor subclass keeps the subclass (marked as a parameter); torch's stubs say Parameter
    if not isinstance(param, DTensor):
        raise TypeError(f"nn.Parameter of a DTensor is a {type(param).__name__}")
    return param


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local.T (+ b_local) with W, and the optional bias, split on the output features
    (dim 0). The input must already be replicated over tp (the caller's BlockInput), unless `input_comm`
    is given. The plan style that builds it is ColwiseParallel (parallel/tp_plan.py)."""

    def __init__(
        self, weight: Tensor, tp_mesh: DeviceMesh, input_comm: nn.Module | None = None, bias: Tensor | None = None
    ):
        super().__init__()
        self.weight = _shard_param(weight, tp_mesh, Shard(0))
        self.bias = None if bias is None else _shard_param(bias, tp_mesh, Shard(0))
        self.input_comm = input_comm if input_comm is not None else nn.Identity()
        self.matmul: Callable[[Tensor, Tensor], Tensor] = F.linear  # the local matmul (FP8: parallel/fp8.py)

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(self.input_comm(x), self.weight.to_local())
        return y if self.bias is None else y + self.bias.to_local()


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local @ W_local.T (+ b) with W split on its input features (dim 1); the sum is an
    all-reduce, or a reduce-scatter onto sequence shards under sequence parallel. The optional bias is
    replicated and added once, after the sum; under sequence parallel each rank adds it to its own tokens, so
    its gradient is all-reduced. The plan style that builds it is RowwiseParallel (parallel/tp_plan.py)."""

    def __init__(self, weight: Tensor, tp_mesh: DeviceMesh, sequence_parallel: bool, bias: Tensor | None = None):
        super().__init__()
        self.weight = _shard_param(weight, tp_mesh, Shard(1))
        self.bias = None if bias is None else _shard_param(bias, tp_mesh, Replicate())
        self.group, self.sequence_parallel = tp_mesh.get_group(), sequence_parallel
        self.matmul: Callable[[Tensor, Tensor], Tensor] = F.linear  # the local matmul (FP8: parallel/fp8.py)

    def forward(self, x: Tensor) -> Tensor:
        partial = self.matmul(x, self.weight.to_local())
        y = scatter_sequence(partial, self.group) if self.sequence_parallel else reduce_from_tp(partial, self.group)
        if self.bias is None:
            return y
        b = self.bias.to_local()
        return y + (copy_weight_to_tp(b, self.group) if self.sequence_parallel else b)


class ReplicatedHeadsLinear(nn.Module):
    """K or V projection when tp exceeds the kv heads: the weight is replicated over tp and each rank
    uses the rows of the one kv head its query heads read. Gradients of the replicated weight are
    summed over tp (copy_to_tp on the weight), so every replica takes the same optimizer step."""

    def __init__(self, weight: Tensor, tp_mesh: DeviceMesh, head: int, head_dim: int):
        super().__init__()
        self.weight = _shard_param(weight, tp_mesh, Replicate())
        self.group, self.rows = tp_mesh.get_group(), slice(head * head_dim, (head + 1) * head_dim)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, copy_weight_to_tp(self.weight.to_local(), self.group)[self.rows])


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding split over tp; each rank looks up the ids in its range (others read as 0)
    and the partial embeddings are summed: all-reduce, or reduce-scatter onto sequence shards."""

    def __init__(self, weight: Tensor, tp_mesh: DeviceMesh, sequence_parallel: bool):
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.weight = _shard_param(weight, tp_mesh, Shard(0))
        self.group, self.sequence_parallel = tp_mesh.get_group(), sequence_parallel
        self.vocab_start, self.vocab_stop = shard_range(self.vocab_size, tp_mesh.get_local_rank(), tp_mesh.size())

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_stop)
        w = self.weight.to_local()
        if w.shape[0] == 0:  # this rank holds no rows (tiny vocab, large tp): contribute zeros
            partial = w.new_zeros(tokens.shape + (w.shape[1],)) + 0 * w.sum()
        else:
            partial = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        if not self.sequence_parallel:
            return reduce_from_tp(partial, self.group)
        # the scatter's result is a view of its (seq, batch, dim) buffer. Returned from an FSDP2 unit, an
        # in-place op on it would skip FSDP2's pre-backward hook (FSDP2 warns so, once per rank); one copy per
        # step makes it a tensor of its own
        return scatter_sequence(partial, self.group).clone()


class TPRMSNorm(nn.Module):
    """RMSNorm with its weight replicated over tp. Under sequence parallel each rank normalizes its own
    tokens, so the weight's gradient is a partial sum: copy_to_tp on the weight all-reduces it."""

    def __init__(self, weight: Tensor, eps: float, tp_mesh: DeviceMesh, sequence_parallel: bool):
        super().__init__()
        self.weight = _shard_param(weight, tp_mesh, Replicate())
        self.eps, self.group, self.sequence_parallel = eps, tp_mesh.get_group(), sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.to_local()
        return rms_norm(x, copy_weight_to_tp(w, self.group) if self.sequence_parallel else w, self.eps)


# ----------------------------------------------------------------------------- validation and application
def full_tensor(x: Tensor) -> Tensor:
    """The global value of a (possibly DTensor) parameter or gradient."""
    return x.full_tensor() if isinstance(x, DTensor) else x
