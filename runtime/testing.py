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

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from tessera.topology import Layout


class LayoutsDiverge(AssertionError):
    """A layout's losses or gradients differ from one process beyond the tolerance."""


@dataclass(frozen=True)
class RunSpec:
    build_model: Callable[[], nn.Module]
    layout: Layout
    plan: Any
    batch: tuple[Tensor, Tensor]
    steps: int
    lr: float
    seed: int
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None
    fsdp: str


def _default_loss(output: Tensor, targets: Tensor) -> Tensor:
    if targets.dtype in (torch.int64, torch.int32) and output.dim() == targets.dim() + 1:
        return nn.functional.cross_entropy(output.flatten(0, -2).float(), targets.flatten())
    return nn.functional.mse_loss(output.float(), targets.float())


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train_on_layout(spec: RunSpec) -> dict[str, Any] | None:
    """One rank of a layout's run (process group initialized by run_ranks); rank 0 returns the record."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tessera.parallel import ParallelConfig, parallelize
    from tessera.parallel.data import DataParallelConfig

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
    x, y = inputs[dp_rank * rows:(dp_rank + 1) * rows], targets[dp_rank * rows:(dp_rank + 1) * rows]
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
                raise LayoutsDiverge(f"{where}, step {step}: gradient of {name!r} has shape {tuple(gg.shape)}, one process {tuple(gw.shape)}")
            err = (gg.double() - gw.double()).abs().max().item() if gw.numel() else 0.0
            scale = max(gw.abs().max().item() if gw.numel() else 0.0, model_scale, 1e-12)
            if err > rtol * scale:
                loss_note = f"; loss {got:.8g} vs {want:.8g}" if abs(got - want) > rtol * max(abs(want), 1e-12) else ""
                raise LayoutsDiverge(
                    f"{where}, step {step}: gradient of parameter {name!r} differs from one process: max abs error "
                    f"{err:.3e} ({err / scale:.3e} of its scale {scale:.3e}) > rtol {rtol:g}{loss_note}"
                )
        if abs(got - want) > rtol * max(abs(want), 1e-12):
            raise LayoutsDiverge(f"{where}, step {step}: loss {got:.8g} differs from one process's {want:.8g} "
                                 f"(relative {abs(got - want) / abs(want):.3e} > rtol {rtol:g})")


_REFERENCES: dict[tuple, dict] = {}


def _reference_key(build_model, inputs, targets, steps, lr, seed, loss_fn) -> tuple:
    import hashlib

    def name(f):
        return None if f is None else f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', repr(f))}"

    digest = hashlib.sha256()
    for t in (inputs, targets):
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return (name(build_model), steps, lr, seed, name(loss_fn), digest.hexdigest())


def assert_layouts_equivalent(
    build_model: Callable[[], nn.Module],
    layouts: Sequence[Layout | dict],
    batch: tuple[Tensor, Tensor],
    steps: int = 2,
    rtol: float = 1e-5,
    plan: Any = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    lr: float = 0.1,
    seed: int = 0,
    fsdp: str = "FULL_SHARD",
    timeout: float = 120.0,
) -> None:
    """Train `build_model()` on each layout over CPU ranks (gloo) and on one process; raise LayoutsDiverge
    naming the first diverging parameter, with its layout, step and error. `plan` is the tessera.parallel.plan.Plan
    for the user's model (None: the model is tessera's Transformer). Layouts may use dp_replicate, dp_shard
    and tp (FSDP2 over dp with strategy `fsdp`); the batch's rows must split over each layout's dp. The
    model's output must be whole on every rank (end on a RowwiseParallel layer or a replicated one).
    SGD, not AdamW: AdamW's normalization would hide a gradient scaled wrongly."""
    from tessera.parallel.launch import run_ranks
    from tessera.parallel.data import DataParallelConfig, check_data_parallel

    layouts = [lay if isinstance(lay, Layout) else Layout(**lay) for lay in layouts]
    inputs, targets = batch
    for layout in layouts:  # every input error before any rank starts
        if layout.pp > 1 or layout.cp > 1:
            raise ValueError(f"layout {layout}: the equivalence runner takes dp_replicate, dp_shard and tp (pp and cp need tessera's Transformer)")
        if inputs.shape[0] % layout.dp:
            raise ValueError(f"layout {layout}: the batch's {inputs.shape[0]} rows do not split over dp={layout.dp}; use a multiple of {layout.dp} rows")
        check_data_parallel(DataParallelConfig(strategy=fsdp), layout)
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    if plan is not None and any(layout.tp > 1 for layout in layouts):
        with torch.device("meta"):  # the plan's rules against the model's modules, before any rank starts
            probe = build_model()
        for tp in sorted({layout.tp for layout in layouts if layout.tp > 1}):
            plan.check(probe, tp)

    def run(layout: Layout) -> dict:
        spec = RunSpec(build_model, layout, plan, (inputs, targets), steps, lr, seed, loss_fn, fsdp)
        return run_ranks(train_on_layout, layout.world_size, spec, timeout=timeout)[0]

    key = _reference_key(build_model, inputs, targets, steps, lr, seed, loss_fn)
    if key not in _REFERENCES:  # one-process runs are reused across calls (a hypothesis test makes many)
        _REFERENCES[key] = run(Layout())
    reference = _REFERENCES[key]
    for layout in layouts:
        compare_runs(reference, run(layout), f"layout {_describe(layout, fsdp)}", rtol)
