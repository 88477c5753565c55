"""Packed documents on every context-parallel layout: the losses and gradients of a packed batch equal
those of each document run alone through the one-process model (fp32, 1e-5), on cp2, cp4 (ring and
all-gather), cp2 x tp2, cp2 x dp2 and pp2 x cp2. The batch holds a document longer than the whole
sequence, documents shorter than a cp shard, documents aligned with the zigzag chunks' boundaries and
not, and a row whose document lengths hypothesis draws."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from packing import SEED, build_small, one_process_model, packed_batch, packed_row, run_alone

from tessera.models.spec import get_spec
from tessera.launching.launch import run_ranks
from tessera.testing import RunSpec, compare_runs, train_spec_on_layout
from tessera.topology import Layout

S = 32  # cp4: shards of 8 tokens, zigzag chunks of 4

LAYOUTS = [
    (Layout(cp=2), "ring"),
    (Layout(cp=4), "ring"),
    (Layout(cp=4), "allgather"),
    (Layout(cp=2, tp=2), "ring"),
    (Layout(dp_shard=2, cp=2), "ring"),
    (Layout(pp=2, cp=2), "ring"),
]


def batch_with(drawn: list[int]):
    g = torch.Generator().manual_seed(1)
    rows = [
        packed_row([S + 40], S, g),  # one document longer than the whole sequence
        packed_row([4, 4, 8, 4, 12], S, g, ends_open=False),  # ends on the cp4 chunks' boundaries
        packed_row([1, 2, 3, 1, 5, 2, 7, 1, 3, 9], S, g),  # shorter than a shard, unaligned
        packed_row(drawn, S, g),
    ]
    return packed_batch(rows)


@pytest.mark.parametrize("layout,method", LAYOUTS, ids=[f"{lay}-{m}" for lay, m in LAYOUTS])
@settings(max_examples=1, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(st.integers(1, S), min_size=1, max_size=6))
def test_packed_batch_equals_each_document_alone(layout, method, drawn):
    batch = batch_with(drawn)
    model = one_process_model()
    _, grads = run_alone(model, *batch)
    with torch.no_grad():
        logits = model(batch[0], batch[2])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100)
    reference = {"losses": [loss.item()], "grads": [grads]}
    spec = RunSpec(
        build_small,
        layout,
        None,
        batch,
        1,
        0.1,
        SEED,
        None,
        "FULL_SHARD",
        get_spec("llama"),
        microbatches=layout.pp,
        cp_method=method,
    )
    run = run_ranks(train_spec_on_layout, layout.world_size, spec, timeout=120)[0]
    compare_runs(reference, run, f"packed documents on {layout} ({method}), lengths {drawn}", rtol=1e-5)


def _ring_with_documents(seq: int, lengths: list[list[int]]):
    """One cp rank: ring attention with document ids against the float64 definition, and its step counts."""
    import torch.distributed as dist

    from tessera.kernels import document_ids, naive_attention
    from tessera.parallel.context import ring_attention, zigzag_indices, zigzag_shard

    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(len(lengths), h, seq, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    full_docs = document_ids(positions, torch.arange(seq))
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    want, _ = naive_attention(qd, kd, vd, causal=True, q_docs=full_docs, k_docs=full_docs)
    want.backward(do)
    mine = [zigzag_shard(t, 2, rank, size).clone().requires_grad_() for t in (q, k, v)]
    stats: dict = {}
    docs = document_ids(zigzag_shard(positions, 1, rank, size), zigzag_indices(seq, rank, size))
    out = ring_attention(*mine, dist.group.WORLD, causal=True, docs=docs, stats=stats)
    out.backward(zigzag_shard(do, 2, rank, size))
    for got, ref in zip([out] + [t.grad for t in mine], [want, qd.grad, kd.grad, vd.grad]):
        torch.testing.assert_close(got, zigzag_shard(ref, 2, rank, size))
    return stats


@pytest.mark.parametrize(
    "lengths,skipped",
    [
        ([[4] * 8, [2] * 16], 3),  # documents inside the zigzag chunks: every step after the first is skipped
        ([[32], [32]], 0),  # one document: nothing to skip
        ([[6, 10, 3, 13], [1] * 32], None),  # unaligned: whatever the masks allow
    ],
)
def test_ring_skips_exactly_the_steps_no_query_sees(lengths, skipped):
    """cp4, S = 32 (chunks of 4): the ring with documents equals the float64 definition, forward and
    backward, and skips a step exactly when no query of its block shares a document with a key of it
    (counted here from the full mask, independently of the ring's half-block rule)."""
    from tessera.kernels import document_ids
    from tessera.parallel.context import zigzag_indices

    seq, cp = 32, 4
    stats = run_ranks(_ring_with_documents, cp, seq, lengths, timeout=120)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    docs = document_ids(positions, torch.arange(seq))
    for rank, got in enumerate(stats):
        expect = 0
        for step in range(1, cp):
            rows, cols = zigzag_indices(seq, rank, cp), zigzag_indices(seq, (rank - step) % cp, cp)
            sees = (docs[:, rows, None] == docs[:, None, cols]) & (cols[None, None, :] <= rows[None, :, None])
            expect += int(not sees.any())
        assert got == {"ring_steps": cp, "ring_steps_skipped": expect}, (rank, got, expect)
        if skipped is not None:
            assert expect == skipped
