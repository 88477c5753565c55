"""parallelize: the one place that applies the parallel axes to a model, in this order (torchtitan's):

    tp (+ sequence parallel) -> cp (ring or all-gather attention in the attention seam) -> activation
    checkpointing -> compile (each block) -> FSDP2 over the data axes (dp_shard x cp, HSDP across
    dp_replicate)

Each step is a flat `apply_*` function that takes only the mesh it needs (from `Meshes`, None when
its axis is off). The model is normally built on the meta device; parallelize allocates nothing, and
`materialize` then gives each rank only its shards, initialized to the one-process values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tessera.models.moe import moe_blocks
from tessera.models.spec import get_preset, spec_of
from tessera.topology import Layout, Meshes, dry_run
from tessera.topology.memory import SHARDED_BY_STAGE, get_recipe, zero_stage_of
from tessera.topology.shapes import ModelShape, fsdp_shard_numel

from .context import apply_cp, check_context
from .fsdp import (
    PRECISIONS,
    DataParallelConfig,
    apply_activation_checkpointing,
    apply_fsdp,
    check_data_parallel,
    layout_for_strategy,
    without_shared,
)
from .fp8 import FP8_RECIPES, apply_fp8
from .expert import apply_ep, apply_sequence_sum, check_expert_parallel
from .loss import apply_loss_head, check_loss
from .mixed_precision import apply_compute_copies
from .pipeline import PipelineConfig, build_stage, check_pipeline, split_layers, stages_of_rank
from .tp_plan import ColwiseParallel, Plan, PrepareInput, apply_plan, apply_tp, find_modules, spec_plan
from .tensor import check_tensor_parallel
from .tied import retie, shared_parameters


# how a layout without data axes computes in bf16: "copies" (parallel/mixed_precision.py) or "fsdp2", FSDP2 on
# the degree-1 data mesh, the bit-for-bit reference tests/test_mixed_precision.py holds the copies to
PRECISION_ALONE = "copies"


def model_shape_of(model_config, spec=None):
    """The plain-number shape (topology.shapes.ModelShape) of a family's config; a ModelShape as it is."""
    if isinstance(model_config, ModelShape):
        return model_config
    return (spec or spec_of(model_config)).shape(model_config)


