"""Counting communication: the bytes each mesh axis and each collective moved in a step, as issued.

`CommCounter` is a TorchDispatchMode. Every collective reaches the dispatcher as a c10d op (torch's
`dist.*` calls: tessera's own tp / cp / pp collectives and FSDP2's all-gathers and reduce-scatters) or a
functional-collective op (DTensor's), so counting there sees all of them, wherever they were issued,
including inside autograd's backward. Each op's process group is mapped to the mesh axis with the same
members (`axis_of_group`; tessera's own collectives name their axis in `comm.collective`, which
settles groups two axes share, such as cp's and FSDP's when dp_shard is 1), and its payload to the bytes
this rank puts on the wire with a ring algorithm (the same convention as topology/estimators/comm_model.py, which
predicts them):

    all-reduce 2 (n-1)/n x payload; all-gather (n-1)/n x output; reduce-scatter (n-1)/n x input; send: payload
    all-to-all: exactly the rows this rank sends to the other ranks (the input less the chunk it keeps, by
                the input split sizes; equal splits when none are given), the (n-1)/n of balanced routing
                being only its expectation
    gather / scatter (Muon's): what this rank sends, a gather's non-root its input, a scatter's root its
                input less its own piece

Received bytes are the senders' and are not counted twice. The names bytes are accounted under are the
axes table's (topology/axes.py: each axis's `comm`, FSDP's traffic under its flattened mesh), the same names
topology/estimators/comm_model.py predicts. Under expert parallel the experts' FSDP2 group (edp: the ranks of this
rank's dp_shard x cp group that hold the same experts) is FSDP's too, counted under the flattened mesh's name
as comm_model accounts it. The mode adds a Python call per operator, so it runs only when asked
(`tessera train --comm-stats`, and `tessera bench` for one counted step).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.topology.axes import COMM_AXES, FLATTENED_BY_PURPOSE
from tessera.topology.estimators.comm_model import wire_bytes

from .comm import CURRENT_AXIS, axis_of_group

# c10d op name -> (collective, which argument holds the payload)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0),
    "gather_": ("gather", 1),  # Muon: a matrix's shards to its owner
    "scatter_": ("scatter", 1),  # Muon: the orthogonalized matrix back to its shards
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}


def _sent_to_others(x: torch.Tensor, input_splits: list[int], n: int, me: int) -> int:
    """Bytes of all-to-all input `x` that go to the other n - 1 ranks: all of it but the rows of chunk `me`
    (by the input split sizes in rows; n equal chunks when none are given)."""
    if n <= 1 or x.numel() == 0:
        return 0
    row = x.numel() // x.shape[0] * x.element_size()
    kept = input_splits[me] if input_splits else x.shape[0] // n
    return (x.shape[0] - kept) * row


def expert_shard_group(layout, rank: int) -> list[int]:
    """The experts' FSDP2 group (edp) of `rank` under expert parallel: its dp_shard x cp group unflattened
    into (edp, ep), ep innermost (topology/mesh.py's expert_meshes), so the members a multiple of ep apart."""
    shard = layout.group(FLATTENED_BY_PURPOSE["fsdp"].axes, rank)  # in flattened order
    return shard[shard.index(rank) % layout.ep :: layout.ep]


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Within `with CommCounter(layout, rank) as c:` (the layout FSDP was built on: NO_SHARD's puts the dp
    ranks on dp_replicate, see data.layout_for_strategy), c.bytes[axis][op] accumulates the wire bytes this
    rank sent, c.calls[axis][op] the number of collectives. Axis names are the layout's (tp, cp, pp,
    dp_shard, dp_replicate), its flattened ones (dp_shard_cp: FSDP; dp, dp_cp: the loss) or "world";
    `by_axis` gives every name of the table's accounting (COMM_AXES), 0 where nothing was sent."""

    def __init__(self, layout, rank: int):
        super().__init__()
        self.layout, self.rank = layout, rank
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._axis_by_group: dict[str, tuple[str, int]] = {}

    def _axis(self, group: dist.ProcessGroup) -> tuple[str, int]:
        key = group.group_name
        if key not in self._axis_by_group:
            members = dist.get_process_group_ranks(group)
            fsdp = FLATTENED_BY_PURPOSE["fsdp"]
            if len(members) > 1 and sorted(members) == sorted(self.layout.group(fsdp.axes, self.rank)):
                name = fsdp.name  # FSDP's mesh, by that name even when cp or dp_shard is 1 (or it is the world)
            elif (
                len(members) > 1
                and self.layout.ep > 1
                and sorted(members) == sorted(expert_shard_group(self.layout, self.rank))
            ):
                name = fsdp.name  # the experts' FSDP2 group: FSDP's traffic (before axis_of_group, which may
                # name it dp_shard or cp when it spans one of them)
            else:
                name = axis_of_group(self.layout, self.rank, members) or (
                    "world" if len(members) == self.layout.world_size else f"group{sorted(members)}"
                )
            self._axis_by_group[key] = (name, len(members))
        return self._axis_by_group[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            op, where = _C10D[name]
            group = next(
                (a for a in args if type(a).__name__ == "ScriptObject" and "ProcessGroup" in str(a._type())), None
            )
            if group is not None:
                pg = dist.ProcessGroup.unbox(group)
                if op == "all_to_all":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
                    self._count(op, 0, pg, sent=_sent_to_others(args[1], list(args[4]), pg.size(), pg.rank()))
                elif op in ("gather", "scatter"):  # (outputs, inputs, group, root): only the senders send, the
                    # root nothing to itself: a gather's non-roots their input, a scatter's root all but its piece
                    root, inputs = pg.rank() == args[3], _nbytes(args[1])
                    if op == "gather":
                        sent = 0 if root else inputs
                    else:
                        sent = inputs - inputs // max(1, pg.size()) if root else 0
                    self._count(op, 0, pg, sent=sent)
                else:
                    self._count(op, _nbytes(args[where]), pg)
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            group_name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            out = func(*args, **kwargs)
            pg = _resolve_process_group(group_name)
            if _FUNCTIONAL[name] == "all_to_all":  # (input, output_split_sizes, input_split_sizes, group_name)
                self._count("all_to_all", 0, pg, sent=_sent_to_others(args[0], list(args[2]), pg.size(), pg.rank()))
            else:
                payload = _nbytes(out) if _FUNCTIONAL[name] == "all_gather" else _nbytes(args[0])
                self._count(_FUNCTIONAL[name], payload, pg)
            return out
        return func(*args, **kwargs)

    def _count(self, op: str, payload: int, group: dist.ProcessGroup, sent: int | None = None) -> None:
        """Account one collective: `payload` by the ring rule of wire_bytes, or `sent`, the bytes it sends
        when they are known exactly (an all-to-all's)."""
        axis, n = self._axis(group)
        issued_as = CURRENT_AXIS.get()  # tessera's own collectives say their axis
        if issued_as is not None:
            axis = issued_as
        self.bytes[axis][op] += wire_bytes(op, payload, n) if sent is None else float(sent)
        self.calls[axis][op] += 1

    def by_axis(self) -> dict[str, float]:
        out = dict.fromkeys(COMM_AXES, 0.0)
        out.update({axis: sum(ops.values()) for axis, ops in self.bytes.items()})
        return out

    def report(self) -> dict[str, Any]:
        return {
            "bytes_by_axis": self.by_axis(),
            "bytes_by_collective": {axis: dict(ops) for axis, ops in self.bytes.items()},
            "calls": {axis: dict(ops) for axis, ops in self.calls.items()},
        }
