"""The optimizer side of a step: one AdamW per model part (or, under --optimizer muon, Muon on the spec's
matrices beside AdamW on the rest), its LR schedule, and their Stateful wrappers.

AdamW runs torch's fused kernel (one call per group for the whole update) on CUDA and CPU, as torchtitan's
default does, foreach on other devices, never the per-parameter loop. On DTensor parameters one fused call is
also one sharding decision per group instead of one per foreach op (eight): 19% less CPU here for eight
4-rank contract rows of 3 steps each, most of it in their first step. These kernels refuse plain tensors
beside DTensors in one call, and torch before 2.9 refuses DTensors of different meshes, so each part's
parameters are split into param groups by mesh. The groups do not reach checkpoints: optimizer state is saved
flattened by parameter name (runtime/checkpointing/checkpoint.py), so any grouping loads any other.

AdamW is elementwise, so a rank's update of its own shards is the whole update of those elements: where every
parameter of a group and its gradient are DTensors placed alike (no Partial sum pending, plain local tensors),
the step runs the kernel on the local tensors (`on_local_shards`), bitwise what DTensor's dispatch would run,
without DTensor's sharding decision for a call of six tensor lists (a cold one cost 6% of the test suite's CPU).
The state stays DTensors placed as their parameters, so checkpoints see no difference.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from tessera.models.init import one_process_name
from tessera.parallel.muon import Muon
from tessera.parallel.offload import HostAdamW
from torch.distributed.tensor import DTensor


def lr_lambda(warmup: int, steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` of the peak at `steps`."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def groups_by_mesh(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters split by the mesh they live on (plain tensors apart), in first-seen order."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        key = (p.device_mesh if isinstance(p, DTensor) else None, p.device.type)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def kernel_options(params: list[nn.Parameter]) -> dict[str, bool]:
    """fused where every parameter lies on a device torch has the fused kernel for (CUDA, CPU), else foreach."""
    if params and all(p.device.type in ("cuda", "cpu") for p in params):
        return {"fused": True, "foreach": False}
    return {"fused": False, "foreach": True}


def build_adamw(
    params: Iterable[nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    host: bool = False,
) -> torch.optim.AdamW:
    """AdamW over `params` with the multi-tensor kernels, one param group per mesh; `host` (--offload
    optimizer): its moments in host memory and its step there (parallel/offload.py's HostAdamW)."""
    params = list(params)
    groups = [{"params": g} for g in groups_by_mesh(params)]
    if host:
        return HostAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    options = kernel_options(params)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options)
    optimizer.register_load_state_dict_post_hook(lambda o: _keep_kernels(o, options))
    return optimizer


def _keep_kernels(optimizer: torch.optim.Optimizer, options: dict[str, bool]) -> None:
    """Loading restores the saved groups' options, the kernel choice included: keep this run's (a
    checkpoint saved on CPU resumes fused on CUDA; one saved before this choice, per-parameter loop,
    gets the kernels too). The fused kernel wants each step count on its parameter's device."""
    for group in optimizer.param_groups:
        group.update(options)
        if options["fused"]:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state:
                    state["step"] = state["step"].to(dtype=torch.float32, device=p.device)


