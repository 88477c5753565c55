"""Rank functions of the fault-tolerance tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

from helpers import small_config, trainer_for
from tessera.data.corpus import IGNORE_INDEX, TokenStream


class RowsRead(TokenStream):
    """The built-in text with, at each step, the targets of the replica groups whose rows no applied update
    read masked out: one process then trains on exactly the rows a fault-tolerant run consumed."""

    def __init__(self, seq_len: int, global_batch: int, read: list[list[int]], replicas: int):
        super().__init__(seq_len, global_batch)
        self.read, self.replicas, self.step = read, replicas, 0

    def next_global_batch(self):
        inputs, targets = super().next_global_batch()
        targets = targets.clone()
        rows = targets.shape[0] // self.replicas
        for r in range(self.replicas):
            if r not in self.read[self.step]:
                targets[r * rows : (r + 1) * rows] = IGNORE_INDEX
        self.step += 1
        return inputs, targets


def one_process_on_rows_read(kw: dict, read: list[list[int]], replicas: int):
    """(losses, grad norms) of one process trained on the rows `read` (per step: the groups whose rows)."""
    config = small_config(**kw)
    data = RowsRead(config.data.seq_len, config.data.global_batch, read, replicas)
    trainer = trainer_for(config, data=data)
    records = [trainer.train_step().record() for _ in range(config.runtime.steps)]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]
