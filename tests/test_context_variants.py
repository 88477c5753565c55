"""Context parallel with the attention variants: a sliding window (within a chunk and spanning chunks), attention
sinks (applied once, after the merge), a value head dim of its own and packed documents, on ring and all-gather
attention over gloo ranks, against one process and a float64 definition; the ring's plan skips exactly the
steps no query's window reaches (a property over every rank and size, and counted on four ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from torch.distributed.device_mesh import init_device_mesh

import tessera.parallel.context as context
from tessera.kernels import document_ids, flash_attention
from tessera.models.layers import CausalAttention
from tessera.parallel.context import (
    ContextParallelAttention,
    _ring_plan,
    allgather_attention,
    apply_cp,
    ring_attention,
    zigzag_indices,
    zigzag_shard,
)
from tessera.launching.launch import run_ranks
from test_attention_variants import definition

CHUNK = 8  # tokens per zigzag chunk: windows of 3 (inside one) and 13 (spanning two)


def _positions(S: int, cuts: list[int]) -> torch.Tensor:
    """(2, S) positions restarting at each cut: packed documents (row 1 with one document fewer)."""
    rows = []
    for row_cuts in (cuts, cuts[1:]):
        pos = torch.arange(S)
        for c in sorted(row_cuts):
            pos[c:] = torch.arange(S - c)
        rows.append(pos)
    return torch.stack(rows)


def _case_vs_full(method: str, window: int | None, sinks: bool, docs: bool, dv: int, seed: int) -> dict:
    """Worst relative error of this rank's out, lse and q/k/v/sinks gradients against one process (the fp32
    kernels on the whole sequence) and against the float64 definition."""
    rank, size = dist.get_rank(), dist.get_world_size()
    S = 2 * size * CHUNK
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g)  # GQA: 4 over 2
    v, do = torch.randn(2, 2, S, dv, generator=g), torch.randn(2, 4, S, dv, generator=g)
    dlse = torch.randn(2, 4, S, generator=g)
    s = torch.randn(4, generator=g) * 2 if sinks else None
    positions = _positions(S, [5, 13, 30]) if docs else None
    full_docs = document_ids(positions, torch.arange(S)) if docs else None

    def grads(o, lse, tensors):
        seen = torch.isfinite(lse)
        loss = (o.double() * do.double()).sum() + (torch.where(seen, lse.double(), 0) * dlse.double()).sum()
        return torch.autograd.grad(loss, tensors)

    def leaves(cast):
        return [t.to(cast).clone().requires_grad_() for t in (q, k, v)], None if s is None else s.to(
            cast
        ).clone().requires_grad_()

    (q64, k64, v64), s64 = leaves(torch.float64)
    o, lse = definition(q64, k64, v64, True, window, s64, full_docs, full_docs)
    want = [o, lse, *grads(o, lse, [q64, k64, v64] + ([s64] if sinks else []))]
    (q1, k1, v1), s1 = leaves(torch.float32)
    o, lse = flash_attention(q1, k1, v1, True, return_lse=True, q_docs=full_docs, window=window, sinks=s1)
    one = [o, lse, *grads(o, lse, [q1, k1, v1] + ([s1] if sinks else []))]

    shard = lambda t: zigzag_shard(t, 2, rank, size)  # noqa: E731
    (ql, kl, vl), sl = [shard(t).clone().requires_grad_() for t in (q, k, v)], None
    if sinks:
        sl = s.clone().requires_grad_()
    local_docs = zigzag_shard(full_docs, 1, rank, size) if docs else None
    if docs:  # the ids ContextParallelAttention derives from this rank's positions
        local_positions = zigzag_shard(positions, 1, rank, size)
        assert torch.equal(local_docs, document_ids(local_positions, zigzag_indices(S, rank, size)))
    fn = ring_attention if method == "ring" else allgather_attention
    stats: dict = {}
    extra = {"stats": stats} if method == "ring" else {}
    blocks, real = [], context.flash_attention
    context.flash_attention = lambda *a, **kw: blocks.append(1) or real(*a, **kw)  # the ring's block calls
    try:
        o, lse = fn(
            ql, kl, vl, dist.group.WORLD, True, return_lse=True, docs=local_docs, window=window, sinks=sl, **extra
        )
    finally:
        context.flash_attention = real
    stats["blocks"] = len(blocks)
    seen = torch.isfinite(lse)
    ((o * shard(do)).sum() + (torch.where(seen, lse, 0) * shard(dlse)).sum()).backward()
    got = [o, lse, ql.grad, kl.grad, vl.grad]
    if sinks:  # replicated over cp: each rank's share of its gradient, summed as the data-parallel reduction does
        dist.all_reduce(sl.grad)
        got.append(sl.grad)
    worst = {}
    for name, ref in (("definition", want), ("one process", one)):
        errors = []
        for i, (a, b) in enumerate(zip(got, ref)):
            b = b.detach().double() if i == 5 else shard(b.detach().double())
            a = a.detach().double()
            assert torch.equal(torch.isinf(a), torch.isinf(b)), name  # rows that see nothing agree
            a, b = torch.where(torch.isinf(b), 0, a), torch.where(torch.isinf(b), 0, b)
            errors.append(((a - b).abs().max() / b.abs().max()).item())
        worst[name] = max(errors)
    worst["stats"] = stats
    return worst


def _apply_cp_keeps_the_window() -> tuple[list[str], float]:
    """A model with a windowed and a full slot under apply_cp: each cp module keeps its slot's window, and
    the forward with sinks (positions as the model passes them) equals one process's CausalAttention."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = torch.nn.ModuleDict({"local": CausalAttention(window=5), "full": CausalAttention()})
    apply_cp(model, init_device_mesh("cpu", (size,)), "ring", slots="*")
    g = torch.Generator().manual_seed(9)
    S = 2 * size * CHUNK
    q, k, v = (
        torch.randn(1, 4, S, 16, generator=g),
        torch.randn(1, 2, S, 16, generator=g),
        torch.randn(1, 2, S, 8, generator=g),
    )
    sinks = torch.randn(4, generator=g)
    positions = _positions(S, [11])[:1]
    shard = lambda t: zigzag_shard(t, 2, rank, size)  # noqa: E731
    got = model["local"](shard(q), shard(k), shard(v), zigzag_shard(positions, 1, rank, size), sinks=sinks)
    want = CausalAttention(window=5)(q, k, v, positions, sinks=sinks)
    return [repr(model["local"]), repr(model["full"])], (got - shard(want)).abs().max().item()


