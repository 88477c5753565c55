"""The equivalence runner: a user's model, trained on several layouts over CPU ranks, against one process.

    from tessera.testing import assert_layouts_equivalent
    assert_layouts_equivalent(build_model, [Layout(tp=2), Layout(dp_shard=2), Layout(dp_shard=2, tp=2)],
                              batch=(inputs, targets), steps=2, plan=my_plan, loss_fn=F.cross_entropy)

`build_model` is a module-level function (the ranks import it) returning the one-process model; every
rank calls it under the same seed, so every layout starts from the same weights. Each step: the batch's
rows split over the dp ranks (tp ranks read the same rows), forward, `loss_fn(output, targets)` (a mean
over the rank's rows), backward, an SGD update. Per-step losses (averaged over dp) and every parameter's
gathered gradient are compared with the one-process run; the first parameter (in the model's order) whose
gradient diverges is named with its layout, step and error (LayoutsDiverge, an AssertionError).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from tessera.models.init import one_process_name
from tessera.parallel import ParallelConfig, parallelize
from tessera.parallel.fsdp import DataParallelConfig, check_data_parallel
from tessera.launching.launch import run_ranks
from tessera.parallel.loss import CrossEntropySum, count_valid
from tessera.parallel.pipeline import PipelineConfig
from tessera.topology import Layout, Meshes
from tessera.data.batches import BatchShape, StepData
from tessera.training.parts import build_parts
from tessera.training.preflight import check_document_masking
from tessera.training.run import train
from tessera.data.batches import split_microbatches
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


class LayoutsDiverge(AssertionError):
    """A layout's losses or gradients differ from one process beyond the tolerance."""


@dataclass(frozen=True)
class RunSpec:
    build_model: Callable[[], nn.Module]
    layout: Layout
    plan: Any
    batch: tuple[Tensor, ...]  # (inputs, targets), or with a spec (inputs, targets, positions): packed documents
    steps: int
    lr: float
    seed: int
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None
    fsdp: str
    model_spec: Any = None  # a tessera.models.spec.ModelSpec: every axis, through tessera's own parts
    microbatches: int = 1
    schedule: str = "1f1b"
    cp_method: str = "ring"


def _default_loss(output: Tensor, targets: Tensor) -> Tensor:
    if targets.dtype in (torch.int64, torch.int32) and output.dim() == targets.dim() + 1:
        return nn.functional.cross_entropy(output.flatten(0, -2).float(), targets.flatten())
    return nn.functional.mse_loss(output.float(), targets.float())


def _clean(name: str) -> str:
    return one_process_name(name)


