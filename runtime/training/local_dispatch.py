"""torch 2.13's per-rank dispatch of LocalTensorMode (torch.distributed._local_tensor._for_each_rank_run_func)
without two costs that change nothing, for a simulated world's run (runtime/training/simulated.py's trace).

Where a simulated world's time goes (the debug model on dp16 x tp8, 128 ranks, 2 steps, profiled here): almost
all of it in that function, which runs every op once per rank. For each op and rank it also (1) restored the
process's RNG state, copied out before the op (torch.get_rng_state and set_rng_state, 1.0 M calls, ~6 s of 46),
so that every rank's draw starts from the same state, and (2) rebuilt each rank's arguments through pytree's
unflatten (4.9 M calls, 12.7 s). Here (1) is done only for ops that draw random numbers (an OpOverload tagged
nondeterministic_seeded, or any Python callable): an op that draws none leaves the RNG state as it found it, so
restoring it is a copy of what is there; (2) takes a flat tuple of arguments and a dict of keyword arguments
apart directly where those hold leaves only, the spec's own layout, and leaves every other call to pytree;
(3) where each rank draws from its own RNG state (a seed set inside the mode), an op that draws none does not
restore and re-save every rank's state around it (2 x ranks copies an op: 27 of a 256-rank check's 198 s
profiled): the states stay as they are, and the process's is left as torch's loop leaves it, the last rank's;
(2) also takes flat lists and tuples of leaves (an op's sizes and strides) apart directly, and (4) where no
argument differs by rank (no LocalTensor, no per-rank int: a factory's), every rank gets the arguments as
they are, as torch's mapping hands them (a plain tensor is one object on every rank there too).
The body is otherwise torch 2.13's, line for line; on another torch the mode's own function runs. Measured on
the 128-rank check: 25.3 s -> 20.8 s, the same grad norms to the bit (tests/test_simulated_world.py holds the
simulated runs to one process, and tests/test_local_dispatch.py this function to torch's on random ops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tessera.parallel.local_world import swapped


def _children(spec: Any) -> list[Any]:
    """A pytree spec's children: `children()` where torch has it (2.13 deprecates `children_specs`, warning on
    every read: a simulated run's every operator)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


Kind = tuple[type, int] | None  # a leaf (None), or a list or tuple of that many leaves
Layout = tuple[list[Kind], list[str], list[Kind]]


def _kind(spec: Any) -> Kind | bool:
    """None for a leaf, (list or tuple, n) for one of n leaves, False for anything deeper."""
    if spec.is_leaf():
        return None
    if spec.type in (list, tuple) and all(c.is_leaf() for c in _children(spec)):
        return spec.type, len(_children(spec))
    return False


def _flat_layout(spec: Any) -> Layout | None:
    """The (args, kwargs) spec as (positional kinds, keyword names, keyword kinds) where every argument is a
    leaf or a flat list or tuple of leaves (an op's sizes and strides), else None (pytree rebuilds it)."""
    args, kwargs = _children(spec)
    if args.type is not tuple or kwargs.type is not dict:
        return None
    positional, named = [_kind(c) for c in _children(args)], [_kind(c) for c in _children(kwargs)]
    if any(k is False for k in positional + named):
        return None
    return positional, list(kwargs.context), named  # type: ignore[return-value]


