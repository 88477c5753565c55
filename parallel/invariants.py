"""Sharding invariants as public checks: each raises InvariantError naming the tensor or parameter and the
layout, or returns None. Users call them on their own tensors, meshes and models (inside ranks started by
`tessera.launching.launch.run_ranks` or the pytest fixtures of `tessera.testing.pytest_plugin`).

    check_shard_gather(tensor, mesh, placements, name)     shard then gather is the identity
    check_reduce_scatter_all_gather(tensor, group, name)   reduce-scatter then all-gather == all-reduce
    check_ring_merge(q, k, v, blocks, causal, merge)       merging blockwise attention == the full softmax
    check_fsdp_unshard(model, reference)                   FSDP2's unshard gives back the original parameters
    check_fsdp_resharded(model)                            every FSDP2 unit holds only its shard after a step
    check_state_preserved(model, expected, layout)         a checkpoint load kept every tensor bitwise
    check_schedule_sound(schedule)                         a pipeline schedule is complete and deadlock-free
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from tessera.kernels import flash_attention
from tessera.models.init import one_process_name

from .context import merge_partial
from tessera.topology.schedules.simulator import simulate, validate
from .tensor import shard_range


class InvariantError(AssertionError):
    """A sharding invariant does not hold; the message names the tensor and the layout."""


def _mesh_text(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return " x ".join(f"{n}{s}" for n, s in zip(names, mesh.shape))


def _max_error(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------- placements and collectives
def check_shard_gather(tensor: Tensor, mesh: DeviceMesh, placements: Sequence[Placement], name: str = "tensor") -> None:
    """Distributing `tensor` (the same value on every rank) with `placements` and gathering it back gives
    `tensor`: bitwise for Shard and Replicate; for Partial, the ranks' addends (rank 0 holds the value,
    the others a seeded share that rank 0 subtracts) must sum back within float rounding."""
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh ({_mesh_text(mesh)})")
    if any(isinstance(p, Partial) for p in placements):
        coords = mesh.get_coordinate()
        if coords is None:
            raise ValueError(f"this rank is not in the mesh ({_mesh_text(mesh)})")
        local = tensor.clone()
        for dim, p in enumerate(placements):  # this rank's piece first (DTensor's even-chunk split) ...
            if isinstance(p, Shard):
                start, stop = shard_range(local.shape[p.dim], coords[dim], mesh.shape[dim])
                local = local.narrow(p.dim, start, stop - start)
        for dim, p in enumerate(placements):  # ... then split additively over each Partial dim
            if isinstance(p, Partial):
                g = torch.Generator().manual_seed(1234 + dim)
                shares = torch.randn((mesh.shape[dim],) + tuple(local.shape), generator=g, dtype=tensor.dtype)
                local = shares[coords[dim]] if coords[dim] else local - shares[1:].sum(0)
        dt = DTensor.from_local(
            local.contiguous(), mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
        back = dt.full_tensor()
        tol = 1e-5 * max(1.0, tensor.abs().max().item())
        if back.shape != tensor.shape or _max_error(back, tensor) > tol:
            raise InvariantError(
                f"shard then gather is not the identity for {name} {tuple(tensor.shape)} with {placements} on "
                f"{_mesh_text(mesh)}: max error {_max_error(back, tensor):.3e}"
            )
        return
    dt = distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    back = dt.full_tensor()
    if back.shape != tensor.shape or not torch.equal(back, tensor):
        detail = (
            f"shape {tuple(back.shape)}" if back.shape != tensor.shape else f"max error {_max_error(back, tensor):.3e}"
        )
        raise InvariantError(
            f"shard then gather is not the identity for {name} {tuple(tensor.shape)} with {placements} on "
            f"{_mesh_text(mesh)}: {detail}"
        )


def check_reduce_scatter_all_gather(
    tensor: Tensor, group: dist.ProcessGroup | None = None, name: str = "tensor", reduce_scatter: Callable | None = None
) -> None:
    """reduce-scatter of each rank's `tensor` over dim 0, then all-gather, equals the all-reduce (within
    float rounding: the two may add in different orders). dim 0 must divide by the group size."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[0] % size:
        raise ValueError(f"{name}: dim 0 ({tensor.shape[0]}) must divide by the group size {size}")
    reduce = reduce_scatter or (lambda out, inp, g: dist.reduce_scatter_tensor(out, inp, group=g))
    piece = tensor.new_empty((tensor.shape[0] // size,) + tuple(tensor.shape[1:]))
    reduce(piece, tensor.contiguous(), group)
    gathered = tensor.new_empty(tensor.shape)
    dist.all_gather_into_tensor(gathered, piece, group=group)
    summed = tensor.clone()
    dist.all_reduce(summed, group=group)
    tol = 1e-5 * max(1.0, summed.abs().max().item())
    if _max_error(gathered, summed) > tol:
        rows = (gathered - summed).abs().flatten(1).amax(1) if tensor.ndim > 1 else (gathered - summed).abs()
        bad = int(rows.argmax()) // (tensor.shape[0] // size)
        raise InvariantError(
            f"reduce-scatter then all-gather differs from all-reduce for {name} {tuple(tensor.shape)} over a group "
            f"of {size} (seen on rank {rank}): max error {_max_error(gathered, summed):.3e}, "
            f"worst in the piece of rank {bad}"
        )


# ----------------------------------------------------------------------------- attention
def check_ring_merge(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: int = 2,
    causal: bool = False,
    merge: Callable | None = None,
    name: str = "attention",
) -> None:
    """Attention over the keys split into `blocks` contiguous blocks, each block's (out, lse) merged in
    ring order with `merge` (default: context.merge_partial), equals attention over all keys. Causal
    masks are bottom-right aligned, as everywhere in tessera (queries are the last Sq positions)."""
    merge = merge or merge_partial
    sq, sk = q.shape[2], k.shape[2]
    if sk % blocks:
        raise ValueError(f"{name}: {blocks} blocks do not divide the {sk} keys")
    want = flash_attention(q, k, v, causal=causal).float()
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], float("-inf"))
    step = sk // blocks
    for b in range(blocks):
        kb, vb = k[:, :, b * step : (b + 1) * step], v[:, :, b * step : (b + 1) * step]
        if causal:  # query i (absolute sk - sq + i) sees key j <= it: mask this block's keys accordingly
            pos_q = torch.arange(sk - sq, sk).view(-1, 1)
            pos_k = torch.arange(b * step, (b + 1) * step).view(1, -1)
            bias = torch.where(pos_k <= pos_q, 0.0, float("-inf"))
            s = (q.float() @ _expand(kb, q).float().transpose(-1, -2)) / q.shape[-1] ** 0.5 + bias
            block_lse = torch.logsumexp(s, -1)
            safe = torch.where(torch.isinf(block_lse), 0.0, block_lse)
            block_out = torch.exp(s - safe.unsqueeze(-1)) @ _expand(vb, q).float()
        else:
            block_out, block_lse = flash_attention(q, kb, vb, causal=False, return_lse=True)
        out, lse = merge(out, lse, block_out.float(), block_lse.float())
    err = _max_error(out, want)
    if err > 1e-4 * max(1.0, want.abs().max().item()):
        raise InvariantError(
            f"merging {blocks} attention blocks differs from the full softmax for {name} (q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, causal={causal}): max error {err:.3e}"
        )


