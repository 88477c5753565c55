"""Rank functions of the Muon tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import torch.distributed as dist

from helpers import gather_by_name, named_full_parameters, small_config, trainer_for
from tessera.parallel import muon


def muon_run(kw: dict, shard_alone: bool = False, save_after: int | None = None):
    """(losses, grad norms, every full parameter after the steps, each rank's Newton-Schulz FLOPs, the
    matmul dtype each step's record says, step 1's matmul FLOPs by dtype) of a --optimizer muon run of
    small_config(**kw), on rank 0 (None elsewhere). `shard_alone` plants the bug of orthogonalizing each
    rank's shard alone. With kw's checkpoint_dir, a checkpoint is saved after step `save_after`; with kw's
    resume, the run starts from that checkpoint (saved on any layout) and takes the steps left."""
    from tessera.checkpointing.checkpoint import CheckpointManager  # lazy: only the checkpoint rows save

    muon.SHARD_ALONE = shard_alone
    try:
        trainer = trainer_for(small_config(optimizer="muon", **kw))
        manager = CheckpointManager(kw["checkpoint_dir"]) if save_after else None
        first = trainer.load(kw["resume"])["step"] if kw.get("resume") else 0
        records = []
        for step in range(first + 1, trainer.config.runtime.steps + 1):
            records.append(trainer.train_step().record())
            if manager is not None and step == save_after:
                trainer.save(manager)
        if manager is not None:
            manager.finish()
    finally:
        muon.SHARD_ALONE = False
    params = gather_by_name(named_full_parameters(trainer), layout=trainer.layout)
    flops: list = [None] * dist.get_world_size()
    dist.all_gather_object(flops, sum(o.owned_flops() for o in trainer.optimizer.muon()))
    if trainer.rank != 0:
        return None
    losses, norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    return losses, norms, params, flops, [r["compute_dtype"] for r in records], records[0]["matmul_flops_by_dtype"]


def resume_bitwise(root: str):
    """(every parameter after step 3 of a run, the same after resuming its step-2 checkpoint) on rank 0:
    dp2 Muon, saved and resumed on the same layout."""
    from tessera.checkpointing.checkpoint import CheckpointManager

    config = small_config(optimizer="muon", dp=2, checkpoint_dir=root)
    trainer = trainer_for(config)
    manager = CheckpointManager(root)
    path = None
    for step in range(3):
        trainer.train_step()
        if step == 1:
            path = trainer.save(manager)
    manager.finish()
    straight = gather_by_name(named_full_parameters(trainer), layout=trainer.layout)
    resumed_trainer = trainer_for(small_config(optimizer="muon", dp=2, resume=path))
    resumed_trainer.load(str(path))
    resumed_trainer.train_step()
    resumed = gather_by_name(named_full_parameters(resumed_trainer), layout=resumed_trainer.layout)
    return (straight, resumed, path) if trainer.rank == 0 else None


def muon_comm(kw: dict):
    """This rank's bytes counted under "muon" in one --comm-stats step, and the analytic mean per rank."""
    trainer = trainer_for(small_config(optimizer="muon", comm_stats="first", **kw))
    comm = trainer.train_step().comm
    return comm["bytes_by_axis"].get("muon", 0.0), comm["analytic_bytes_by_axis"]["muon"]
