"""Tied weights: one nn.Parameter shared by two modules (a tied embedding and output head), kept one tensor
on every layout.

    shared_parameters   the groups of names that are one tensor, found by identity (a spec declares nothing)
    retie               after tensor parallel swapped modules (each swap makes its own DTensor), make the
                        aliases point at the owner's parameter again
    TiedGradients       pipeline parallel: the first stage (embedding) and the last stage (head) each hold
                        the tensor; after backward their gradients are summed over a two-rank group, so both
                        copies take the same optimizer step, and the last stage's copy stays out of the
                        grad norm (counted once, as on one process)

The owner is the first name `named_parameters()` yields (the one-process model's name), so parameter
names, checkpoints and gradients compare by name on every layout.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from tessera.topology import Layout

from .comm import collective


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """[[owner, alias, ...], ...]: the names of each parameter registered under more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _module_and_attr(model: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    module_name, _, attr = name.rpartition(".")
    try:
        return (model.get_submodule(module_name) if module_name else model), attr
    except AttributeError:
        return None, attr  # a pipeline stage without that module


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every alias of each group at its owner's (new) parameter; ValueError if tensor parallel gave
    the two a different layout (a tied embedding and head must both split the vocabulary)."""
    for owner, *aliases in groups:
        owner_module, owner_attr = _module_and_attr(model, owner)
        if owner_module is None or getattr(owner_module, owner_attr, None) is None:
            continue
        param = getattr(owner_module, owner_attr)
        for alias in aliases:
            module, attr = _module_and_attr(model, alias)
            if module is None or getattr(module, attr, None) is None:
                continue
            current = getattr(module, attr)
            if isinstance(param, DTensor) != isinstance(current, DTensor) or (
                isinstance(param, DTensor) and tuple(param.placements) != tuple(current.placements)
            ):
                raise ValueError(
                    f"tied parameters {owner!r} and {alias!r} were sharded differently by the tp plan "
                    f"({getattr(param, 'placements', 'whole')} vs {getattr(current, 'placements', 'whole')}): "
                    f"give both modules styles that split the same dimension"
                )
            setattr(module, attr, param)


def pipeline_tied_group(layout: Layout, rank: int, timeout: float | None = None) -> dist.ProcessGroup | None:
    """The group {first pp rank, last pp rank} of this rank's pipeline (None on the ranks between, or when
    pp == 1). Every rank creates every such group, in the same order, as new_group requires."""
    if layout.pp == 1:
        return None
    mine = None
    for first in range(layout.world_size):
        if layout.coords(first)["pp"] != 0:
            continue
        pipeline = layout.group("pp", first)
        ends = [pipeline[0], pipeline[-1]]
        group = dist.new_group(ends, timeout=timedelta(seconds=timeout) if timeout else None)
        if rank in ends:
            mine = group
    return mine


class TiedGradients:
    """Sums the gradients of tied parameters held by two pipeline stages (see the module docstring)."""

    def __init__(self, names: list[str], parts: dict[int, nn.Module], n_stages: int, group: dist.ProcessGroup | None):
        self.group = group
        holders = [s for s in parts if s in (0, n_stages - 1)]
        self.params: list[nn.Parameter] = []
        for s in holders:
            own = dict(parts[s].named_parameters())
            self.params += [own[n] for n in names if n in own]
        # a V placement (zbv) puts the first and the last stage on one rank: its two copies are summed here
        self.local_pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        if n_stages > 1 and 0 in parts and n_stages - 1 in parts:
            first, last = dict(parts[0].named_parameters()), dict(parts[n_stages - 1].named_parameters())
            self.local_pairs = [(first[n], last[n]) for n in names if n in first and n in last]
            self.params = []
        # the copy that the grad norm skips: the last stage's, unless this rank also holds the first
        self.duplicates = {id(p) for p in self.params} if 0 not in parts else {id(b) for _, b in self.local_pairs}
        if self.params and group is None:
            raise ValueError(
                "tied parameters on a pipeline stage need the first/last-stage group (pipeline_tied_group)"
            )

    def synchronize(self) -> None:
        for a, b in self.local_pairs:
            if a.grad is None or b.grad is None:
                continue
            ga, gb = (g.to_local() if hasattr(g, "to_local") else g for g in (a.grad, b.grad))
            ga.add_(gb)
            gb.copy_(ga)
        for p in self.params:
            if p.grad is None:
                continue
            local: Tensor = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            with collective("all_reduce (tied weights)", "pp", self.group):
                dist.all_reduce(local, group=self.group)

    def for_norm(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        return [p for p in parameters if id(p) not in self.duplicates]


def no_tied_gradients() -> TiedGradients:
    return TiedGradients([], {}, 1, None)


__all__ = ["shared_parameters", "retie", "pipeline_tied_group", "TiedGradients", "no_tied_gradients"]
