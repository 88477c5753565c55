"""This rank's share of each step's data: what the Trainer feeds its runner, in one place.

    rank_rows(batch, layout, batch_index, cp_index)   a global batch's rows for this dp rank, cut to its
                                                       zigzag chunks under cp (the equivalence runner too)
    StepData.next_step(data)                           the step's microbatches, the global count of valid
                                                       targets, the tokens checksum and the packing record
    StepData.local(rows_in, rows_tg, data)             one batch of this rank's rows, packed and sharded

A token-file stream hands each dp rank only its rows (the counts over the global batch then need one
all-reduce over dp x cp); the shipped text hands every rank the whole global batch. With --pack-documents
the rows are packed (runtime/data/corpus.py's pack_documents) before any sequence sharding, so the positions
travel with the tokens to every cp shard and pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tessera.data.corpus import IGNORE_INDEX, pack_documents
from tessera.parallel.comm import collective
from tessera.parallel.context import zigzag_indices, zigzag_shard
from tessera.parallel.local_world import simulated_world
from tessera.parallel.loss import count_valid
from tessera.topology import Layout, Meshes
from tessera.topology.axes import FLATTENED_BY_PURPOSE
from torch import Tensor


# (inputs, targets) of shape (rows, seq), or (inputs, targets, positions) with packed documents' per-row
# positions (rows, seq), which the model's attention masks each document by
Microbatch = tuple[Tensor, ...]


def split_microbatches(
    inputs: Tensor, targets: Tensor, count: int, positions: Tensor | None = None
) -> list[Microbatch]:
    """Rows cut into `count` equal microbatches (the config checks that they divide), each with its rows'
    positions when given (packed documents)."""
    if positions is None:
        return list(zip(inputs.chunk(count), targets.chunk(count)))
    return list(zip(inputs.chunk(count), targets.chunk(count), positions.chunk(count)))


def rank_rows(batch: tuple[Tensor, ...], layout: Layout, batch_index: int, cp_index: int) -> tuple[Tensor, ...]:
    """This rank's part of a global batch (inputs, targets and any per-token tensor beside them): its dp
    rows (the same across tp, cp and pp), cut to its zigzag chunks of each sequence under context parallel."""
    rows = batch[0].shape[0] // layout.dp
    mine = tuple(t[batch_index * rows : (batch_index + 1) * rows] for t in batch)
    if layout.cp > 1:
        mine = tuple(zigzag_shard(t, 1, cp_index, layout.cp) for t in mine)
    return mine


@dataclass
class StepBatch:
    microbatches: list[Microbatch]
    valid: int  # valid targets over the whole global batch: every rank's loss denominator
    tokens_checksum: int | None  # token files only (tessera's own text is read whole by every rank)
    documents: dict[str, Any] | None  # --pack-documents: what the record reports
    loss_targets: dict[str, int] | None = None  # --sft: the global batch's targets kept and masked


def whole_batch_checksum(inputs: Tensor, targets: Tensor) -> int:
    """StepData.tokens_checksum of a global batch every rank holds whole (no reduction needed)."""
    rows, seq = inputs.shape
    tokens = torch.cat([inputs, targets[:, -1:].clamp(min=0)], dim=1).long()
    weights = (torch.arange(rows).view(-1, 1) + 1) * (torch.arange(seq + 1).view(1, -1) + 1)
    return int((tokens * weights).sum())


@dataclass(frozen=True)
class BatchShape:
    """What a step reads: sequences of `seq_len` tokens, `global_batch` of them over every data-parallel rank,
    each rank's share split into `microbatches`; `pack`: packed documents (positions restart at each)."""

    seq_len: int
    global_batch: int
    microbatches: int
    pack: bool = False


