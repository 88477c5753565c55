"""Rank functions of the FP8 tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers import clean_name, gather_by_name, small_config
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
        trainer = Trainer(small_config(**kw), torch.device("cpu"))
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
    grads = gather_by_name(grads)
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


def fp8_runs(cases: list[tuple]) -> list:
    """fp8_run of several configs of this world size (its arguments, each a tuple), one after the other in one spawn."""
    return [fp8_run(*case) for case in cases]
