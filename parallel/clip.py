"""Global gradient-norm clipping across every mesh axis.

torch's clip_grad_norm_ stacks per-parameter norms and fails when parameters live on different meshes
(e.g. 2-D tp x dp DTensors beside 1-D ones). Here each gradient contributes the squared sum of its local
shard, summed over the mesh dims it is sharded on (never over dims it is replicated on), and the
stages of a pipeline add theirs over the pp group. One all-reduce per distinct set of sharded dims.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from .comm import collective


def _is_sharded(placement) -> bool:
    # not `is_shard()`: FSDP2 over tp uses _StridedShard, which is a shard but answers False there (torch 2.13)
    return not (placement.is_replicate() or placement.is_partial())


def _sharded_groups(t: DTensor) -> tuple:
    """(mesh dim name, group) for each mesh dim the tensor is sharded on."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return tuple((names[i], mesh.get_group(i)) for i, p in enumerate(t.placements) if _is_sharded(p) and mesh.size(i) > 1)


def global_grad_norm(parameters: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of the model as one vector (fp32 scalar, the same on every rank)."""
    buckets: dict[tuple, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float32))
    device = None
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        device = local.device
        key = _sharded_groups(g) if isinstance(g, DTensor) else ()
        buckets[key] = buckets[key].to(device) + local.detach().float().pow(2).sum()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, sq in buckets.items():
        for axis, group in groups:  # sharded on several mesh dims: summing over each in turn covers all shards
            with collective("all_reduce (grad norm)", axis, group):
                dist.all_reduce(sq, group=group)
        total = total + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        with collective("all_reduce (grad norm)", "pp", pp_group):
            dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Scale all gradients so their global norm is at most max_norm; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, pp_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # a NaN/inf norm leaves the gradients as they are, so the non-finite ones can still be found by name
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.device))
    return norm