def _cases_in_turn(cases: dict) -> dict:
    results = {name: _case_vs_full(*args) for name, args in cases.items()}
    results["apply_cp"] = _apply_cp_keeps_the_window()
    return results


# name: (method, window, sinks, documents, value head dim, seed)
CP2 = {
    f"{method}-{name}": (method, *args)
    for method in ("ring", "allgather")
    for name, args in {
        "window-in-a-chunk": (3, False, False, 16, 1),
        "window-across-chunks": (13, False, False, 8, 2),
        "sinks": (None, True, False, 8, 3),
        "window+sinks+documents": (5, True, True, 16, 4),
        "window-across+documents": (13, False, True, 8, 5),
    }.items()
}


@pytest.fixture(scope="module")
def cp2_results():
    return run_ranks(_cases_in_turn, 2, CP2, timeout=240)[0]  # one spawn for every cp2 row


@pytest.mark.parametrize("case", sorted(CP2))
def test_cp2_equals_one_process_and_the_definition(cp2_results, case):
    worst = cp2_results[case]
    assert worst["definition"] < 1e-5 and worst["one process"] < 1e-5, worst


def test_a_ring_on_four_ranks_skips_the_steps_outside_the_window():
    """cp4, chunks of 8, a window of 3: rank 0 (chunks 0 and 7) reaches only chunk 6 besides its own (step 3);
    steps 1 and 2 are skipped, yet every rank equals one process."""
    results = run_ranks(_case_vs_full, 4, "ring", 3, True, False, 16, 6, timeout=240)
    for rank, worst in enumerate(results):
        assert worst["definition"] < 1e-5 and worst["one process"] < 1e-5, (rank, worst)
    # rank 0 computes chunk 0 and chunk 7 on their own diagonals (step 0) and chunk 7 over chunk 6 (step 3): 3 blocks
    assert results[0]["stats"] == {"ring_steps": 4, "ring_steps_skipped": 2, "blocks": 3}, results[0]["stats"]
    assert sum(r["stats"]["ring_steps_skipped"] for r in results) == sum(  # every rank: the plan's empty steps
        sum(not blocks for blocks in _ring_plan(r, 4, True, 2 * CHUNK, 3)) for r in range(4)
    )


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_the_ring_plan_covers_exactly_the_pairs_the_window_shows(size, chunk, data):
    """Every (query, key) pair the window shows is in exactly one block of one step at its true offset, and a
    step is skipped only when its K/V show this rank's queries nothing."""
    window = data.draw(st.integers(1, 2 * size * chunk + 2))
    rank = data.draw(st.integers(0, size - 1))
    S, local = 2 * size * chunk, 2 * chunk
    mine = zigzag_indices(S, rank, size)
    covered = torch.zeros(local, S, dtype=torch.int64)
    plan = _ring_plan(rank, size, True, local, window)
    for step, blocks in enumerate(plan):
        theirs = zigzag_indices(S, (rank - step) % size, size)
        for rows, cols, causal, q_offset in blocks:
            qp, kp = mine[rows], theirs[cols]
            assert causal and q_offset == int(qp[0] - kp[0])  # row i at key position i + q_offset
            i, j = torch.arange(len(qp)).view(-1, 1), torch.arange(len(kp)).view(1, -1)
            shown = (j <= i + q_offset) & (i + q_offset - j < window)
            covered[rows.start + i, kp.view(1, -1)] += shown.long() * torch.ones_like(i)
        if not blocks:
            assert not (
                (theirs.view(1, -1) <= mine.view(-1, 1)) & (mine.view(-1, 1) - theirs.view(1, -1) < window)
            ).any()
    p, j = mine.view(-1, 1), torch.arange(S).view(1, -1)
    assert torch.equal(covered, ((j <= p) & (p - j < window)).long())


def test_apply_cp_keeps_each_slots_window_and_sinks_come_with_the_call(cp2_results):
    reprs, error = cp2_results["apply_cp"]
    assert "window=5" in reprs[0] and "window" not in reprs[1], reprs
    assert error < 1e-5


def test_a_bad_window_or_sinks_under_cp_is_one_line():
    with pytest.raises(ValueError, match=r"^window=0 must be .*; use a positive number of tokens or None$"):
        ContextParallelAttention(None, window=0)  # type: ignore[arg-type]
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    for fn in (ring_attention, allgather_attention):
        with pytest.raises(ValueError, match=r"sinks \(2,\) must be one logit per query head, \(4,\)"):
            fn(q, kv, kv, None, sinks=torch.zeros(2))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"window=4 needs causal=True"):
            fn(q, kv, kv, None, causal=False, window=4)  # type: ignore[arg-type]
