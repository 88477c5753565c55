"""The simulated world's per-rank dispatch (runtime/training/local_dispatch.py) against torch's own: the same
values rank by rank for ops that draw random numbers (every rank from the same RNG state), for ops with nested
arguments (pytree's path) and for plain ones (the direct path), under one RNG state or one per rank, and
torch's function back after the block."""

from __future__ import annotations

import contextlib

import pytest
import torch

lt = pytest.importorskip("torch.distributed._local_tensor", reason="LocalTensorMode: torch 2.13")

from tessera.training.local_dispatch import _flat_layout, _rebuild, per_rank_dispatch_without_copies  # noqa: E402


def _program() -> list[torch.Tensor]:
    """Random draws between deterministic ops, with flat, keyword and nested (list) arguments."""
    torch.manual_seed(7)
    a = torch.randn(3, 4)
    b = torch.rand(3, 4) * a
    c = torch.cat([a, b], dim=0)  # a list argument: pytree's path
    d = torch.nn.functional.dropout(c, p=0.5, training=True)  # seeded, with keyword arguments
    e = torch.addmm(torch.ones(6, 2), d, torch.randn(4, 2), beta=0.5)
    return [a, b, c, d, e]


def _per_rank(values: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[v._local_tensors[r].clone() for r in sorted(v._local_tensors)] for v in values]


def test_the_dispatch_gives_torchs_values_on_every_rank():
    with lt.LocalTensorMode(4):
        torchs = _per_rank(_program())
    with per_rank_dispatch_without_copies(), lt.LocalTensorMode(4):
        ours = _per_rank(_program())
    for mine, theirs in zip(ours, torchs):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
        assert all(torch.equal(mine[0], x) for x in mine)  # SPMD: every rank drew the same numbers


def _seeded_per_rank(mode) -> None:
    """Each simulated rank its own RNG state (as DTensor's RNG tracker leaves them): rank r seeded with r."""
    with mode.disable():  # (torch.manual_seed inside the mode seeds every rank alike)
        for r in sorted(mode.ranks):
            torch.manual_seed(100 + r)
            mode._per_rank_rng_states[r] = lt._get_rng_state()


def _program_per_rank() -> list[torch.Tensor]:
    """Random draws between deterministic ops, each rank drawing from its own state."""
    a = torch.zeros(3, 4) + 1.0  # a LocalTensor: the dispatch's per-rank path
    b = torch.rand_like(a) * a
    c = b.t().contiguous() + 2.0  # ops that draw nothing: the states kept
    d = torch.nn.functional.dropout(c, p=0.5, training=True)
    e = torch.randn_like(d)
    with lt.enabled_local_tensor_mode().disable():
        torch.rand(2)  # a plain tensor's draw, from the process's state alone
    return [a, b, c, d, e, e * 2.0]  # the last draws nothing: the process's state is the last rank's again


def test_per_rank_rng_states_draw_as_torchs_and_ops_drawing_nothing_leave_them():
    runs = []
    for ours in (False, True):
        with per_rank_dispatch_without_copies() if ours else contextlib.nullcontext():
            with lt.LocalTensorMode(4) as mode:
                _seeded_per_rank(mode)
                values = _per_rank(_program_per_rank())
                states = {r: s[0].clone() for r, s in mode._per_rank_rng_states.items()}
                process = torch.get_rng_state()
        runs.append((values, states, process))
    (theirs, their_states, their_process), (mine, my_states, my_process) = runs
    for m, t in zip(mine, theirs):
        assert all(torch.equal(x, y) for x, y in zip(m, t))
    assert not torch.equal(mine[1][0], mine[1][1])  # the ranks drew different numbers
    assert all(torch.equal(my_states[r], their_states[r]) for r in their_states)
    assert torch.equal(my_process, their_process)  # the process's state as torch's loop leaves it


def test_the_direct_path_is_taken_for_leaves_only_and_torchs_function_is_back_after():
    from torch.utils import _pytree as pytree

    flat = pytree.tree_flatten(((torch.ones(1), 2), {"alpha": 0.5}))[1]
    sizes = ((torch.ones(1), [2, 3], (1,)), {"dims": [0]})
    listed = pytree.tree_flatten(sizes)
    nested = pytree.tree_flatten((([[torch.ones(1)]], 0), {}))[1]
    assert _flat_layout(flat) == ([None, None], ["alpha"], [None]) and _flat_layout(nested) is None
    layout = _flat_layout(listed[1])
    assert layout == ([None, (list, 2), (tuple, 1)], ["dims"], [(list, 1)])
    assert _rebuild(layout, listed[0]) == pytree.tree_unflatten(listed[0], listed[1])
    before = lt._for_each_rank_run_func
    with per_rank_dispatch_without_copies():
        assert (lt._for_each_rank_run_func is not before) == torch.__version__.startswith("2.13.")
    assert lt._for_each_rank_run_func is before
