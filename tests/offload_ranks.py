"""Rank functions of the offload tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from helpers import clean_name, full_tensor, gather_by_name, named_full_parameters, small_config, trainer_for


def offload_run(kw: dict):
    """(per-step losses, grad norms, step 1's full gradients by name, every full parameter after the steps,
    every rank's offload report) of small_config(**kw), on rank 0 (None elsewhere)."""
    config = small_config(**kw)
    trainer = trainer_for(config)
    grads: dict = {}

    def keep(parts):
        for part in parts:
            for name, p in part.named_parameters():
                grads[clean_name(name)] = full_tensor(p.grad).detach().clone()

    records = [trainer.train_step(on_grads=keep if s == 0 else None).record() for s in range(config.runtime.steps)]
    grads = gather_by_name(grads, layout=trainer.layout)
    params = gather_by_name(named_full_parameters(trainer), layout=trainer.layout)
    report = trainer.offload_report() if config.parallel.offload != "none" else None
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if trainer.rank != 0:
        return None
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], grads, params, reports


def offload_resume(kw: dict, saved_with: str, resumed_with: str, root: str):
    """A run of small_config(**kw) saved after step 2 under --offload `saved_with`, and step 3 taken by a new
    Trainer under --offload `resumed_with` from that checkpoint: (step 3's loss and grad norm, every full
    parameter after it) on rank 0."""
    from tessera.checkpointing.checkpoint import CheckpointManager  # lazy: only these rows save

    config = small_config(offload=saved_with, checkpoint_dir=root, **kw)
    trainer = trainer_for(config)
    manager = CheckpointManager(root)
    for _ in range(2):
        trainer.train_step()
    path = trainer.save(manager)
    manager.finish()
    resumed = trainer_for(
        dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, offload=resumed_with))
    )
    assert resumed.load(str(path))["step"] == 2
    record = resumed.train_step().record()
    params = gather_by_name(named_full_parameters(resumed), layout=resumed.layout)
    if resumed.rank != 0:
        return None
    return [record["loss"]], [record["grad_norm"]], params
