"""FSDP2's uneven shards in a simulated world. FSDP2 cuts a parameter's dim 0 into chunks of ceil(rows / ranks)
and pads every shard to that size; the last ranks' real shards are shorter (or empty: fewer rows than ranks).
It picks a rank's chunk by a Python index, `chunks[shard_rank]`, with the rank its process group reports, and
a simulated world's one process group is rank 0's: every simulated rank would take rank 0's chunk, its size
included, and a layout whose widths its FSDP ranks do not divide could not be simulated (tensors of one shape
per rank). torch's LocalTensor holds a shape per rank (a size is a LocalIntNode, one int per rank), so
`uneven_shards_per_rank` gives each simulated rank its own shard after FSDP2 has built rank 0's: the same
padded buffer (FSDP2's all-gather and reduce-scatter run on it, equal on every rank), narrowed to the rank's
own rows, with the sharded size FSDP2 views the reduced gradients by. Nothing changes where the shards are
even, or on real ranks (the patch lives only around a simulated run)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from tessera.parallel.local_world import per_rank, rank_int, swapped
from tessera.parallel.tensor import shard_range


@contextlib.contextmanager
def uneven_shards_per_rank() -> Iterator[None]:
    """For the block, FSDP2's FSDPParam._init_sharded_param gives each simulated rank the rows of its own
    coordinate on the shard mesh (the module docstring)."""
    import torch  # lazy: FSDP2's internals, patched only around a simulated run
    from torch import nn
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    build = FSDPParam.__dict__["_init_sharded_param"]

    @torch.no_grad()
    def init_sharded_param(self: Any, param: Any, *args: Any, **kwargs: Any) -> None:
        build(self, param, *args, **kwargs)
        info = self.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            return
        dim, ranks = self.fsdp_placement.dim, info.shard_mesh_size
        rows, per = self._orig_size[dim], self.padded_sharded_param_size[dim]
        if per * ranks == rows:  # even: rank 0's shard is every rank's
            return
        coordinates = per_rank(info.mesh.get_local_rank(info.shard_mesh_dim))  # one int per simulated rank
        if coordinates is None:  # not a simulated world's mesh: FSDP2's own shard stands
            return
        # each rank's rows as torch.chunk (FSDP2's _chunk_with_empty) splits them: the last shorter or empty
        bounds = {r: shard_range(rows, c, ranks) for r, c in coordinates.items()}
        length = rank_int({r: stop - start for r, (start, stop) in bounds.items()})
        sizes = list(self.padded_sharded_param_size)
        sizes[dim] = length
        self.sharded_size = torch.Size(sizes)
        padded = self._sharded_param_data.view(self.padded_sharded_param_size)
        self.sharded_param = nn.Parameter(
            self.to_sharded_dtensor(padded.narrow(dim, 0, length)), requires_grad=param.requires_grad
        )
        self._setattr_on_modules(self.sharded_param)

    reset = FSDPParam.__dict__["reset_sharded_param"]

    @torch.no_grad()
    def reset_sharded_param(self: Any) -> None:
        # FSDP2's own re-pads a replaced local tensor (to_empty, a state dict loaded with assign) where its size
        # is not the padded one, asking `numel() > 0` and `size() != padded` of it: one answer per rank, which
        # differ on uneven shards, and a LocalIntNode refuses a comparison that does. Here every rank re-pads:
        # the same buffer and view FSDP2 makes, a copy of the rows on ranks whose shard was already padded
        dim = self.fsdp_placement.dim
        if isinstance(self.sharded_size[dim], int):  # even shards: FSDP2's own
            return reset(self)
        info = self._module_info
        self.sharded_param = getattr(info.module, info.param_name)
        local = self.sharded_param._local_tensor
        if local.is_meta:
            return
        length = self.sharded_size[dim]
        padded = local.new_zeros(self.padded_sharded_param_size)
        padded.narrow(dim, 0, length).copy_(local)
        self._sharded_param_data = padded.view(-1)
        self.sharded_param._local_tensor = padded.narrow(dim, 0, length)
        self._sharding_spec = self.sharded_param._spec

    with swapped(FSDPParam, _init_sharded_param=init_sharded_param, reset_sharded_param=reset_sharded_param):
        yield


class _TorchChunks(Sequence):
    """torch.chunk's pieces of `tensor` along `dim` (ceil(rows / count) rows each, the last shorter), padded with
    empty tensors to `count` as FSDP2's _chunk_with_empty pads them, each cut only when it is read."""

    def __init__(self, tensor: Any, count: int, dim: int) -> None:
        self.tensor, self.pieces, self.dim = tensor, count, dim
        self.per = -(-tensor.size(dim) // count)

    def __len__(self) -> int:
        return self.pieces

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.pieces))]
        if not -self.pieces <= i < self.pieces:
            raise IndexError(f"chunk {i} of {self.pieces}")
        start = (i % self.pieces) * self.per
        rows = self.tensor.size(self.dim)
        if start >= rows:  # _chunk_with_empty's padding
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.per, rows - start))


@contextlib.contextmanager
def chunks_on_demand() -> Iterator[None]:
    """For the block, FSDP2's parameter set-up cuts only the chunks it reads (its rank's and the first, of the
    shard mesh's count), not every one: under LocalTensorMode each chunk is a view on every simulated rank and
    each view's storage is aliased rank by rank, so cutting all of them is O(shard ranks x world) (40 of a
    256-rank check's 198 s, profiled). The pieces are torch.chunk's, as views of the same rows."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param  # lazy: (as above)

    cut = fsdp_param._chunk_with_empty

    def chunk_with_empty(tensor: Any, num_chunks: int, dim: int) -> Any:
        if not isinstance(tensor.size(dim), int) or tensor.size(dim) == 0:  # a size per rank: FSDP2's own
            return cut(tensor, num_chunks, dim)
        return _TorchChunks(tensor, num_chunks, dim)

    with swapped(fsdp_param, _chunk_with_empty=chunk_with_empty):
        yield