class StepData:
    """Turns a data stream's next global batch into this rank's microbatches (see the module docstring):
    `meshes` say which rows and chunks are this rank's (`rank`'s coordinates in meshes.layout)."""

    def __init__(self, meshes: Meshes, rank: int, device: torch.device, shape: BatchShape):
        self.layout, self.meshes, self.device, self.shape = meshes.layout, meshes, device, shape
        self.cp_index = self.layout.index("cp", rank)

    def positions_of(self, inputs: Tensor) -> Tensor | None:
        """The global positions of this rank's tokens `inputs` (rows, S / cp): its zigzag chunks under
        context parallel; None (0..S-1, the model's default) otherwise."""
        if self.layout.cp == 1:
            return None
        size, world = inputs.shape[1] * self.layout.cp, simulated_world()
        if world is None:
            return zigzag_indices(size, self.cp_index, self.layout.cp, inputs.device)
        with world.disable():  # each simulated rank's own chunks
            return world.rank_map(
                lambda r: zigzag_indices(size, self.layout.index("cp", r), self.layout.cp, self.device)
            )

    def packed(self, inputs: Tensor, targets: Tensor, data: Any, ends: Tensor | None = None) -> tuple[Tensor, ...]:
        """With --pack-documents: (inputs, targets with each separator's target masked, per-document
        positions) of whole rows, before any sequence sharding; else (inputs, targets). `ends`: the
        documents' last tokens where the stream gives them (an hf: stream's)."""
        if not self.shape.pack:
            return inputs, targets
        targets, positions = pack_documents(inputs, targets, data.separator, ends)
        return inputs, targets, positions

    def to_rank(self, *rows: Tensor) -> tuple[Tensor, ...]:
        """This dp rank's rows cut to its zigzag chunks under context parallel, on its device."""
        if self.layout.cp > 1:
            rows = tuple(zigzag_shard(t, 1, self.cp_index, self.layout.cp) for t in rows)
        return tuple(t.to(self.device) for t in rows)

    def of_global_batch(self, *batch: Tensor) -> tuple[Tensor, ...]:
        """This rank's part of a whole global batch, on its device. In a simulated world (torch's
        LocalTensorMode: every rank in this process) each simulated rank's part, as one LocalTensor each."""
        world = simulated_world()
        if world is None:
            mine = rank_rows(batch, self.layout, self.meshes.batch_index, self.cp_index)
            return tuple(t.to(self.device) for t in mine)
        batch_axis = FLATTENED_BY_PURPOSE["batch"].name
        with world.disable():  # the whole batch is one tensor every rank reads; each part is the rank's own
            parts = {
                r: rank_rows(batch, self.layout, self.layout.index(batch_axis, r), self.layout.index("cp", r))
                for r in world.ranks
            }
            return tuple(world.rank_map(lambda r, i=i: parts[r][i].to(self.device)) for i in range(len(batch)))

    def local(self, rows_in: Tensor, rows_tg: Tensor, data: Any) -> tuple[Tensor, ...]:
        """One batch of this dp rank's rows (a token-file stream's), packed and cut to this rank."""
        return self.to_rank(*self.packed(rows_in, rows_tg, data))

    def next_step(self, data: Any) -> StepBatch:
        """The step's microbatches from `data` (advancing it) and the counts over the global batch."""
        documents = loss_targets = None
        checksum: int | None
        if hasattr(data, "next_local_batch"):  # token files: a rank reads only its rows
            rows_in, rows_tg, valid = data.next_local_batch(self.meshes.batch_index, self.layout.dp)
            checksum = self.tokens_checksum(rows_in, rows_tg)
            rows = self.packed(rows_in, rows_tg, data)
            if self.shape.pack:  # documents and targets left out, counted over the global batch
                counts = self.global_counts([int((rows[2] == 0).sum()), int((rows[1] == IGNORE_INDEX).sum())])
                documents, valid = self.documents(*counts), valid - counts[1]
            local = self.to_rank(*rows)
        else:
            inputs, targets, *ends = data.next_global_batch()  # an hf: stream adds its documents' ends
            checksum = whole_batch_checksum(inputs, targets) if ends else None
            batch = self.packed(inputs, targets, data, *ends)
            valid = count_valid(batch[1])  # over the whole global batch: the denominator on every rank
            if getattr(data, "sft", False):  # the targets the loss counts (the assistants'), and the rest
                loss_targets = {"kept": valid, "masked": batch[1].numel() - valid}
            if self.shape.pack:
                documents = self.documents(int((batch[2] == 0).sum()), int((batch[1] == IGNORE_INDEX).sum()))
            local = self.of_global_batch(*batch)
        return StepBatch(
            split_microbatches(local[0], local[1], self.shape.microbatches, *local[2:]),
            valid,
            checksum,
            documents,
            loss_targets,
        )

    def global_counts(self, mine: list[int]) -> list[int]:
        """Counts over this dp rank's rows, summed over the dp ranks (the cp ranks of one hold the same rows)."""
        if self.meshes.loss is None:
            return mine
        total = torch.tensor(mine, dtype=torch.int64, device=self.device)
        with collective("all_reduce (document counts)", "dp_cp", self.meshes.loss.get_group()):
            dist.all_reduce(total, group=self.meshes.loss.get_group())
        return [int(t) // self.layout.cp for t in total.tolist()]

    def documents(self, documents: int, left_out: int) -> dict[str, Any]:
        """The step's packing, as its record reports it: documents (a document cut by a row's end counts in
        each row it reaches), their mean length, and the targets left out of the loss (each separator's)."""
        tokens = self.shape.global_batch * self.shape.seq_len
        return {"documents": documents, "mean_length": tokens / max(1, documents), "targets_left_out": left_out}

    def tokens_checksum(self, inputs: Tensor, targets: Tensor) -> int:
        """A checksum of the step's whole global batch from each dp rank's rows (ids weighted by their
        global row and position), added over the dp ranks: equal runs read equal tokens on any layout."""
        rows, seq = inputs.shape
        first = self.meshes.batch_index * rows
        tokens = torch.cat([inputs, targets[:, -1:]], dim=1).long()
        weights = (torch.arange(first, first + rows).view(-1, 1) + 1) * (torch.arange(seq + 1).view(1, -1) + 1)
        local = torch.tensor([int((tokens * weights).sum())], dtype=torch.int64, device=self.device)
        if self.meshes.loss is not None:  # dp x cp ranks; the cp ranks of one dp rank hold the same rows
            with collective("all_reduce (tokens checksum)", "dp_cp", self.meshes.loss.get_group()):
                dist.all_reduce(local, group=self.meshes.loss.get_group())
        return int(local.item()) // self.layout.cp
