"""Runners: how one optimizer step's forward and backward passes run over the microbatches.

The trainer owns the optimizer, clipping and metrics; a runner only turns microbatches into
gradients and returns this rank's summed loss (through the model's fused loss head when it has one:
`tessera.parallel.loss.model_loss`). Every microbatch's loss is its SUM over valid targets
divided by the valid targets of the whole global batch, so the accumulated gradients are those of
the global-batch mean whatever the layout and however targets are masked. FSDP2 averages gradients
over its mesh; `grad_scale` (that mesh's size) turns the average back into the sum.

    LocalRunner      pp == 1: forward + backward per microbatch, gradient sync on the last only
    PipelineRunner   pp > 1: this rank's F/B/W actions of a schedule (tessera.parallel.pipeline)
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from tessera.parallel.loss import model_loss
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

# (inputs, targets) of shape (rows, seq), or (inputs, targets, positions) with packed documents' per-row
# positions (rows, seq), which the model's attention masks each document by
from tessera.data.batches import Microbatch

LossFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # (logits, targets) -> (sum, count)


class Runner(Protocol):
    def forward_backward(self, microbatches: Sequence[Microbatch], global_valid_tokens: int) -> Tensor:
        """Run forward and backward over `microbatches`, leaving gradients on the parameters; return this
        rank's loss summed over its valid targets (a detached fp32 scalar, not yet divided)."""
        ...


def _set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


class LocalRunner:
    """pp == 1: the whole model on this rank; gradient accumulation over microbatches."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        grad_scale: float = 1.0,
        positions: Callable[[Tensor], Tensor | None] | None = None,
    ):
        self.model, self.loss_fn, self.grad_scale = model, loss_fn, grad_scale
        self.positions = positions  # tokens -> their global positions (context parallel); default 0..S-1

    def forward_backward(self, microbatches: Sequence[Microbatch], global_valid_tokens: int) -> Tensor:
        scale = self.grad_scale / max(1, global_valid_tokens)
        total: Tensor | None = None
        for i, microbatch in enumerate(microbatches):
            inputs, targets = microbatch[0], microbatch[1]
            # FSDP2 reduce-scatters only after the last microbatch; earlier ones accumulate locally
            _set_gradient_sync(self.model, i == len(microbatches) - 1)
            positions = positions_of(microbatch, self.positions)
            loss_sum, _ = model_loss(self.loss_fn, self.model, inputs, positions, targets)
            (loss_sum * scale).backward()
            part = loss_sum.detach().float()
            total = part if total is None else total + part
        assert total is not None, "forward_backward needs at least one microbatch"
        return total


def forward_only(
    model: nn.Module,
    loss_fn: LossFn,
    microbatches: Sequence[Microbatch],
    positions: Callable[[Tensor], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """(summed loss, valid targets) of this rank's microbatches without gradients (evaluation)."""
    total: Tensor | None = None
    count: Tensor | None = None
    with torch.no_grad():
        for microbatch in microbatches:
            loss_sum, valid = model_loss(
                loss_fn, model, microbatch[0], positions_of(microbatch, positions), microbatch[1]
            )
            total = loss_sum.float() if total is None else total + loss_sum.float()
            valid = torch.as_tensor(valid, dtype=torch.float32, device=loss_sum.device)
            count = valid if count is None else count + valid
    if total is None or count is None:
        raise ValueError("evaluation needs at least one microbatch")
    return total, count


def positions_of(microbatch: Microbatch, positions: Callable[[Tensor], Tensor | None] | None) -> Tensor | None:
    """The positions a microbatch's tokens run at: its own (packed documents), else `positions(inputs)`
    (context parallel's zigzag indices), else None (the model's 0..S-1)."""
    if len(microbatch) > 2:
        return microbatch[2]
    return positions(microbatch[0]) if positions is not None else None
