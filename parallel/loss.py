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

The memory-lean loss (`--loss chunked`, the default) never materializes the full [tokens x vocab]
logits either. `LinearCrossEntropyHead` takes the output projection's place (same `output.weight`
Parameter, same input collective) and, given targets, runs `linear_cross_entropy_sum`: over chunks of
tokens it computes that chunk's logits h_c @ W_local^T (in the compute dtype of h and W), upcasts them
to fp32, takes the cross-entropy sum (vocab-parallel statistics all-reduced per chunk under tp: the max,
then sum-exp and target logit in one buffer) and, Liger-Kernel style, the gradients right away while the
chunk's softmax is live: dlogits = softmax - onehot, dh_c = dlogits @ W_local, dW += dlogits^T @ h_c
(fp32). Backward only scales the stored dh and dW by the loss's gradient, in place, and hands them over
(out of place when the zero-bubble pipeline runs it twice). Peak memory is one chunk's fp32 logits
(`chunk_tokens`) plus dW, instead of several copies of the full fp32 logits. Under tp, dh is
this rank's partial sum over its vocab shard; the head's input collective (copy_to_tp / gather_sequence)
sums it in backward, as for the column-parallel output layer.

    op                            forward (per chunk)               backward
    chunked linear cross-entropy  all-reduce max; sum-exp + target  scale stored dh, dW (no comm)
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from tessera.kernels.dispatch import cross_entropy_grad_, cross_entropy_row_stats, fused_cross_entropy
from tessera.models.spec import spec_of
from tessera.topology.shapes import chunk_tokens

