"""The chunked loss's softmax statistics and gradient in torch: the reference the Triton kernels
(triton_cross_entropy.py) are checked against beside a float64 definition, and their CPU path."""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy_row_stats_reference(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(max over each row, sum over the row of exp(x - that max)) of logits (rows, V), in fp32 at least."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    row_max = x.amax(dim=-1)
    return row_max, torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)


def cross_entropy_grad_reference_(
    logits: Tensor, target: Tensor, scale: Tensor, row_max: Tensor, row_sum: Tensor
) -> None:
    """Over logits (rows, V), in place: (exp(x - row_max) / row_sum - [column == target]) * scale per row;
    target -1 marks a row whose target column is not in this shard."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    grad = torch.exp(x - row_max.unsqueeze(-1)) / row_sum.unsqueeze(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(columns == target.unsqueeze(-1), grad - 1.0, grad) * scale.unsqueeze(-1)
    logits.copy_(grad)
