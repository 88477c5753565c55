"""Rank functions of the FP8 tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers import clean_name, gather_by_name, small_config, trainer_for
from tessera.parallel import fp8
from tessera.parallel.fp8 import float8_matmuls
from tessera.parallel.tensor import full_tensor
from tessera.trainer import Trainer


def fp8_run(kw: dict, per_shard: bool = False, scales: bool = False):
    """(losses, grad norms, full gradients of step 1 by name, each step's recorded matmul dtype, step 1's
    matmul FLOPs by dtype, step 1's FP8 scales) of small_config(**kw) on rank 0 (None elsewhere). The scales
    (with `scales`): {one-process module name: [each rank's [(gemm, operand, scale), ...] in cast order]}.
    `per_shard` plants the bug of each tp rank scaling its own shard."""
    fp8.PER_SHARD = per_shard
    try:
        trainer = trainer_for(small_config(**kw))
        matmuls = {
            clean_name(f"{name}.weight")[: -len(".weight")]: m
            for part in trainer.parts
            for name, m in float8_matmuls(part).items()
        }
        for m in matmuls.values():
            m.record = scales
        grads: dict[str, torch.Tensor] = {}

        def keep(parts):
            for part in parts:
                for name, p in part.named_parameters():
                    grads[clean_name(name)] = full_tensor(p.grad).detach().clone()
            for m in matmuls.values():
                m.record = False

        records = [
            trainer.train_step(on_grads=keep if s == 0 else None).record() for s in range(trainer.config.runtime.steps)
        ]
    finally:
        fp8.PER_SHARD = False
    grads = gather_by_name(grads, layout=trainer.layout)
    recorded = {name: m.scales for name, m in matmuls.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, recorded)
    if trainer.rank != 0:
        return None
    by_name: dict[str, list] = {}
    for rank_scales in everyone:
        for name, lst in rank_scales.items():
            by_name.setdefault(name, []).append(lst)
    return (
        [r["loss"] for r in records],
        [r["grad_norm"] for r in records],
        grads,
        [r["compute_dtype"] for r in records],
        records[0]["matmul_flops_by_dtype"],
        by_name,
    )


def comm_bytes(kw: dict):
    """(step 1's bytes by axis as --comm-stats counts them on this rank, the FP8 report) of small_config(**kw)."""
    trainer = trainer_for(small_config(comm_stats="first", **kw))
    comm = trainer.train_step().comm
    return comm["bytes_by_axis"], getattr(trainer.parts[0], "fp8_report", None)


def named_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return gather_by_name(
        {clean_name(n): full_tensor(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()},
        layout=trainer.layout,
    )


def checkpoints(root: str, kw: dict):
    """An FP8 run of small_config(**kw) saves after step 2 of 3; on rank 0: {"straight": every parameter after
    step 3, "resumed": the same after resuming its step-2 checkpoint with --fp8, "saved": the parameters at
    step 2, "without_fp8": (parameters as loaded, step 3's loss) resuming it without --fp8, "bf16_with_fp8": the
    same for a bf16 run's step-2 checkpoint resumed with --fp8, "path": the FP8 checkpoint}."""
    from tessera.checkpointing.checkpoint import CheckpointManager  # lazy: only this case saves

    def run(config_kw: dict, directory: str):
        trainer = trainer_for(small_config(**config_kw, checkpoint_dir=directory))
        manager, path, saved = CheckpointManager(directory), None, None
        for step in range(1, 4):
            trainer.train_step()
            if step == 2:
                path, saved = trainer.save(manager), named_params(trainer)
        manager.finish()
        return trainer, str(path), saved

    def resume(config_kw: dict, path: str):
        trainer = trainer_for(small_config(**config_kw, resume=path))
        trainer.load(path)
        loaded = named_params(trainer)
        loss = trainer.train_step().record()["loss"]
        return trainer, loaded, loss

    fp8_trainer, path, saved = run(kw, f"{root}/fp8")
    straight = named_params(fp8_trainer)
    resumed = named_params(resume(kw, path)[0])
    plain = {k: v for k, v in kw.items() if k != "fp8"}
    _, loaded, loss = resume(plain, path)
    bf16 = plain | dict(mixed_precision="bf16")
    _, bf16_path, bf16_saved = run(bf16, f"{root}/bf16")
    _, bf16_loaded, bf16_loss = resume(bf16 | dict(fp8=kw["fp8"]), bf16_path)
    if dist.get_rank() != 0:
        return None
    return {
        "straight": straight,
        "resumed": resumed,
        "saved": saved,
        "without_fp8": (loaded, loss),
        "bf16_saved": bf16_saved,
        "bf16_with_fp8": (bf16_loaded, bf16_loss),
        "path": path,
    }


def precomputed_scales_run(kw: dict, precompute: bool, plant_scaled: bool = False):
    """(losses, grad norms, [(name, precomputed scale, the all-gather's own scale of the full weight)] at step 1,
    whether every scale was cleared after each step) of small_config(**kw) with the per-step scale precompute on
    or off. The all-gather's own scale: torchao's tensor_to_scale of the whole weight, as one process casts it.
    `plant_scaled` multiplies every precomputed scale by 0.7 (a planted bug; not by a power of two, which FP8 would
    represent exactly: the all-gathers must then cast differently)."""
    import tessera.training.training_loop as trainer_module
    from torchao.float8.float8_utils import tensor_to_scale

    trainer = trainer_for(small_config(**kw))
    weights = trainer.float8_weights
    if not precompute:
        trainer.float8_weights = []
    if plant_scaled:
        real = trainer_module.precompute_float8_scales

        def scaled(ws):
            real(ws)
            for w in ws:
                w._local_tensor._precomputed_scale = w._local_tensor._precomputed_scale * 0.7

        trainer_module.precompute_float8_scales = scaled
    seen: list = []

    def keep(parts):
        for w in weights:
            full = w.full_tensor()
            seen.append((w._local_tensor._precomputed_scale, tensor_to_scale(full, w._local_tensor._dtype)))

    records, cleared = [], True
    for s in range(trainer.config.runtime.steps):
        records.append(trainer.train_step(on_grads=keep if s == 0 else None).record())
        cleared = cleared and all(w._local_tensor._precomputed_scale is None for w in weights)
    if plant_scaled:
        trainer_module.precompute_float8_scales = real
    pairs = [(None if got is None else got.item(), want.item()) for got, want in seen]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], len(weights), pairs, cleared
