"""The experts' dispatch in a simulated world (torch's LocalTensorMode: every rank's tensors held in this one
process, runtime/training/simulated.py). A real dispatch is an all-to-all whose split sizes are the routing's:
each rank sends and receives a different number of rows, which LocalTensorMode (one shape for every rank's
tensor) cannot hold. Here every (source rank, expert) block of rows is padded to the largest such block of its
ep group, M rows, so each rank sends M rows per expert to every peer: an all-to-all of equal splits. The
experts then run on M rows per source, the padding rows zero; a padding row's output is never gathered back,
so its gradient is zero, and the weights' gradients from it are zero too (x^T dy with x and dy zero; a bias's
sum of dy likewise). Each real row meets the same weights as on real ranks, so the simulated experts compute
what real ones do, up to the order of a weight gradient's sum over rows (reassociation)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from .comm import collective
from .local_world import group_members, simulated_world


class _EqualAllToAll(Function):
    """An all-to-all of equal splits over `group` (autograd: the same exchange backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        with collective("all_to_all", "ep", group):
            dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _EqualAllToAll.apply(grad, ctx.group), None


def simulated_dispatch(
    x: Tensor, counts: Tensor, run_experts: Callable[[Tensor, Tensor], Tensor], group: Any, n_experts: int
) -> tuple[Tensor, tuple[int, int]]:
    """(the experts' outputs for x's rows, in x's order; the (sent, received) rows of the first simulated rank's
    real dispatch (global rank 0, or a simulated pipeline stage's first)). x (N, dim): every rank's assignments
    sorted by global expert, counts (E,) of them per expert."""
    world = simulated_world()
    size = dist.get_world_size(group)
    local = n_experts // size
    rows = x.shape[0]
    with world.disable():  # the padding from every rank's routing; each rank's row -> slot map
        per_rank = {r: counts._local_tensors[r].to(torch.long) for r in world.ranks}  # type: ignore[attr-defined]
        block = max(1, max(int(c.max()) for c in per_rank.values()))  # M: the largest (source, expert) block
        slots = {}
        for r, c in per_rank.items():
            expert = torch.repeat_interleave(torch.arange(n_experts), c)
            first = torch.cumsum(c, 0) - c
            slots[r] = (expert * block + torch.arange(rows) - first[expert]).to(x.device)
        slot = world.rank_map(lambda r: slots[r])
        origin = min(world.ranks)
        members = next(m for m in group_members(group) if origin in m)
        c0 = per_rank[origin].view(size, local).sum(1)
        received0 = sum(int(per_rank[r].view(size, local)[members.index(origin)].sum()) for r in members)
        record = (int(c0.sum() - c0[members.index(origin)]), received0)
    # (E M, dim) in global expert order = (peer, its local expert, M): M rows per expert to every peer
    padded = x.new_zeros((n_experts * block, *x.shape[1:])).index_copy(0, slot, x)
    received = _EqualAllToAll.apply(padded, group)  # (source, my local expert, M)
    tail = tuple(x.shape[1:])
    by_expert = received.view(size, local, block, *tail).transpose(0, 1).reshape(local * size * block, *tail)
    out = run_experts(by_expert, torch.full((local,), size * block, dtype=torch.long, device=x.device))
    tail = tuple(out.shape[1:])
    by_source = out.view(local, size, block, *tail).transpose(0, 1).reshape(size * local * block, *tail)
    back = _EqualAllToAll.apply(by_source, group)  # (peer, its local expert, M) = this rank's experts' order
    return back.index_select(0, slot), record