def _rebuild(layout: Layout, flat: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One rank's (args, kwargs) from its flat leaves, by `_flat_layout`'s layout."""
    kinds, names, named = layout
    at = 0
    values: list[Any] = []
    for kind in kinds + named:
        if kind is None:
            values.append(flat[at])
            at += 1
        else:
            container, n = kind
            values.append(container(flat[at : at + n]))
            at += n
    return tuple(values[: len(kinds)]), dict(zip(names, values[len(kinds) :]))


def _make_dispatch(lt: Any) -> Callable[..., Any]:
    """The per-rank dispatch over torch 2.13's helpers in `lt` (torch.distributed._local_tensor)."""
    from torch._ops import OpOverload  # lazy: torch's internals, only around a simulated run
    from torch.utils import _pytree as pytree

    seeded_tag = torch.Tag.nondeterministic_seeded

    def for_each_rank_run_func(
        func: Any, ranks: frozenset[int], args: Sequence[Any], kwargs: dict[str, Any], *, alias: bool = True
    ) -> Any:
        flat_args, args_spec = pytree.tree_flatten((args, kwargs))
        waited = any(isinstance(a, lt.AsyncCollectiveTensor) for a in flat_args)
        flat_args = [a.wait() if isinstance(a, lt.AsyncCollectiveTensor) else a for a in flat_args]
        lm = lt.enabled_local_tensor_mode()
        use_per_rank_rng = lm is not None and len(lm._per_rank_rng_states) > 0
        seeded = not isinstance(func, OpOverload) or seeded_tag in func.tags  # (1) of the module doc
        global_rng_state = None if use_per_rank_rng or not seeded else lt._get_rng_state()
        layout = _flat_layout(args_spec)  # (2)
        # (4): arguments alike on every rank (a factory's sizes: no LocalTensor, no per-rank int) go as they are
        alike = not any(isinstance(a, (lt.LocalTensor, torch.SymInt)) for a in flat_args) and not waited
        as_given = (tuple(args), kwargs)
        flat_rank_rets = {}
        default_value = None
        order = sorted(ranks)
        # (3) of the module doc: per-rank states that an op drawing nothing would hand back unchanged
        kept_rng = use_per_rank_rng and not seeded and all(r in lm._per_rank_rng_states for r in order)
        for r in order:
            if use_per_rank_rng and not kept_rng:
                if r in lm._per_rank_rng_states:
                    lt._set_rng_state(*lm._per_rank_rng_states[r])
            elif global_rng_state is not None:  # a seeded op (no per-rank states)
                lt._set_rng_state(*global_rng_state)
            rank_flat_args = flat_args if alike else [lt._map_to_rank_local_val(a, r) for a in flat_args]
            if alike:
                rank_args, rank_kwargs = as_given
            elif layout is not None:
                rank_args, rank_kwargs = _rebuild(layout, rank_flat_args)
            else:
                rank_args, rank_kwargs = pytree.tree_unflatten(rank_flat_args, args_spec)
            if func is torch.ops.aten.hash_tensor.default and rank_args[0].numel() == 0:
                rank_ret = torch.empty(0, dtype=torch.uint64, device=rank_args[0].device)
            else:
                rank_ret = func(*rank_args, **rank_kwargs)
            flat_rank_rets[r] = rank_ret
            if use_per_rank_rng and not kept_rng:
                lm._per_rank_rng_states[r] = lt._get_rng_state()
            if default_value is None and func is torch.ops.aten.split.Tensor:
                tensor = rank_flat_args[0]
                split_dim = 0 if len(rank_flat_args) < 3 else rank_flat_args[2]
                default_value = lt._zero_sized_like(tensor, split_dim)
        if kept_rng and order:  # the process's state as torch's loop leaves it: the last rank's
            lt._set_rng_state(*lm._per_rank_rng_states[order[-1]])
        if lt._is_inplace_op(func):
            alias = False
            ret = args[0]
            if isinstance(func, OpOverload) and torch.Tag.inplace_view in func.tags:
                ret._sync_meta()
        else:
            ret = lt._combine_rank_results(flat_rank_rets, default_value)
        if alias:
            return lt.return_and_correct_aliasing(func, args, kwargs, ret)
        return ret

    return for_each_rank_run_func


@contextlib.contextmanager
def per_rank_dispatch_without_copies() -> Iterator[None]:
    """For the block, LocalTensorMode's per-rank dispatch is this module's (on torch 2.13; elsewhere torch's)."""
    import torch.distributed._local_tensor as lt  # lazy: torch's simulated world, patched only around a run

    if not torch.__version__.startswith("2.13."):
        yield
        return
    with swapped(lt, _for_each_rank_run_func=_make_dispatch(lt)):
        yield