@dataclass(frozen=True)
class ParallelConfig:
    layout: Layout
    sequence_parallel: bool = False
    data: DataParallelConfig = field(default_factory=DataParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    cp_method: str = "ring"  # context-parallel attention: "ring" or "allgather"
    timeout: float | None = None  # seconds a ring step may wait (None: the process group's timeout)
    compile: bool = False  # torch.compile each block (the plan's checkpoint_blocks)
    loss: str = "chunked"  # "chunked": the fused head, never the full logits (parallel/loss.py); "logits"
    fp8: str | None = None  # torchao float8 matmuls on the spec's linear layers: "tensorwise" or "rowwise"

    def check(
        self,
        model_config,
        seq_len: int | None = None,
        global_batch: int | None = None,
        microbatches: int | None = None,
        spec=None,
    ) -> None:
        """Every check that can fail, before any process group starts. `model_config` is a family's config
        (its spec found by its `family`, or given as `spec`) or a ModelShape. Each runs once per config and
        shape: a call that asks no more than one that passed (parallelize's, per pipeline stage, after the
        run's own check) returns at once."""
        layout = self.layout
        model_config = model_shape_of(model_config, spec)
        microbatches = microbatches or self.pipeline.microbatches
        asked = (model_config, seq_len, global_batch, microbatches)
        shape_only = seq_len is None and global_batch is None
        if asked in self._passed or (shape_only and any(passed[0] == model_config for passed in self._passed)):
            return
        check_context(seq_len, layout.cp, self.cp_method, layout.tp, self.sequence_parallel)
        check_loss(self.loss)
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"unknown `fp8` recipe {self.fp8!r}; use one of {', '.join(FP8_RECIPES)}")
        check_tensor_parallel(
            model_config, layout.tp, self.sequence_parallel, None if seq_len is None else seq_len // layout.cp
        )
        check_data_parallel(self.data, layout)
        check_expert_parallel(model_config.n_experts, layout.ep, layout.dp_shard * layout.cp, model_config.family)
        if layout.ep > 1 and self.data.activation_checkpointing == "op":
            # the experts' own FSDP2 unit sits inside the recomputed block, and its hooks issue ops that
            # op-level selective checkpointing cannot match between forward and recomputation
            raise ValueError(
                f"activation checkpointing 'op' with ep={layout.ep} is not supported: the experts' FSDP2 "
                f"unit runs inside the recomputed block; use 'full' or 'selective' with expert parallel"
            )
        if layout.pp > 1:
            check_pipeline(
                self.pipeline,
                layout.pp,
                model_config.n_layers,
                self.uses_fsdp,
                self.data.activation_checkpointing,
                self.compile,
            )
        if global_batch is not None and global_batch % layout.dp:
            raise ValueError(
                f"global batch {global_batch} does not split over dp={layout.dp}; use a multiple of {layout.dp}"
            )
        if global_batch is not None and (global_batch // layout.dp) % microbatches:
            rows = global_batch // layout.dp
            raise ValueError(
                f"microbatches={microbatches} does not divide the {rows} rows each dp rank reads "
                f"(global batch {global_batch} / dp {layout.dp}); use a divisor of {rows} or global_batch="
                f"{layout.dp * microbatches * max(1, rows // microbatches)}"
            )
        self._passed.add(asked)

    # the checks passed, held on the config (cached_property writes the instance's __dict__: not a field, so
    # equality, hashing and pickling see the degrees alone, and a new config checks afresh)
    @cached_property
    def _passed(self) -> set[tuple]:
        """(shape, seq_len, global_batch, microbatches) of each check that passed."""
        return set()

    @property
    def uses_fsdp(self) -> bool:
        return self.layout.dp_shard * self.layout.cp * self.layout.dp_replicate > 1


def parallelize(
    model: nn.Module, mesh: Meshes | DeviceMesh, config: ParallelConfig, plan: Plan | None = None, spec=None
) -> nn.Module:
    """Turn a one-process model into this rank's part of the mesh-parallel model, in place. `mesh` is a
    Meshes, or the DeviceMesh of `Layout.build_mesh`. The model (or a pipeline stage of it) is described by
    its family's spec (models/spec.py): the registered one of `model.config`, or `spec` for a user's model
    that is not registered; every axis reads only the spec. A `plan` alone (no spec) parallelizes a model
    by module-name rules over tp and FSDP2 only: pp and cp need a spec's stages and attention slots."""
    if plan is not None and spec is None:
        if config.fp8:
            raise ValueError("fp8 needs the model's spec (its linear layers by style): pass parallelize(..., spec=...)")
        _check_user_plan(model, config, plan)
        head, attention = None, None
    else:
        if spec is None:
            spec = spec_of(model.config)
        shape = spec.shape(model.config)
        config.check(shape)
        plan = plan or spec_plan(spec, shape, config.layout.tp)
        head, attention = spec.head, spec.attention
    meshes = mesh if isinstance(mesh, Meshes) else Meshes(config.layout, mesh.device_type, mesh=mesh)
    # the steps below run in topology/axes.py's order of application, STEPS (pp has cut the model at build
    # time); tests/test_axes.py checks that the order here is that order
    if meshes.tp is not None:
        apply_plan(model, meshes.tp, plan, config.sequence_parallel)
    if meshes.ep is not None:  # beside tp: the experts split over ep (and tp), tokens by all-to-all
        apply_ep(model, meshes.ep, meshes.tp)
    if config.fp8:  # after tp, which builds the layers FP8 configures (torchtitan converts before its tp styles wrap)
        # FSDP2 all-gathers the FP8 weights (torchao's enable_fsdp_float8_all_gather) where it shards them and
        # no tp splits them: tessera's tp layers read their DTensor's local shard, which torchao's weight
        # subclass does not wrap; under tp the weights gather in the compute dtype
        fp8_gather = config.fp8 == "tensorwise" and meshes.fsdp is not None and meshes.tp is None
        report = apply_fp8(model, config.fp8, spec, meshes.tp, meshes.device_type != "cuda", fp8_gather)
        setattr(model, "fp8_report", report)  # what it converted and kept: the start-up line names them
    if meshes.cp is not None:
        apply_cp(model, meshes.cp, config.cp_method, config.timeout, slots=attention)
        apply_sequence_sum(model, meshes.cp)
    if check_loss(config.loss) == "chunked":  # the output head computes the loss; before ac, compile, FSDP2
        apply_loss_head(model, head=head)
    if plan.checkpoint_blocks:
        apply_activation_checkpointing(model, config.data.activation_checkpointing, plan.checkpoint_blocks)
    if config.compile:
        apply_compile(model, plan.checkpoint_blocks)
    if meshes.fsdp is not None:
        apply_fsdp(
            model, meshes.fsdp, config.data, pipelined=meshes.pp is not None, plan=plan, expert_mesh=meshes.expert_fsdp
        )
    elif config.data.offload == "params" or (config.data.mixed_precision != "fp32" and PRECISION_ALONE == "fsdp2"):
        # --offload params runs on FSDP2's CPUOffloadPolicy, on the degree-1 data mesh
        apply_fsdp(model, meshes.precision, config.data, pipelined=True, plan=plan)
    elif config.data.mixed_precision != "fp32":
        # no data axes to shard over, but the same precision policy as every other layout, bit for bit
        # FSDP2's on a degree-1 mesh, without its gather and reduce copies (parallel/mixed_precision.py)
        apply_compute_copies(model, PRECISIONS[config.data.mixed_precision], without_shared(plan.units(model)))
    return model


def apply_compile(model: nn.Module, blocks: str | None) -> None:
    """torch.compile each block in place (Module.compile: parameter names and state dicts unchanged).
    Per block rather than the whole model, as torchtitan does: blocks share one compiled graph, FSDP2's
    hooks stay between them, and tessera's collectives (autograd Functions around c10d calls) break the
    graph where they run."""
    if not blocks:
        raise ValueError("`compile` needs the plan's checkpoint_blocks (the modules to compile)")
    for _, block in find_modules(model, blocks):
        block.compile()


def _check_user_plan(model: nn.Module, config: ParallelConfig, plan: Plan) -> None:
    layout = config.layout
    if layout.pp > 1 or layout.cp > 1:
        raise ValueError(
            f"a plan without a model spec supports dp (FSDP2/HSDP) and tp only: pp={layout.pp}, cp={layout.cp}; "
            f"pipeline and context parallel read the stages and attention slots from a spec: pass "
            f"parallelize(..., spec=ModelSpec(...)) (tessera.models.spec; examples/custom_model.py)"
        )
    check_data_parallel(config.data, layout)
    if config.data.activation_checkpointing != "none" and not plan.checkpoint_blocks:
        raise ValueError(
            f"activation checkpointing {config.data.activation_checkpointing!r} needs the plan's checkpoint_blocks "
            f"(the pattern of the blocks to recompute, e.g. 'blocks.*')"
        )
    plan.check(model, layout.tp)
    if (
        config.sequence_parallel
        and layout.tp > 1
        and not any(isinstance(s, (PrepareInput, ColwiseParallel)) for s in plan.rules.values())
    ):
        raise ValueError(
            "sequence parallel with a plan that has no PrepareInput or ColwiseParallel: "
            "nothing would gather the sequence"
        )


def materialize(model: nn.Module, device: torch.device | str, seed: int, spec=None) -> nn.Module:
    """Allocate a meta-built, parallelized model's local shards on `device` and initialize them to their
    slice of the one-process initialization for `seed` (no rank draws a tensor it does not hold), by the
    init rule of its family's spec (`spec`, or the registered one of `model.config`)."""
    tied = shared_parameters(model)
    model.to_empty(device=device)  # allocates each registration of a shared parameter apart: tie them again
    retie(model, tied)
    (spec or spec_of(model.config)).init_weights(model, seed, model.config)
    return model


def dry_run_model_states(
    model: str,
    layout: Layout,
    recipe: str = "mixed_adam",
    strategy: str = "FULL_SHARD",
    sequence_parallel: bool = False,
    rank: int = 0,
    pipeline: PipelineConfig | None = None,
) -> dict[str, Any]:
    """Per-rank model-state bytes of `rank`, counted from the parameters that pp, tp, ep and FSDP2 actually
    leave on it: the preset (only `rank`'s pipeline stages when pp > 1) is built on the meta device and
    parallelized on the fake backend, so any layout (thousands of ranks) is measured in one process.
    Bytes and counts as floats (local_params, tp_local_params, stage_params, parameters, gradients,
    optimizer, total), with the rank's `stages` and their `layers` ([start, stop) each)."""

    def local_numel(parts: list[nn.Module]) -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for m in parts for p in m.parameters())

    r, stage = get_recipe(recipe), zero_stage_of(strategy)
    layout = layout_for_strategy(layout, strategy)
    cfg = get_preset(model)
    pipeline = pipeline or PipelineConfig()
    with dry_run(layout, rank=rank) as mesh:
        meshes = Meshes(layout, "cpu", mesh=mesh)
        if layout.pp > 1:
            n_stages = layout.pp * pipeline.virtual
            layers = split_layers(cfg.n_layers, n_stages, pipeline.layers_per_stage)
            stages = stages_of_rank(layout.index("pp", rank), layout.pp, pipeline.virtual, pipeline.placement)
            parts = [build_stage(cfg, s, n_stages, layers[s]) for s in stages]
        else:
            stages, layers, parts = [0], [range(cfg.n_layers)], [spec_of(cfg).build_model(cfg, device="meta")]
        stage_params = local_numel(parts)  # the stage(s) whole, before tp and FSDP
        for m in parts:
            if meshes.tp is not None:
                apply_tp(m, meshes.tp, sequence_parallel)
            if meshes.ep is not None:  # E / ep experts of each MoE block (parallelize's order: beside tp)
                apply_ep(m, meshes.ep, meshes.tp)
        unsharded = local_numel(parts)  # this rank's tp (and ep) slice, whole over dp
        # FSDP2 cuts each (tp-local) tensor's dim 0 as torch.chunk over the shard group; counting by that
        # rule is exact (tests/test_planner.py compares it with fully_shard) and takes milliseconds where
        # fully_shard on 4096 fake ranks takes half a minute. Under ep the experts are their own unit on the
        # edp mesh: the flattened dp_shard x cp index unflattened into (edp, ep), ep innermost (mesh.py)
        shards = layout.dp_shard * layout.cp if meshes.fsdp is not None else 1
        index = layout.index(("dp_shard", "cp"), rank)
        experts = (
            {id(p) for m in parts for _, b in moe_blocks(m) for p in b.experts.parameters()} if meshes.ep else set()
        )

        def shard(p) -> int:
            t = p.to_local() if isinstance(p, DTensor) else p
            rows = t.shape[0] if t.dim() else 1
            n, i = (shards // layout.ep, index // layout.ep) if id(p) in experts else (shards, index)
            return fsdp_shard_numel(rows, t.numel() // max(1, rows), n, i)

        sharded = sum(shard(p) for m in parts for p in m.parameters())
    out: dict[str, Any] = {
        "local_params": float(sharded),
        "tp_local_params": float(unsharded),
        "stage_params": float(stage_params),
        "stages": stages,
        "layers": [[layers[s].start, layers[s].stop] for s in stages],
    }
    for component in ("parameters", "gradients", "optimizer"):
        count = sharded if component in SHARDED_BY_STAGE[stage] else unsharded
        out[component] = float(count * getattr(r, component))
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out
