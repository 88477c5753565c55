"""This rank's parts of a spec'd model and the runner that steps them: what the Trainer and the equivalence
runner (tessera.testing) both build, so users' models and tessera's families go through one path.

    build_parts(spec, model_config, meshes, parallel, device, seed=, loss_fn=, positions=) -> Parts(parts, runner, tied)

Without pp: the whole model, built on the meta device, parallelized, materialized, and a LocalRunner.
With pp: only this rank's stage(s) (parallel/pipeline.py's build_stage by the spec's split), each
parallelized and materialized, a PipelineRunner over the pp group, and the tied-weight group of the first
and last stages when the model ties weights (parallel/tied.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from tessera.models.moe import set_aux_weight
from tessera.parallel import materialize, parallelize
from tessera.parallel.fsdp import PRECISIONS
from tessera.parallel.offload import move_buffers
from tessera.parallel.pipeline import PipelineRunner, build_stage, split_layers, stages_of_rank
from tessera.parallel.pipeline_simulated import this_rank
from tessera.parallel.tied import TiedGradients, no_tied_gradients, pipeline_tied_group, shared_parameters
from tessera.topology import Meshes
from torch import Tensor, nn

from .runners import LocalRunner, Runner


@dataclass
class Parts:
    parts: list[nn.Module]  # this rank's model, or its pipeline stages in stage order
    runner: Runner
    tied: TiedGradients  # the tied weights' gradient sum over the first and last stages (a no-op without)


def build_parts(
    spec: Any,
    model_config: Any,
    meshes: Meshes,
    parallel: Any,
    device: torch.device,
    *,
    seed: int,
    loss_fn: Callable,
    positions: Callable[[Tensor], Tensor | None],
    global_rows: int | None = None,
) -> Parts:
    """This rank's parts of `spec`'s model for `model_config`, parallelized by `parallel` (a ParallelConfig: its
    pipeline's schedule, virtual stages and microbatches, its timeout) on `meshes` and initialized from `seed`
    (the one-process values, shard by shard). `global_rows`: the global batch's sequences, which an MoE
    block's auxiliary loss is the mean over (models/moe.py)."""
    # the pipeline's P2P and tied-weight waits: the run's --timeout; a ParallelConfig built without one: 600 s
    timeout = parallel.timeout if parallel.timeout is not None else 600.0
    layout = meshes.layout
    rank = this_rank(torch.distributed.get_rank)  # a simulated pipeline: its stage's first rank
    # --offload params: FSDP2 wants its offloaded shards materialized on the host; the buffers go to `device`
    states_on = torch.device("cpu") if parallel.data.offload == "params" else device

    def place(part: nn.Module) -> None:
        materialize(part, states_on, seed, spec=spec)
        if states_on != device:
            move_buffers(part, device)

    # d(loss)/d(one sequence's auxiliary loss), scaled as the runners scale the loss (grad_scale)
    aux_weight = None if global_rows is None else meshes.fsdp_size / global_rows
    if layout.pp == 1:
        model = spec.build_model(model_config, device="meta")
        parallelize(model, meshes, parallel, spec=spec)
        place(model)
        set_aux_weight(model, aux_weight)
        runner: Runner = LocalRunner(model, loss_fn, grad_scale=meshes.fsdp_size, positions=positions)
        return Parts([model], runner, no_tied_gradients())
    pp, virtual = layout.pp, parallel.pipeline.virtual
    n_stages = pp * virtual
    layers = split_layers(model_config.n_layers, n_stages, parallel.pipeline.layers_per_stage)
    stages: dict[int, nn.Module] = {}
    for s in stages_of_rank(layout.index("pp", rank), pp, virtual, parallel.pipeline.placement):
        part = build_stage(model_config, s, n_stages, layers[s], spec=spec)
        parallelize(part, meshes, parallel, spec=spec)
        place(part)
        set_aux_weight(part, aux_weight)
        stages[s] = part
    tied = no_tied_gradients()
    with torch.device("meta"):  # which parameters the whole model ties (one name kept: the owner's)
        owners = [names[0] for names in shared_parameters(spec.build(model_config))]
    if owners:
        tied = TiedGradients(owners, stages, n_stages, pipeline_tied_group(layout, rank, timeout))
    tp = layout.tp if parallel.sequence_parallel else 1
    dtype = PRECISIONS[parallel.data.mixed_precision]  # the compute dtype on every layout (parallelize)
    dim = model_config.dim

    def activation(rows: int, seq: int) -> tuple[tuple[int, ...], torch.dtype]:
        return (rows, seq // tp, dim), dtype  # sequence parallel: S / tp positions between stages

    runner = PipelineRunner(
        stages,
        parallel.pipeline.schedule,
        Meshes.group(meshes.pp),
        parallel.pipeline.microbatches,
        virtual,
        loss_fn,
        activation,
        device,
        grad_scale=meshes.fsdp_size,
        timeout=timeout,
        positions=positions,
    )
    return Parts(list(stages.values()), runner, tied)
