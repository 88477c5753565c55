"""Seeded, tiled initialization of whatever shard of a parameter a rank holds, for any model family.

A family says only how each parameter is drawn (`ModelSpec.init_std(name, config)`: a truncated-normal std,
`ONES` or `ZEROS`); the values then depend only on the seed and the parameter's one-process name, never on
the layout, the order modules were built in, or which shard a rank holds.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

INIT_TILE = (256, 256)  # rows x columns drawn by one generator
ONES, ZEROS = "ones", "zeros"  # norm weights, biases

Init = float | str | None  # a std, ONES or ZEROS (None is ONES: the norms)


def init_region(
    name: str,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    size: tuple[int, ...],
    std: Init,
    seed: int,
    out: Tensor | None = None,
    tiles: dict | None = None,
) -> Tensor:
    """The values of rows/columns [offset, offset + size) of parameter `name` (global `shape`), written
    into `out` (any dtype and device) or a new float32 tensor.

    The global tensor is cut into fixed INIT_TILE tiles, each drawn from its own generator seeded by
    (seed, name, tile); a region draws only the tiles it covers. So every rank's shard equals that slice
    of the one-process initialization, and no rank ever holds more than its shard plus one tile. `tiles`: a
    dict that keeps each tile drawn, for the regions of one parameter a simulated world fills one after the
    other (each of its ranks' shards, many within one tile: each tile drawn once, not once a rank)."""
    if out is None:
        out = torch.empty(size)
    if std is None or std == ONES:
        return out.fill_(1.0)
    if std == ZEROS:
        return out.zero_()
    if isinstance(std, str):
        raise ValueError(f"{name}: init {std!r} is not a std, {ONES!r} or {ZEROS!r}")
    if len(shape) == 3:  # a stack of matrices (grouped experts): each its own 2-D tiles, named by its index
        for e in range(offset[0], offset[0] + size[0]):
            init_region(
                f"{name}[{e}]",
                tuple(shape[1:]),
                tuple(offset[1:]),
                tuple(size[1:]),
                std,
                seed,
                out=out[e - offset[0]],
                tiles=tiles,
            )
        return out
    if len(shape) > 3:
        raise ValueError(f"{name}: init_region handles 1-D to 3-D parameters, not shape {tuple(shape)}")
    shape2 = (shape[0], shape[1] if len(shape) == 2 else 1)
    off2 = (offset[0], offset[1] if len(shape) == 2 else 0)
    size2 = (size[0], size[1] if len(shape) == 2 else 1)
    view = out.view(size2)
    (tr, tc) = INIT_TILE
    for i in range(off2[0] // tr, -(-(off2[0] + size2[0]) // tr)):
        for j in range(off2[1] // tc, -(-(off2[1] + size2[1]) // tc)):
            r0, c0 = i * tr, j * tc
            tile_shape = (min(tr, shape2[0] - r0), min(tc, shape2[1] - c0))
            tile = None if tiles is None else tiles.get((name, i, j))
            if tile is None:
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{i}/{j}".encode())) % 2**63)
                tile = torch.empty(tile_shape)
                torch.nn.init.trunc_normal_(tile, std=std, a=-3 * std, b=3 * std, generator=gen)
                if tiles is not None:
                    tiles[(name, i, j)] = tile
            # the part of the tile inside the region
            a0, a1 = max(r0, off2[0]), min(r0 + tile_shape[0], off2[0] + size2[0])
            b0, b1 = max(c0, off2[1]), min(c0 + tile_shape[1], off2[1] + size2[1])
            view[a0 - off2[0] : a1 - off2[0], b0 - off2[1] : b1 - off2[1]] = tile[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0]
    return out


def local_region(p: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of the piece of `p` this rank holds (the whole tensor if not a DTensor)."""
    if not isinstance(p, DTensor):
        return (0,) * p.dim(), tuple(p.shape)
    size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset), tuple(size)


def one_process_name(name: str) -> str:
    """A parameter's name in the one-process model: the wrappers activation checkpointing
    (`_checkpoint_wrapped_module.`) and torch.compile of a whole module (`_orig_mod.`) add, removed."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _simulated() -> bool:
    """Whether torch's LocalTensorMode is on (a simulated world: every rank's shard in this process)."""
    try:
        # lazy: torch's simulated world (torch.distributed._local_tensor); a torch without it is never in one
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return False
    return enabled_local_tensor_mode() is not None


def per_rank(fn: Callable) -> Callable:
    """`fn`, or under torch's LocalTensorMode (a simulated world: every rank's shard in one process) `fn` run
    once per simulated rank on that rank's values: for code whose shapes and offsets differ by rank."""
    if not _simulated():  # real ranks: fn itself
        return fn
    from torch.distributed._local_tensor import maybe_run_for_local_tensor  # lazy: (as in _simulated)

    return maybe_run_for_local_tensor(fn)


def _init_shard(
    name: str,
    shape: tuple[int, ...],
    local: Tensor,
    offset: tuple,
    size: tuple,
    std: Init,
    seed: int,
    tiles: dict | None = None,
) -> None:
    """One rank's shard of parameter `name` filled from its tiles (per_rank runs it for each simulated rank)."""
    if tuple(local.shape) != tuple(size):
        raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the region {size} at {offset}")
    if local.is_contiguous():
        init_region(name, shape, tuple(offset), tuple(size), std, seed, out=local, tiles=tiles)
    else:
        local.copy_(init_region(name, shape, tuple(offset), tuple(size), std, seed, tiles=tiles))


def init_parameters(model: nn.Module, seed: int, init_std: Callable[[str], Init]) -> None:
    """Initialize every parameter this rank holds from the seed (see `init_region`): the one-process
    model, or a model built on the meta device, parallelized and materialized with `to_empty`, whose
    DTensor shards are filled from the tiles they cover. Then every module with `reset_buffers(device)`
    (rotary tables, say) recomputes its non-persistent buffers on the parameters' device."""
    device = None
    simulated = _simulated()
    for name, p in model.named_parameters():
        name = one_process_name(name)  # the one-process name seeds the generators
        local = p.to_local() if isinstance(p, DTensor) else p
        device = device or local.device
        offset, size = local_region(p)
        # a simulated world's ranks share tiles: each drawn once (a real rank holds no more than one at a time);
        # bound, not passed: per_rank would hand each rank its own copy of a dict argument
        fill = functools.partial(_init_shard, tiles={}) if simulated else _init_shard
        with torch.no_grad():  # in place, tile by tile: no shard-sized temporary
            per_rank(fill)(name, tuple(p.shape), local, offset, size, init_std(name), seed)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset(device or torch.device("cpu"))
