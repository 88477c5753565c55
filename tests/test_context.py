"""Context parallel: the zigzag layout and the log-sum-exp merge (property tests), ring and all-gather
attention against full attention (multi-rank, forward and backward, against a float64 definition and
the fp32 kernel), and the CLI. The training contract rows live in tests/test_contract.py."""

import json

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import flash_attention, naive_attention
from tessera.parallel.context import (
    allgather_attention,
    causal_pairs,
    merge_partial,
    ring_attention,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)
from tessera.launching.launch import run_ranks
from helpers import cli_here


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 2))
def test_zigzag_unshard_inverts_shard_and_positions_travel_with_tokens(size, chunk, dim):
    seq = 2 * size * chunk
    shape = [3, 2, 5]
    shape[dim] = seq
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    shards = [zigzag_shard(x, dim, r, size) for r in range(size)]
    assert torch.equal(zigzag_unshard(shards, dim), x)
    positions = torch.arange(seq)
    for r in range(size):
        assert torch.equal(zigzag_indices(seq, r, size), zigzag_shard(positions, 0, r, size))
        assert torch.equal(shards[r], x.index_select(dim, zigzag_indices(seq, r, size)))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.data())
def test_merging_partial_blocks_in_any_order_and_grouping_is_the_softmax_over_all(keys, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    scores = torch.randn(3, keys, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(keys, 5, generator=gen, dtype=torch.float64)
    masked_row = data.draw(st.booleans())
    if masked_row:  # row 0 sees only the first key: every other block is fully masked for it
        scores[0, 1:] = float("-inf")
    cuts = sorted(data.draw(st.sets(st.integers(1, keys - 1), max_size=keys - 1)))
    bounds = list(zip([0] + cuts, cuts + [keys]))

    def block(a, b):
        s = scores[:, a:b]
        lse = torch.logsumexp(s, -1)
        out = torch.where(torch.isneginf(lse)[:, None], 0.0, torch.softmax(s, -1).nan_to_num(0.0) @ values[a:b])
        return out, lse

    parts = [block(a, b) for a, b in bounds]
    order = data.draw(st.permutations(range(len(parts))))
    groups: list = [parts[i] for i in order]
    while len(groups) > 1:  # merge a random adjacent pair until one remains: any grouping
        i = data.draw(st.integers(0, len(groups) - 2))
        groups[i : i + 2] = [merge_partial(*groups[i], *groups[i + 1])]
    out, lse = groups[0]
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, rtol=1e-12, atol=1e-12)
    assert not torch.isnan(out).any()


def test_a_row_no_block_shows_a_key_stays_zero_without_nan():
    out = torch.zeros(2, 3)
    lse = torch.full((2,), float("-inf"))
    block_out, block_lse = torch.zeros(2, 3), torch.tensor([float("-inf"), 0.5])
    merged, merged_lse = merge_partial(out, lse, block_out.clone(), block_lse)
    assert torch.isneginf(merged_lse[0]) and torch.equal(merged[0], torch.zeros(3)) and not merged.isnan().any()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64))
def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not(size, chunk):
    seq = 2 * size * chunk
    zigzag = causal_pairs(seq, size, "zigzag")
    assert max(zigzag) - min(zigzag) <= chunk  # exactly equal, in fact: chunks i and 2 size - 1 - i
    assert len(set(zigzag)) == 1 and sum(zigzag) == seq * (seq + 1) // 2
    contiguous = causal_pairs(seq, size, "contiguous")
    assert sum(contiguous) == sum(zigzag)
    if size > 1:  # the last rank does (2 size - 1) / 1 times the first one's work, nearly
        assert contiguous[-1] > contiguous[0] and contiguous == sorted(contiguous)


def _ring_vs_full(method, use_lse, causal, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    S = 2 * size * 5
    q = torch.randn(2, 4, S, 16, generator=gen, dtype=dtype)  # 4 query heads over 2 kv heads
    k, v = torch.randn(2, 2, S, 16, generator=gen, dtype=dtype), torch.randn(2, 2, S, 16, generator=gen, dtype=dtype)
    dout, dlse = torch.randn(2, 4, S, 16, generator=gen, dtype=dtype), torch.randn(2, 4, S, generator=gen)
    if not use_lse:  # the model's case: only the output is used (the kernels' path without an LSE gradient)
        dlse = torch.zeros_like(dlse)

    def full(fn, cast):
        q_, k_, v_ = (t.to(cast).clone().requires_grad_() for t in (q, k, v))
        o, lse = fn(q_, k_, v_)
        ((o * dout.to(cast)).sum() + (lse * dlse.to(lse.dtype)).sum()).backward()
        return [t.detach() for t in (o, lse, q_.grad, k_.grad, v_.grad)]

    definition = full(lambda q_, k_, v_: naive_attention(q_, k_, v_, causal), torch.float64)
    kernel = full(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, return_lse=True), dtype)
    shard = lambda t: zigzag_shard(t, 2, rank, size)  # noqa: E731
    q_, k_, v_ = (shard(t).clone().requires_grad_() for t in (q, k, v))
    fn = ring_attention if method == "ring" else allgather_attention
    o, lse = fn(q_, k_, v_, dist.group.WORLD, causal=causal, return_lse=True)
    ((o * shard(dout)).sum() + ((lse * shard(dlse)).sum() if use_lse else 0)).backward()
    got = [o, lse, q_.grad, k_.grad, v_.grad]
    worst = {}
    for name, ref in (("definition", definition), ("kernel", kernel)):
        worst[name] = max(
            ((g.double() - shard(r).double()).abs().max() / shard(r).double().abs().max()).item()
            for g, r in zip(got, ref)
        )
    return worst


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("use_lse", [True, False], ids=["out+lse", "out"])
def test_context_attention_equals_full_attention_sharded(method, size, causal, use_lse):
    for worst in run_ranks(_ring_vs_full, size, method, use_lse, causal, torch.float32, timeout=120):
        # out, lse, dq, dk, dv against the float64 definition and against the fp32 kernel on the whole sequence
        assert worst["definition"] < 1e-5 and worst["kernel"] < 1e-5, worst


def test_cli_trains_with_context_parallel(tmp_path):
    from helpers import small_config
    from tessera.training.run import train

    reference = [m["loss"] for m in train(small_config(steps=2))]
    metrics = tmp_path / "cp.jsonl"
    args = [
        "--model",
        "debug",
        "--cp",
        "2",
        "--cp-method",
        "allgather",
        "--dp",
        "2",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        "--metrics",
        str(metrics),
        "--device",
        "cpu",
    ]
    out = cli_here("train", *args)
    assert out.returncode == 0, out.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()[1:]]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, reference, strict=True))
    assert "cp2" in out.stdout


def _cp_rank_one_never_answers():
    import time

    from tessera.parallel.comm import CollectiveTimeout

    q = k = v = torch.randn(1, 2, 8, 4)
    if dist.get_rank() == 1:
        time.sleep(6)  # stays out of the ring until rank 0 has given up
        return None
    try:
        ring_attention(q, k, v, dist.group.WORLD, causal=True, timeout=2.0)
    except CollectiveTimeout as e:
        return str(e)
    return "no timeout"


def test_a_ring_peer_that_never_answers_fails_naming_the_rank_axis_and_step():
    message = run_ranks(_cp_rank_one_never_answers, 2, timeout=60)[0]
    assert message.startswith("rank 0 stalled in ring K/V over the cp axis"), message
