"""The simulated world's per-rank dispatch (runtime/training/local_dispatch.py) against torch's own: the same
values rank by rank for ops that draw random numbers (every rank from the same RNG state), for ops with nested
arguments (pytree's path) and for plain ones (the direct path), and torch's function back after the block."""

from __future__ import annotations

import pytest
import torch

lt = pytest.importorskip("torch.distributed._local_tensor", reason="LocalTensorMode: torch 2.13")

from tessera.training.local_dispatch import _leaves_only, per_rank_dispatch_without_copies  # noqa: E402


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


def test_the_direct_path_is_taken_for_leaves_only_and_torchs_function_is_back_after():
    from torch.utils import _pytree as pytree

    flat = pytree.tree_flatten(((torch.ones(1), 2), {"alpha": 0.5}))[1]
    nested = pytree.tree_flatten((([torch.ones(1)], 0), {}))[1]
    assert _leaves_only(flat) == (2, ["alpha"]) and _leaves_only(nested) is None
    before = lt._for_each_rank_run_func
    with per_rank_dispatch_without_copies():
        assert (lt._for_each_rank_run_func is not before) == torch.__version__.startswith("2.13.")
    assert lt._for_each_rank_run_func is before