def train_on_layout(spec: RunSpec) -> dict[str, Any] | None:
    """One rank of a layout's run (process group initialized by run_ranks); rank 0 returns the record."""
    layout, rank = spec.layout, dist.get_rank()
    torch.manual_seed(spec.seed)
    model = spec.build_model()
    if layout.world_size > 1:
        mesh = layout.build_mesh("cpu")
        config = ParallelConfig(layout, data=DataParallelConfig(strategy=spec.fsdp))
        parallelize(model, mesh, config, plan=spec.plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    inputs, targets = spec.batch
    dp, dp_rank = layout.dp, layout.index("dp", rank)
    rows = inputs.shape[0] // dp
    x, y = inputs[dp_rank * rows : (dp_rank + 1) * rows], targets[dp_rank * rows : (dp_rank + 1) * rows]
    loss_fn = spec.loss_fn or _default_loss
    losses, grads = [], []
    for _ in range(spec.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        reported = loss.detach().clone()
        if layout.world_size > 1:
            dist.all_reduce(reported)
            reported /= layout.world_size  # tp ranks hold the same loss; dp ranks' means average
        losses.append(reported.item())
        step_grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            full = g.full_tensor() if isinstance(g, DTensor) else (torch.zeros_like(p) if g is None else g)
            step_grads[_clean(name)] = full.detach().clone()
        grads.append(step_grads)
        optimizer.step()
    return {"losses": losses, "grads": grads} if rank == 0 else None


def train_spec_on_layout(spec: RunSpec) -> dict[str, Any] | None:
    """One rank of a spec'd model's run on any layout (pp and cp included), through the parts and runners
    tessera's trainer uses (runtime/training/parts.py): the loss is the cross-entropy mean over the batch's valid
    targets (-100 ignored), summed per rank and divided by the global count, as on every layout."""
    layout, rank = spec.layout, dist.get_rank()
    with torch.device("meta"):
        model_config: Any = spec.build_model().config  # the family's config, which the spec builds from
    meshes = Meshes(layout, "cpu")
    parallel = ParallelConfig(
        layout,
        data=DataParallelConfig(strategy=spec.fsdp),
        cp_method=spec.cp_method,
        pipeline=PipelineConfig(schedule=spec.schedule, microbatches=spec.microbatches),
    )
    inputs, targets = spec.batch[:2]
    shape = BatchShape(inputs.shape[1], inputs.shape[0], spec.microbatches, pack=len(spec.batch) > 2)
    data = StepData(meshes, rank, torch.device("cpu"), shape)
    loss_fn = CrossEntropySum(model_config.vocab_size, meshes.tp)
    built = build_parts(
        spec.model_spec,
        model_config,
        meshes,
        parallel,
        torch.device("cpu"),
        seed=spec.seed,
        loss_fn=loss_fn,
        positions=data.positions_of,
        global_rows=spec.batch[0].shape[0],
    )
    params = [p for part in built.parts for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    x, y, *packed = data.of_global_batch(*spec.batch)  # packed: documents' positions
    valid = count_valid(targets)
    # gathering FSDP-over-tp gradients whole: torch logs a note per rank about its two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    losses, grads = [], []
    for _ in range(spec.steps):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = built.runner.forward_backward(split_microbatches(x, y, spec.microbatches, *packed), valid)
        built.tied.synchronize()
        for mesh in (meshes.pp, meshes.loss):  # the last stage's sums, over the ranks reading other tokens
            if mesh is not None:
                dist.all_reduce(loss_sum, group=mesh.get_group())
        losses.append(loss_sum.item() / max(1, valid))
        local = {}
        for part in built.parts:
            for name, p in part.named_parameters():
                g = p.grad
                g = torch.zeros(p.shape) if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)
                local[_clean(name)] = g.detach().clone()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        grads.append({n: g for part in everyone for n, g in part.items()})
        optimizer.step()
    return {"losses": losses, "grads": grads} if rank == 0 else None


def _describe(layout: Layout, fsdp: str) -> str:
    text = str(layout)
    if fsdp != "FULL_SHARD" and layout.dp > 1:
        text += f" ({fsdp})"
    return text


def compare_runs(reference: dict, run: dict, where: str, rtol: float) -> None:
    """Raise LayoutsDiverge naming the first step and parameter whose loss or gradient differs."""
    for step, (want, got) in enumerate(zip(reference["losses"], run["losses"]), start=1):
        grads_want, grads_got = reference["grads"][step - 1], run["grads"][step - 1]
        missing = sorted(set(grads_want) ^ set(grads_got))
        if missing:
            raise LayoutsDiverge(f"{where}: parameter names differ from one process's, e.g. {missing[0]!r}")
        # errors are measured against the larger of the tensor's and the model's largest gradient entry: a
        # gradient that cancels to zero (a key bias's, under softmax) still carries the terms' rounding
        model_scale = max((g.abs().max().item() for g in grads_want.values() if g.numel()), default=0.0)
        for name, gw in grads_want.items():
            gg = grads_got[name]
            if gg.shape != gw.shape:
                raise LayoutsDiverge(
                    f"{where}, step {step}: gradient of {name!r} has shape {tuple(gg.shape)}, "
                    f"one process {tuple(gw.shape)}"
                )
            err = (gg.double() - gw.double()).abs().max().item() if gw.numel() else 0.0
            scale = max(gw.abs().max().item() if gw.numel() else 0.0, model_scale, 1e-12)
            if err > rtol * scale:
                loss_note = f"; loss {got:.8g} vs {want:.8g}" if abs(got - want) > rtol * max(abs(want), 1e-12) else ""
                raise LayoutsDiverge(
                    f"{where}, step {step}: gradient of parameter {name!r} differs from one process: max abs error "
                    f"{err:.3e} ({err / scale:.3e} of its scale {scale:.3e}) > rtol {rtol:g}{loss_note}"
                )
        if abs(got - want) > rtol * max(abs(want), 1e-12):
            raise LayoutsDiverge(
                f"{where}, step {step}: loss {got:.8g} differs from one process's {want:.8g} "
                f"(relative {abs(got - want) / abs(want):.3e} > rtol {rtol:g})"
            )


_REFERENCES: dict[tuple, dict] = {}


def _reference_key(build_model, batch, steps, lr, seed, loss_fn) -> tuple:
    def name(f):
        return None if f is None else f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', repr(f))}"

    digest = hashlib.sha256()
    for t in batch:
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return (name(build_model), steps, lr, seed, name(loss_fn), digest.hexdigest())


def assert_layouts_equivalent(
    build_model: Callable[[], nn.Module],
    layouts: Sequence[Layout | dict],
    batch: tuple[Tensor, ...],
    steps: int = 2,
    rtol: float = 1e-5,
    plan: Any = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    lr: float = 0.1,
    seed: int = 0,
    fsdp: str = "FULL_SHARD",
    timeout: float = 120.0,
    spec: Any = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
) -> None:
    """Train `build_model()` on each layout over CPU ranks (gloo) and on one process; raise LayoutsDiverge
    naming the first diverging parameter, with its layout, step and error. SGD, not AdamW: AdamW's
    normalization would hide a gradient scaled wrongly.

    With `spec` (a tessera.models.spec.ModelSpec of the model; `build_model()` returns a model with its
    `.config`) every axis is open: pp (the spec's split, `microbatches` per step, default pp, on
    `schedule`), cp (its attention slots), tp (its plan) and FSDP2, through the same parts the trainer
    builds; the loss is the cross-entropy over the targets (`loss_fn` must be None), and every layout,
    one process included, starts from the spec's seeded init.

    Without a spec, `plan` is the tessera.parallel.tp_plan.Plan for the user's model (None: a registered
    family's model). Layouts may then use dp_replicate, dp_shard and tp (FSDP2 over dp with strategy
    `fsdp`); the model's output must be whole on every rank (end on a RowwiseParallel layer or a
    replicated one). Either way the batch's rows must split over each layout's dp.

    Packed documents (with `spec`): batch=(inputs, targets, positions), positions (B, S) restarting at each
    document (tessera.data.corpus.pack_documents), so each token attends only to its own document."""
    resolved = [lay if isinstance(lay, Layout) else Layout(**lay) for lay in layouts]
    if len(batch) not in (2, 3) or (len(batch) == 3 and spec is None):
        raise ValueError(
            "batch is (inputs, targets), or with spec=... (inputs, targets, positions) of packed documents"
        )
    inputs, targets = batch[:2]
    if len(batch) == 3:
        if tuple(batch[2].shape) != tuple(inputs.shape):
            raise ValueError(f"positions {tuple(batch[2].shape)} must have the inputs' shape {tuple(inputs.shape)}")
        with torch.device("meta"):
            check_document_masking(build_model().config, spec)
    if spec is not None and (plan is not None or loss_fn is not None):
        raise ValueError(
            "with spec=..., the plan comes from the spec and the loss is cross-entropy over the targets: "
            "drop plan= and loss_fn="
        )
    for layout in resolved:  # every input error before any rank starts
        if spec is None and (layout.pp > 1 or layout.cp > 1):
            raise ValueError(
                f"layout {layout}: pp and cp read a model's stages and attention slots from its spec: "
                f"pass spec=ModelSpec(...) (tessera.models.spec; examples/custom_model.py)"
            )
        if inputs.shape[0] % layout.dp:
            raise ValueError(
                f"layout {layout}: the batch's {inputs.shape[0]} rows do not split over dp={layout.dp}; "
                f"use a multiple of {layout.dp} rows"
            )
        check_data_parallel(DataParallelConfig(strategy=fsdp), layout)
        if spec is not None:
            with torch.device("meta"):
                model_config = build_model().config
            count = microbatches or layout.pp
            ParallelConfig(layout, pipeline=PipelineConfig(schedule=schedule, microbatches=count)).check(
                model_config, seq_len=inputs.shape[1], global_batch=inputs.shape[0], microbatches=count, spec=spec
            )
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    if plan is not None and any(layout.tp > 1 for layout in resolved):
        with torch.device("meta"):  # the plan's rules against the model's modules, before any rank starts
            probe = build_model()
        for tp in sorted({layout.tp for layout in resolved if layout.tp > 1}):
            plan.check(probe, tp)

    def run(layout: Layout) -> dict:
        run_spec = RunSpec(
            build_model,
            layout,
            plan,
            tuple(batch),
            steps,
            lr,
            seed,
            loss_fn,
            fsdp,
            spec,
            microbatches or layout.pp,
            schedule,
        )
        fn = train_on_layout if spec is None else train_spec_on_layout
        return run_ranks(fn, layout.world_size, run_spec, timeout=timeout)[0]

    key = _reference_key(build_model, batch, steps, lr, seed, loss_fn) + (spec is not None,)
    if key not in _REFERENCES:  # one-process runs are reused across calls (a hypothesis test makes many)
        _REFERENCES[key] = run(Layout())
    reference = _REFERENCES[key]
    for layout in resolved:
        compare_runs(reference, run(layout), f"layout {_describe(layout, fsdp)}", rtol)


# ----------------------------------------------------------------------------- long runs
def drift_envelope(config: Any, microbatches: Sequence[int] = (1, 2, 4)) -> dict[str, Any]:
    """How far one process drifts from itself over `config`'s steps: its model trained on one process once per
    microbatch count (the same global batch, its sums taken in other orders: float reassociation and nothing
    else). Per step, for loss and grad_norm, the largest relative spread among the variants. Over a long run an
    ill-conditioned step amplifies reassociation, so a layout's drift from one process is judged against this
    envelope (`judge_drift`), not against a fixed tolerance."""
    single: dict[str, Any] = dict.fromkeys(("pp", "dp", "dp_replicate", "cp", "tp", "ep"), 1)
    # one process: no pipeline schedule, no sequence parallel (they need pp or tp), and no check of its own
    single.update(
        sequence_parallel=False,
        schedule=None,
        schedule_file=None,
        virtual=1,
        pp_layers=None,
        cp_method=None,
        fsdp="FULL_SHARD",
    )
    runs = {}
    for m in microbatches:
        variant = dataclasses.replace(
            config,
            parallel=dataclasses.replace(config.parallel, **single),
            runtime=dataclasses.replace(config.runtime, check_drift=False, metrics=None, quiet=True),
            data=dataclasses.replace(config.data, microbatches=m),
            checkpoint=dataclasses.replace(config.checkpoint, dir=None, every=0),
        )
        history = train(variant)
        assert history is not None, "one-process runs outside torchrun: train returns rank 0's records"
        runs[m] = history
    steps = min(len(h) for h in runs.values())
    envelope = []
    for s in range(steps):
        row = {}
        for key in ("loss", "grad_norm"):
            values = [runs[m][s][key] for m in microbatches]
            row[key] = (max(values) - min(values)) / max(abs(min(values)), 1e-30)
        envelope.append(row)
    return {"microbatches": list(microbatches), "runs": runs, "envelope": envelope}


def judge_drift(
    history: Sequence[dict], envelope: dict[str, Any], factor: float = 2.0, floor: float = 1e-5
) -> list[str]:
    """The steps where a layout's run (its step records) is farther from the one-process run than `factor`
    times the envelope of one process's own reassociation variants (`drift_envelope`) allows, with `floor`
    (the contract's 1e-5) where the variants agree; empty: the layout drifted no more than one process does."""
    reference = envelope["runs"][envelope["microbatches"][0]]
    out = []
    for s, (mine, ref, env) in enumerate(zip(history, reference, envelope["envelope"]), 1):
        for key in ("loss", "grad_norm"):
            drift = abs(mine[key] - ref[key]) / max(abs(ref[key]), 1e-30)
            allowed = max(floor, factor * env[key])
            if drift > allowed:
                out.append(
                    f"step {s}: {key} {mine[key]:.7g} is {drift:.2e} from one process's {ref[key]:.7g}, "
                    f"beyond {allowed:.2e} ({factor:g} x the spread of one process over microbatches "
                    f"{envelope['microbatches']})"
                )
    return out
