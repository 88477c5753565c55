"""Mixed precision where no data axis exists (one process, tp, pp, or pp x tp: cp and ep shard over FSDP2): the fp32
parameters stay the master weights and the step computes with their bf16 copies, as FSDP2's bf16 policy does on a
degree-1 mesh, without FSDP2's machinery there (its copy-in to an all-gather buffer, the all-gather of one rank, the
copy-out, the chunk_cat into a reduce-scatter buffer and its reduce-scatter: 15.9 ms of copies and casts in a 1b
step on an H200 that gathered and reduced nothing).

Bit for bit FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on one rank
(tests/test_mixed_precision.py holds the two side by side):
- every floating-point parameter is cast to the compute dtype before the part's forward (again after each backward,
  as FSDP2 casts at each unshard), and each module that holds it reads the copy: the copy sits in the module's
  instance dict, which attribute lookup reads before nn.Module's registered parameters, while parameters(),
  state_dict(), the optimizer and the clip see the fp32 masters;
- the copy's gradient, summed in bf16 over its uses in a microbatch (a tied weight's two, as FSDP2's unsharded
  parameter sums them), reaches the master through the cast's backward as fp32 and accumulates there over the
  microbatches in fp32 (FSDP2: upcast to its reduce dtype, then accumulated unsharded in it);
- floating-point inputs of the part and of each of the plan's units are cast to the compute dtype on the way in
  (FSDP2's cast_forward_inputs).
A part's forward casts the copies where it has none or they may be stale: a backward has run through them since
(an optimizer step can only follow one: torch's fused AdamW changes a parameter in place without bumping its
version counter), a state dict was loaded, a master was replaced or changed in place by an op that bumps its
version, or they were cast without gradients where this forward records them. Within a step the masters do not
change, so a later microbatch's cast gives the same values a backward's recompute read before. The training loop
drops them after the step's backward and after an evaluation (`release_copies`); a loop of a user's own that
writes the masters some other way (`p.data`) between two forwards with no backward between them calls it too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it cast to `dtype`, through the containers FSDP2's own input cast
    walks (tuples, named ones, lists, dicts, dataclasses: torch.distributed.utils._apply_to_tensors, its helper)."""
    from torch.distributed.utils import _apply_to_tensors  # lazy: FSDP2's helper, torch.distributed

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return _apply_to_tensors(cast, value)


class ComputeCopies:
    """The compute-dtype copies of one model part's parameters (module doc)."""

    def __init__(self, part: nn.Module, dtype: torch.dtype, units: list[list[nn.Module]]):
        self.dtype = dtype
        self.modules = [m for m in part.modules() if m._parameters]
        # what the copies were cast from: (module, name, master, its version counter then); empty: no copies
        self.cast_from: list[tuple[nn.Module, str, nn.Parameter, int]] = []
        self.with_grad = False
        self.backward_ran = False  # since the copies were cast (an optimizer step may have followed)
        part.register_forward_pre_hook(self._before_part, with_kwargs=True, prepend=True)
        part.register_load_state_dict_post_hook(lambda module, keys: self.release())
        for unit in units:
            for module in unit:
                if module is not part:
                    module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True, prepend=True)

    def _fresh(self) -> bool:
        """The copies are still the masters' (the same tensors, not changed in place since), with gradients if
        this forward records them."""
        if not self.cast_from or self.backward_ran or (torch.is_grad_enabled() and not self.with_grad):
            return False
        return all(m._parameters.get(n) is p and p._version == v for m, n, p, v in self.cast_from)

    def cast(self) -> None:
        """Cast every floating-point master to the compute dtype, once each (a tied weight's modules share
        the copy), and point its modules at the copy. The masters are read now: materializing or loading a
        part may have replaced them since it was built."""
        self.release()
        copies: dict[int, Tensor] = {}
        for module in self.modules:
            for name, p in module._parameters.items():
                if p is None or not p.is_floating_point() or p.dtype == self.dtype:
                    continue
                copy = copies.get(id(p))
                if copy is None:  # differentiable: its backward hands the master an fp32 gradient
                    copy = copies[id(p)] = p.to(self.dtype)
                module.__dict__[name] = copy
                self.cast_from.append((module, name, p, p._version))
        self.with_grad = torch.is_grad_enabled()
        self.backward_ran = False
        recorded = [c for c in copies.values() if c.requires_grad]
        if recorded:  # the first gradient of any copy in a backward: the masters may change after it

            def ran(_: Any) -> None:
                self.backward_ran = True

            torch.autograd.graph.register_multi_grad_hook(recorded, ran, mode="any")

    def release(self) -> None:
        """Drop the copies: each module reads its fp32 master again."""
        for module, name, _, _ in self.cast_from:
            module.__dict__.pop(name, None)
        self.cast_from = []

    def _before_part(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self._fresh():
            self.cast()
        return self._cast_inputs(module, args, kwargs)

    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)


def apply_compute_copies(part: nn.Module, dtype: torch.dtype, units: list[list[nn.Module]]) -> ComputeCopies:
    """Compute `part` in `dtype` from copies of its fp32 masters (module doc); `units`: the plan's units, whose
    floating-point inputs are cast as FSDP2 casts its units' inputs. Held on the part (`release_copies`)."""
    copies = ComputeCopies(part, dtype, units)
    setattr(part, "compute_copies", copies)
    return copies


def release_copies(parts: list[nn.Module]) -> None:
    """After a step's backward: each part's compute copies dropped (nothing where a part has none)."""
    for part in parts:
        copies = getattr(part, "compute_copies", None)
        if copies is not None:
            copies.release()