def split_matrices(
    part: nn.Module, is_matrix: Callable[[str, int], bool]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(matrices, the rest) of a part's parameters, by the spec's rule on their one-process names."""
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in part.named_parameters():
        (matrices if is_matrix(one_process_name(name), p.ndim) else rest).append(p)
    return matrices, rest


def build_muon(
    part: nn.Module, is_matrix: Callable[[str, int], bool], o: Any, ns_dtype: torch.dtype
) -> list[torch.optim.Optimizer]:
    """[AdamW on the part's other parameters, Muon on its matrices] from the config's optimizer section `o`
    (either list may be empty on a pipeline stage: the optimizer is left out then)."""
    matrices, rest = split_matrices(part, is_matrix)
    out: list[torch.optim.Optimizer] = []
    if rest:
        out.append(build_adamw(rest, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay))
    if matrices:
        out.append(
            Muon(
                matrices,
                lr=o.muon_lr,
                weight_decay=o.muon_weight_decay,
                momentum=o.muon_momentum,
                nesterov=o.muon_nesterov,
                ns_coefficients=o.ns_coefficients(),
                ns_steps=o.muon_ns_steps,
                adjust_lr=o.muon_update_scale,
                ns_dtype=ns_dtype,
            )
        )
    return out


class PartOptimizers:
    """One optimizer per model part (a pipeline rank may hold several stages), or a few (Muon beside
    AdamW), stepped together. Per part, so that checkpoints key each part's optimizer state by its
    parameters' one-process names. `optimizers` is every one, flat; `per_part` them by part."""

    def __init__(self, optimizers: list[Any]):
        self.per_part: list[list[torch.optim.Optimizer]] = [o if isinstance(o, list) else [o] for o in optimizers]
        self.optimizers = [o for part in self.per_part for o in part]

    def muon(self) -> list[Muon]:
        return [o for o in self.optimizers if isinstance(o, Muon)]

    def folds_scale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` applies a gradient scale inside its own kernel: torch's fused Adam(W) divides
        each gradient by `grad_scale` as it reads it (the AMP grad scaler's hook), so the clip costs no
        separate pass over the gradients; foreach AdamW and Muon take their gradients scaled beforehand."""
        return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)

    def step(self, grad_scale: Tensor | None = None) -> None:
        """One step of every optimizer; `grad_scale` (a 0-d tensor, the clip's 1 / coefficient): the
        gradients of the optimizers that `folds_scale` are divided by it inside their fused kernel."""
        for o in self.optimizers:
            folded = grad_scale is not None and self.folds_scale(o)
            if folded:
                o.grad_scale = grad_scale  # type: ignore[attr-defined]
            try:
                if isinstance(o, HostAdamW):  # its step swaps in the host copies itself
                    o.step()
                elif isinstance(o, torch.optim.Adam):  # AdamW too (its subclass)
                    with on_local_shards(o):
                        o.step()
                else:
                    o.step()
            finally:
                if folded:
                    del o.grad_scale  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Tensor, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}


def _local_step_applies(group: dict[str, Any]) -> bool:
    """Every parameter of the group a DTensor whose gradient is placed as it is (or absent), both holding plain
    tensors: then each rank's update of its local shard is exact. A Partial gradient needs its sum first, and
    a wrapped local tensor (torchao's FP8 weights) dispatches through its own subclass: those keep DTensor's path."""
    for p in group["params"]:
        if not isinstance(p, DTensor) or type(p._local_tensor) is not torch.Tensor:
            return False
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor) or type(g._local_tensor) is not torch.Tensor:
            return False
        if g.device_mesh != p.device_mesh or g.placements != p.placements or any(x.is_partial() for x in g.placements):
            return False
    return True


@contextlib.contextmanager
def on_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within: the groups where `_local_step_applies` holds each parameter's local tensor (its gradient set to
    the gradient's local tensor, its state to the state's), so a step updates the shards in place without
    DTensor's dispatch. On the way out the groups hold the DTensors again, with their state DTensors (updated
    in place), and state the step created (its first) wrapped as DTensors placed as their parameter, as
    DTensor's own step would have made it; the step count stays a plain scalar tensor."""
    swapped: list[tuple[dict[str, Any], list[Any], list[Tensor], list[dict[str, Any]]]] = []
    for group in optimizer.param_groups:
        if not _local_step_applies(group):
            continue
        params, local, before = group["params"], [], []
        for p in params:
            shard = p._local_tensor
            shard.grad = None if p.grad is None else p.grad._local_tensor
            state = optimizer.state.pop(p, {})
            if state:
                optimizer.state[shard] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
            local.append(shard)
            before.append(state)
        group["params"] = local
        swapped.append((group, params, local, before))
    try:
        yield
    finally:
        for group, params, local, before in swapped:
            group["params"] = params
            for p, shard, state in zip(params, local, before):
                shard.grad = None
                after = optimizer.state.pop(shard, {})
                placed = {
                    k: state[k] if isinstance(state.get(k), DTensor) else _placed_like(k, v, p)
                    for k, v in after.items()
                }
                if placed:
                    optimizer.state[p] = placed


def _placed_like(key: str, value: Any, param: DTensor) -> Any:
    """New state of a local shard as a DTensor placed as `param`; the step count (a scalar) as it is."""
    if key == "step" or not isinstance(value, Tensor) or value.shape != param._local_tensor.shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class PartSchedulers:
    """The same LR schedule on each part's optimizer; Stateful as one schedule."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.schedulers[0].get_last_lr()]  # torch types them float | Tensor

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            base_lrs = list(s.base_lrs)
            s.load_state_dict(_fit_groups(state, len(s.optimizer.param_groups)))
            if base_lrs != list(s.base_lrs):  # Muon's beside AdamW's: its own peak rates, the saved position
                lambdas = getattr(s, "lr_lambdas", None) or [lambda _: 1.0]
                s.base_lrs = base_lrs
                s._last_lr = [base * lambdas[0](s.last_epoch) for base in base_lrs]  # type: ignore[attr-defined]


def _fit_groups(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A schedule's state for `groups` param groups: a checkpoint from a layout whose parts grouped their
    parameters otherwise holds one entry per group of its own (every group shares one schedule and
    peak rate, so any entry serves; without this, LambdaLR would update only the groups it has rates for)."""
    fitted = dict(state)
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            fitted[key] = [values[0]] * groups
    return fitted