from .tensor import ColumnParallelLinear, all_reduce_tp, shard_range

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
        self.group: dist.ProcessGroup | None = None
        self.vocab_start = 0
        if tp_mesh is not None and tp_mesh.size() > 1:
            self.group = tp_mesh.get_group()
            self.vocab_start = shard_range(vocab_size, tp_mesh.get_local_rank(), tp_mesh.size())[0]

    def __call__(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if self.group is None:
            return cross_entropy_sum(logits, targets)
        return vocab_parallel_cross_entropy_sum(logits, targets, self.vocab_start, self.group)

    def model_loss(
        self, model: nn.Module, inputs: Tensor, positions: Tensor | None, targets: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(sum, count) of `model` on one microbatch: through its LinearCrossEntropyHead when parallelize
        installed one (--loss chunked: no full logits), else this loss on the logits it returns."""
        if has_loss_head(model):
            return model(inputs, positions, targets=targets)
        logits = model(inputs, positions)
        with record_function("tessera: loss"):  # named in profiles (runtime/metrics/step_profile.py)
            return self(logits, targets)


def count_valid(targets: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Valid targets in a (global) batch: the denominator of every rank's loss."""
    return int((targets != ignore_index).sum())


# ----------------------------------------------------------------------------- the chunked (fused) loss
LOSS_KINDS = ("chunked", "logits")
# the chunk rule is plain data the planner also reads: topology/shapes.py (default_chunk_elements, chunk_tokens)


def check_loss(kind: str) -> str:
    """`kind` if it names a loss, else a ValueError naming the value and the fix."""
    if kind not in LOSS_KINDS:
        raise ValueError(
            f"unknown loss={kind!r}; use chunked (fused linear cross-entropy over token chunks, "
            f"never the full logits) or logits (the full logits, then cross-entropy)"
        )
    return kind


def _chunk_targets(
    t_c: Tensor, vocab_start: int, v_local: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A chunk's targets against this rank's vocab shard: (target column in the shard, valid (not ignored),
    mine (valid and in the shard), the column to gather, clamped into the shard, as (rows, 1))."""
    local_target = t_c - vocab_start
    valid = t_c != ignore_index
    mine = (local_target >= 0) & (local_target < v_local) & valid
    return local_target, valid, mine, local_target.clamp(0, max(v_local - 1, 0)).unsqueeze(-1)


def _fused_chunk(
    h_c: Tensor,
    t_c: Tensor,
    weight: Tensor,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    start: int,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    ignore_index: int,
) -> Tensor:
    """One chunk through the Triton kernels: the loss sum of its rows (fp32); its dh rows written into grad_h
    and its dW added into grad_w (when given). The same statistics as the torch passes below, in the same
    order of collectives (the max, then sum-exp and target logit in one buffer), but the logits stay in the
    compute dtype and the gradient is written over them."""
    logits = torch.mm(h_c, weight.t())  # (rows, V_local) in the compute dtype
    v_local = logits.shape[1]
    row_max, row_sum = cross_entropy_row_stats(logits)
    global_max = all_reduce_tp(row_max, group, dist.ReduceOp.MAX) if group is not None else row_max
    local_target, valid, mine, idx = _chunk_targets(t_c, vocab_start, v_local, ignore_index)
    picked = logits.gather(-1, idx).squeeze(-1).float()
    target_logit = torch.where(mine, picked - global_max, torch.zeros_like(picked))
    if group is not None:  # each rank's sum-exp rescaled to the global max, summed with the target logit
        stats = all_reduce_tp(torch.stack([row_sum * torch.exp(row_max - global_max), target_logit]), group)
        sum_exp, target_logit = stats[0], stats[1]
    else:
        sum_exp = row_sum
    loss = torch.where(valid, torch.log(sum_exp) - target_logit, torch.zeros_like(sum_exp)).sum()
    if grad_h is not None or grad_w is not None:
        target = torch.where(mine, local_target, torch.full_like(local_target, -1))
        cross_entropy_grad_(logits, target, valid.float(), global_max, sum_exp)  # logits now hold dlogits
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[start : start + logits.shape[0]])
        if grad_w is not None:
            _accumulate(grad_w, logits.t(), h_c)
    return loss


def _accumulate(grad_w: Tensor, a: Tensor, b: Tensor) -> None:
    """grad_w += a @ b, grad_w fp32 (or a's dtype): on CUDA in one fp32-output GEMM from bf16/fp16 inputs
    where torch has it (addmm's out_dtype), else a matmul in the inputs' dtype added in fp32."""
    if grad_w.dtype == a.dtype:
        grad_w.addmm_(a, b)
    elif _fp32_addmm(a):
        torch.addmm(grad_w, a, b, out_dtype=grad_w.dtype, out=grad_w)
    else:  # a bf16 matmul, accumulated over chunks in fp32
        grad_w.add_(torch.mm(a, b))


_FP32_ADDMM: dict[tuple[str, torch.dtype], bool] = {}


def _fp32_addmm(a: Tensor) -> bool:
    """Whether addmm(fp32, a, b, out_dtype=fp32, out=fp32) runs on a's device and equals the two-step sum
    (checked once per device type and dtype on a small case: torch 2.8 added the op for CUDA only, and
    its in-place `out` handling was fixed later)."""
    key = (a.device.type, a.dtype)
    if key not in _FP32_ADDMM:
        ok = False
        if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
            try:
                gen = torch.Generator(device=a.device).manual_seed(0)
                x = torch.randn(48, 40, device=a.device, generator=gen).to(a.dtype)
                y = torch.randn(40, 24, device=a.device, generator=gen).to(a.dtype)
                acc = torch.randn(48, 24, device=a.device, generator=gen)
                want = acc + x.float() @ y.float()
                torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-3))
            except (RuntimeError, TypeError, ValueError):  # no such overload here, or it refuses these
                ok = False
        _FP32_ADDMM[key] = ok
    return _FP32_ADDMM[key]


class _LinearCrossEntropy(Function):
    """Sum over valid targets of cross-entropy(h @ W_local^T), chunk by chunk; gradients in the forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, group, ignore_index, chunk, need_h, need_w, reusable):
        n, v_local = h.shape[0], weight.shape[0]
        stat = torch.promote_types(h.dtype, torch.float32)  # fp32 statistics at least (fp64 stays fp64)
        total = torch.zeros((), dtype=stat, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=stat, device=weight.device) if need_w else None
        fused = v_local > 0 and fused_cross_entropy(h)  # the softmax in two Triton kernels (CUDA)
        for start in range(0, n, chunk):
            h_c, t_c = h[start : start + chunk], targets[start : start + chunk]
            if fused:
                total += _fused_chunk(h_c, t_c, weight, grad_h, grad_w, start, vocab_start, group, ignore_index)
                continue
            rows = h_c.shape[0]
            logits = torch.mm(h_c, weight.t()).to(stat)  # the chunk's logits in the compute dtype, then fp32
            local_max = logits.amax(dim=-1) if v_local else logits.new_full((rows,), float("-inf"))
            global_max = all_reduce_tp(local_max, group, dist.ReduceOp.MAX) if group is not None else local_max
            _, valid, mine, idx = _chunk_targets(t_c, vocab_start, v_local, ignore_index)
            picked = logits.gather(-1, idx).squeeze(-1) if v_local else logits.new_zeros(rows)
            exp = logits.sub_(global_max.unsqueeze(-1)).exp_()  # in place: one chunk-sized buffer throughout
            target_logit = torch.where(mine, picked - global_max, torch.zeros_like(picked))
            stats = torch.stack([exp.sum(dim=-1), target_logit])
            if group is not None:  # sum-exp and the target logit in one all-reduce
                stats = all_reduce_tp(stats, group)
            sum_exp, target_logit = stats[0], stats[1]
            total += torch.where(valid, torch.log(sum_exp) - target_logit, torch.zeros_like(sum_exp)).sum()
            if need_h or need_w:
                grad = exp.div_(sum_exp.unsqueeze(-1))  # softmax
                if v_local:
                    grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
                grad.mul_(valid.to(grad.dtype).unsqueeze(-1))  # ignored targets: no gradient
                grad = grad.to(h.dtype)  # the matmuls run in the compute dtype, as the logits' did
                if need_h:
                    torch.mm(grad, weight, out=grad_h[start : start + chunk])
                if need_w:
                    _accumulate(grad_w, grad.t(), h_c)
                del grad
            del logits, exp  # before the next chunk's matmul: one chunk of logits alive at a time
        # held on ctx, not saved tensors: a single-use backward scales them in place and lets them go
        ctx.grads, ctx.reusable, ctx.weight_dtype = (grad_h, grad_w), reusable, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.grads
        if grad_h is None and grad_w is None:
            raise RuntimeError(
                "the chunked loss's backward ran twice: its gradients are computed in the forward and "
                "handed over once; set reuse_backward=True on the LinearCrossEntropyHead (the "
                "zero-bubble pipeline does) to keep them for a second backward"
            )
        if ctx.reusable:  # out of place: the zero-bubble W pass runs this again after B (retain_graph)
            dh = None if grad_h is None else (grad_h.to(grad_total.dtype) * grad_total).to(grad_h.dtype)
            dw = None if grad_w is None else (grad_w * grad_total).to(ctx.weight_dtype)
        else:  # in place and released: dW needs no second weight-sized buffer (AccumulateGrad takes it as is)
            ctx.grads = (None, None)
            dh = (
                None
                if grad_h is None
                else (
                    grad_h.mul_(grad_total)
                    if grad_h.dtype == grad_total.dtype
                    else (grad_h.to(grad_total.dtype) * grad_total).to(grad_h.dtype)
                )
            )
            dw = None if grad_w is None else grad_w.mul_(grad_total).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None, None, None


def linear_cross_entropy_sum(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_elements: int | None = None,
    vocab_rows: int | None = None,
    reuse_backward: bool = False,
) -> tuple[Tensor, Tensor]:
    """(sum of cross-entropy of h @ weight^T over non-ignored targets, their count), without the full logits.

    h (..., D) in the compute dtype; weight (V_local, D) holds vocab rows [vocab_start, vocab_start +
    V_local) (all of them without tp); targets (...) global ids. With `group` (tp) the statistics are
    all-reduced over it and h's gradient is this rank's partial sum (the caller's input collective sums it).
    `chunk_elements`: fp32 logits per chunk (None: topology.shapes.default_chunk_elements, from the tokens and
    D). `vocab_rows`: the rows that set the chunk size (default V_local; under tp ceil(V / tp) on every rank).
    The backward hands its stored gradients over once (scaled in place); `reuse_backward` keeps them for a
    second backward through the same graph (retain_graph; the zero-bubble pipeline's W pass)."""
    flat = targets.reshape(-1)
    h2 = h.reshape(flat.numel(), h.shape[-1])
    rows = weight.shape[0] if vocab_rows is None else vocab_rows
    chunk = chunk_tokens(flat.numel(), rows, chunk_elements, hidden=h2.shape[1])
    grads = torch.is_grad_enabled()  # evaluation (no_grad): the loss only, no gradient buffers
    total = _LinearCrossEntropy.apply(
        h2,
        weight,
        flat,
        vocab_start,
        group,
        ignore_index,
        chunk,
        grads and h2.requires_grad,
        grads and weight.requires_grad,
        reuse_backward,
    )
    return total, (flat != ignore_index).sum()


class LinearCrossEntropyHead(nn.Module):
    """The output projection with the loss inside it: forward(h) returns the logits as the layer it
    replaces did (vocab-sharded under tp); forward(h, targets) returns (loss sum, valid count) through
    `linear_cross_entropy_sum`. It holds the replaced layer's `weight` Parameter (a tp DTensor Shard(0) or
    a plain tensor), so the parameter is still `output.weight`, and runs inside this module's forward, so
    FSDP2 has gathered (and cast) the weight before and reduces its gradient after."""

    takes_targets = True  # models.Llama.forward(targets=...) looks for this
    reuse_backward = False  # True: the backward may run twice (PipelineRunner sets it for zero-bubble kinds)

    def __init__(
        self,
        weight: Tensor,  # the replaced layer's Parameter: a plain one, or a tp DTensor Shard(0)
        input_comm: nn.Module | None = None,
        chunk_elements: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ):
        super().__init__()
        self.weight = weight
        self.input_comm = input_comm if input_comm is not None else nn.Identity()
        self.chunk_elements, self.ignore_index = chunk_elements, ignore_index
        vocab = weight.shape[0]  # global rows (a DTensor reports its logical shape)
        mesh = weight.device_mesh if isinstance(weight, DTensor) else None
        tp = mesh.size() if mesh is not None else 1
        self.group: dist.ProcessGroup | None = None
        self.vocab_start = 0
        if mesh is not None and tp > 1:
            self.group = mesh.get_group()
            self.vocab_start = shard_range(vocab, mesh.get_local_rank(), tp)[0]
        self.vocab_rows = -(-vocab // tp)

    def forward(self, h: Tensor, targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        h = self.input_comm(h)
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if targets is None:
            return F.linear(h, w)
        with record_function("tessera: loss"):  # named in profiles (runtime/metrics/step_profile.py)
            return linear_cross_entropy_sum(
                h,
                w,
                targets,
                self.vocab_start,
                self.group,
                self.ignore_index,
                self.chunk_elements,
                self.vocab_rows,
                self.reuse_backward,
            )

    def extra_repr(self) -> str:
        budget = self.chunk_elements or "default"
        return f"vocab={self.weight.shape[0]}, chunk_elements={budget}, tp_vocab_start={self.vocab_start}"


def _accepts_targets(model: nn.Module) -> bool:
    try:
        return "targets" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def apply_loss_head(model: nn.Module, chunk_elements: int | None = None, head: str | None = None) -> nn.Module:
    """Swap the output head (the module named `head`: the spec's, or `output` for a model without one) for
    a LinearCrossEntropyHead, in place, after tp (+cp) and before activation checkpointing, compile and
    FSDP2. Only a bias-free nn.Linear or column-parallel layer is swapped, and only on a model whose forward
    takes `targets` (a spec'd family's model, or a stage of it with the head); anything else (a user's
    model without that, a stage without the head) is left as it is."""
    if head is None:
        try:
            head = spec_of(model.config).head
        except (AttributeError, TypeError, ValueError):
            head = "output"
    out = _get(model, head)
    if isinstance(out, LinearCrossEntropyHead) or not _accepts_targets(model):
        return model
    if isinstance(out, nn.Linear) and out.bias is None:
        new = LinearCrossEntropyHead(out.weight, None, chunk_elements)
    elif isinstance(out, ColumnParallelLinear) and getattr(out, "bias", None) is None:
        new = LinearCrossEntropyHead(out.weight, out.input_comm, chunk_elements)
    else:
        return model
    parent_name, _, child = head.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def has_loss_head(model: nn.Module) -> bool:
    return any(isinstance(m, LinearCrossEntropyHead) for m in model.modules())


def model_loss(
    loss_fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    model: nn.Module,
    inputs: Tensor,
    positions: Tensor | None,
    targets: Tensor,
) -> tuple[Tensor, Tensor]:
    """What the runners call per microbatch: `loss_fn.model_loss` when the loss object has one (the fused
    head, when installed), else loss_fn(model(inputs, positions), targets) for a plain function."""
    method = getattr(loss_fn, "model_loss", None)
    if method is not None:
        return method(model, inputs, positions, targets)
    return loss_fn(model(inputs, positions), targets)
