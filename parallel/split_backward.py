"""The backward of a pipeline stage, split as the zero-bubble schedules run it: B computes the input
gradient and W the weight gradients from the gradient edges captured during F (`capture_weight_users`), and
FSDP2's gradient sync, which its autograd hooks would run at B, is held until the stage's last backward of
the step (`set_gradient_sync`) or, for the split kinds, run by hand after the last W (`reduce_gradients_now`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.fsdp import FSDPModule


def set_gradient_sync(part: nn.Module, last: bool) -> None:
    if isinstance(part, FSDPModule):  # FSDP2: reduce once per step, keep gathered until then
        part.set_requires_gradient_sync(last)
        part.set_reshard_after_backward(last)


def reduce_gradients_now(part: nn.Module) -> None:
    """FSDP2's post-backward for every unit of `part`, run by hand (torch.distributed.pipelining's
    REDUCE_GRAD does the same): the split schedules compute weight gradients in W passes that FSDP2's
    autograd hooks never see, so each unit's gradients (accumulated unsharded, with sync off) are reduced
    here, after the last W, and the units resharded."""
    if not isinstance(part, FSDPModule):
        return
    part.set_requires_gradient_sync(True)
    part.set_reshard_after_backward(True)
    if hasattr(part, "set_is_last_backward"):  # not in every torch this runs on
        part.set_is_last_backward(True)
    state = part._get_fsdp_state()
    for unit in state._state_ctx.all_states:
        groups = getattr(unit, "_fsdp_param_groups", None)  # torch 2.13; 2.11 holds one group
        if groups is None:
            groups = [g for g in [getattr(unit, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


class capture_weight_users:
    """Record where the output of every module that owns parameters enters the autograd graph, during one
    forward: B asks for the gradient there and W runs the backward from it to that module's own weights
    only (ZB's weight-gradient pass). The gradient edge, not the output tensor: holding a tensor that no
    backward saves (the attention and MLP outputs, added to the residual) would keep it alive from F to W,
    and an in-place op on it later would move its grad_fn. A module returning a tuple (the fused loss head:
    loss sum, count) is recorded by its first tensor."""

    def __init__(self, part: nn.Module, out: list[tuple[GradientEdge, list[nn.Parameter]]]):
        self.modules = [m for m in part.modules() if any(True for _ in m.parameters(recurse=False))]
        self.out = out
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, module: nn.Module, args, output) -> None:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if isinstance(output, tuple):
            output = next((o for o in output if isinstance(o, Tensor)), None)
        if isinstance(output, Tensor) and output.requires_grad and params:
            self.out.append((get_gradient_edge(output), params))

    def __enter__(self):
        self.handles = [m.register_forward_hook(self._hook) for m in self.modules]

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