def _expand(kv: Tensor, q: Tensor) -> Tensor:
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


# ----------------------------------------------------------------------------- FSDP2
def _fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def _full(x: Tensor) -> Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def check_fsdp_unshard(model: nn.Module, reference: Mapping[str, Tensor], layout: str = "") -> None:
    """Unsharding every FSDP2 unit (its all-gather) gives each parameter's original value, bitwise.
    `reference` maps parameter names (as in the one-process model) to full tensors."""
    units = _fsdp_modules(model)
    if not units:
        raise ValueError("check_fsdp_unshard: the model has no FSDP2 units (fully_shard was not applied)")
    try:
        for _, unit in units:
            unit.unshard()
        for name, p in model.named_parameters():
            name = one_process_name(name)
            if name not in reference:
                continue
            got = _full(p.data)
            want = reference[name]
            if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
                raise InvariantError(
                    f"FSDP unshard of parameter {name!r} on {layout or 'this layout'} differs from the original: "
                    + (
                        f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
                        if got.shape != want.shape
                        else f"max error {_max_error(got, want):.3e}"
                    )
                )
    finally:
        for _, unit in units:
            unit.reshard()


def check_fsdp_resharded(model: nn.Module, layout: str = "") -> None:
    """After a step, every FSDP2 unit that reshards holds only its shard: each parameter registered on
    the module is the sharded DTensor, not the gathered one (a unit never resharded keeps the whole
    parameter on every rank: the memory FSDP exists to save)."""
    units = _fsdp_modules(model)
    if not units:
        raise ValueError("check_fsdp_resharded: the model has no FSDP2 units (fully_shard was not applied)")
    for unit_name, unit in units:
        state = unit._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None:
            continue
        for fp in group.fsdp_params:
            registered = getattr(fp._module_info.module, fp._module_info.param_name)
            if registered is not fp.sharded_param:
                name = f"{unit_name}.{fp._param_fqn}" if unit_name and fp._param_fqn else (fp._param_fqn or unit_name)
                raise InvariantError(
                    f"FSDP unit {unit_name or '(root)'!r} was never resharded on {layout or 'this layout'}: parameter "
                    f"{one_process_name(name)!r} is held gathered ({tuple(registered.shape)}) instead of as its shard"
                )


# ----------------------------------------------------------------------------- checkpoints and schedules
def check_state_preserved(model: nn.Module, expected: Mapping[str, Tensor], layout: str = "") -> None:
    """Every tensor of `expected` (full tensors by parameter or buffer name, e.g. saved on layout A)
    equals the model's (loaded on layout B), bitwise; a name missing on either side is an error too."""
    state = {one_process_name(k): v for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InvariantError(
            f"after loading on {layout or 'this layout'}: {len(missing)} tensors missing, first {missing[0]!r}"
        )
    for name, want in expected.items():
        got = _full(state[name])
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            detail = (
                f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
                if got.shape != want.shape
                else f"{int((got != want).sum())} of {want.numel()} elements differ, "
                f"max error {_max_error(got, want):.3e}"
            )
            raise InvariantError(f"checkpoint tensor {name!r} was not preserved on {layout or 'this layout'}: {detail}")


def check_schedule_sound(schedule: list, name: str = "schedule") -> None:
    """The schedule gives every (microbatch, stage) exactly one forward and one backward (and one weight
    gradient when split) in order on one rank, and runs to the end without a deadlock."""
    try:
        validate(schedule)
        simulate(schedule)
    except ValueError as e:
        raise InvariantError(f"pipeline {name} over {len(schedule)} ranks is not sound: {e}") from None


__all__ = [
    "InvariantError",
    "check_shard_gather",
    "check_reduce_scatter_all_gather",
    "check_ring_merge",
    "check_fsdp_unshard",
    "check_fsdp_resharded",
    "check_state_preserved",
    "check_schedule_sound",
    "Replicate",
    "Shard",
    "Partial",
]
