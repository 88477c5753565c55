"""Global gradient-norm clipping across every mesh axis, without host round-trips.

torch's clip_grad_norm_ stacks per-parameter norms and fails when parameters live on different meshes
(e.g. 2-D tp x dp DTensors beside 1-D ones). Here the local shards are bucketed by the mesh dims they are
sharded on (never the dims they are replicated on), each bucket's squared sum comes from foreach norms
(one multi-tensor kernel per device and dtype), and each distinct process group gets ONE all-reduce: the
sums of every bucket sharded over it travel together as a small vector. A bucket sharded on several dims
is reduced over each in turn, which covers all its shards. Pipeline stages then add theirs over pp.
Nothing here reads a value on the host.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from .comm import collective

Groups = tuple[tuple[str, dist.ProcessGroup], ...]


def _is_sharded(placement) -> bool:
    # not `is_shard()`: FSDP2 over tp uses _StridedShard, which is a shard but answers False there (torch 2.13)
    return not (placement.is_replicate() or placement.is_partial())


def _sharded_groups(t: DTensor) -> Groups:
    """(mesh dim name, group) for each mesh dim the tensor is sharded on."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return tuple(
        (names[i], mesh.get_group(i)) for i, p in enumerate(t.placements) if _is_sharded(p) and mesh.size(i) > 1
    )


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _reduce_device(g: Tensor, local: Tensor) -> torch.device:
    """Where the norm is summed and all-reduced: the mesh's device (a gradient FSDP2 offloaded to the host
    still reduces over NCCL, which takes GPU tensors only), else the gradient's own."""
    if isinstance(g, DTensor) and g.device_mesh.device_type == "cuda" and local.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return local.device


def _by_device_and_dtype(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """foreach kernels take one device and dtype per call (else they fall back to a per-tensor loop)."""
    out: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def squared_sum(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The sum of squares of every element of `tensors`, in fp32 on `device` (a 0-d tensor)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (on, dtype), group in _by_device_and_dtype(tensors).items():
        # half-precision shards are upcast inside the kernel; fp64 ones cannot narrow there, so after. On the
        # CPU each tensor's norm is taken in fp64: torch's CPU fp32 norm accumulates in one sequence, off by
        # 6.5e-7 relative at 2^17 elements and 1.1e-5 at 2^20 (measured on torch 2.13; CUDA's tree reduction is
        # not), which made one process's grad norm the least accurate of a comparison (a dim-256 model's
        # one-process norm 1.3e-6 from the float64 one, 256 simulated ranks' shards' within 1e-7)
        wide = torch.float64 if on.type == "cpu" or dtype == torch.float64 else torch.float32
        norms = torch._foreach_norm(group, 2.0, dtype=wide)
        total = total + torch.stack(norms).square().sum().to(device, torch.float32)
    return total


def global_grad_norm(parameters: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of the model as one vector (fp32 scalar, the same on every rank)."""
    buckets: dict[Groups, list[Tensor]] = {}
    device = None
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = _local(g).detach()
        device = device or _reduce_device(g, local)
        buckets.setdefault(_sharded_groups(g) if isinstance(g, DTensor) else (), []).append(local)
    device = device or torch.device("cpu")
    sums = {key: squared_sum(tensors, device) for key, tensors in buckets.items()}
    # the distinct groups in first-seen order: the same on every rank of a pipeline stage, which holds the
    # same parameters (every non-pp group lies within one stage), so the collectives line up
    distinct: dict[dist.ProcessGroup, str] = {}
    for key in sums:
        for axis, group in key:
            distinct.setdefault(group, axis)
    for group, axis in distinct.items():
        keys = [key for key in sums if any(g is group for _, g in key)]
        vector = torch.stack([sums[key] for key in keys])
        with collective("all_reduce (grad norm)", axis, group):
            dist.all_reduce(vector, group=group)
        for key, value in zip(keys, vector.unbind()):
            sums[key] = value
    total = torch.zeros((), dtype=torch.float32, device=device)
    for value in sums.values():
        total = total + value
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        with collective("all_reduce (grad norm)", "pp", pp_group):
            dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """What the gradients are multiplied by so their global norm is at most max_norm (1 for a non-finite norm,
    which leaves the gradients as they are, so the non-finite ones can still be found by name)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


@torch.no_grad()
def scale_gradients_(parameters: Iterable[Tensor], coef: Tensor) -> None:
    """Multiply every gradient of `parameters` by `coef`, one foreach call per device and dtype."""
    # on the local shards: a foreach op over DTensors of different meshes is refused by some torch versions
    local = [_local(g) for p in parameters if (g := p.grad) is not None]
    for (device, _), grads in _by_device_and_dtype(local).items():
        torch._foreach_mul_(grads, coef.to(device))


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    scale_also: Iterable[Tensor] | None = None,
) -> Tensor:
    """Scale all gradients so their global norm is at most max_norm; returns the norm before clipping.
    `scale_also`: the parameters to scale when they are more than those counted (a tied weight's second
    copy on a pipeline stage is scaled, not counted twice)."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, pp_group)
    scale_gradients_(params if scale_also is None else scale_also, clip_coefficient(norm, max_norm))
    return norm
