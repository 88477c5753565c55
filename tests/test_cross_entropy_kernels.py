"""The chunked loss's softmax kernels (kernels/triton_cross_entropy.py, through the interpreter on CPU) and
their torch reference against a float64 definition written here; the chunked loss run through them (the
path CUDA takes) equal to the float64 definition, to its torch path, and over tp ranks to one process."""

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from test_fused_loss import _close, _float64_definition, _problem
from tessera.kernels import set_default_backend
from tessera.kernels.dispatch import cross_entropy_grad_, cross_entropy_row_stats, fused_cross_entropy
from tessera.launching.launch import run_ranks
from tessera.parallel.loss import linear_cross_entropy_sum
from tessera.parallel.tensor import copy_to_tp, shard_range

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under TRITON_INTERPRET=1"
)
# The interpreter stores bf16 by truncation (compiled Triton rounds to nearest): one bf16 ulp per element.
BF16_ULP = 2.0**-7


def _definition(logits, target, scale):
    """Float64: row max, sum of exp(x - max), and (softmax - onehot(target)) * scale (no onehot for -1)."""
    x = logits.double()
    row_max = x.amax(-1)
    row_sum = torch.exp(x - row_max[:, None]).sum(-1)
    onehot = torch.zeros_like(x)
    has = target >= 0
    onehot[has.nonzero().squeeze(-1), target[has]] = 1.0
    return row_max, row_sum, (torch.softmax(x, -1) - onehot) * scale.double()[:, None]


def _case(rows, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    target = torch.randint(-1, vocab, (rows,), generator=gen)
    scale = torch.rand(rows, generator=gen).round()  # 0 or 1, as the loss's valid mask
    return logits, target, scale


def _check(backend, rows, vocab, dtype, seed=0):
    logits, target, scale = _case(rows, vocab, dtype, seed)
    want_max, want_sum, want_grad = _definition(logits, target, scale)
    row_max, row_sum = cross_entropy_row_stats(logits, backend=backend)
    assert row_max.dtype == row_sum.dtype == torch.float32
    assert torch.equal(row_max.double(), want_max)  # a max is exact
    assert ((row_sum.double() - want_sum).abs() <= 1e-6 * want_sum).all()
    grad = logits.clone()
    cross_entropy_grad_(grad, target, scale, row_max, row_sum, backend=backend)
    assert grad.dtype == dtype
    err = (grad.double() - want_grad).abs()
    bound = 1e-6 if dtype == torch.float32 else BF16_ULP * want_grad.abs() + 1e-6
    assert (err <= bound).all(), err.max().item()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 53, 2049, 4097 + 2048], ids=["V1", "V53", "V2049", "V6145"])
def test_the_kernels_match_the_float64_definition(vocab, dtype):
    _check("triton", 5, vocab, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_torch_reference_matches_the_float64_definition(dtype):
    _check("torch", 5, 300, dtype)


@interpreted
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 6), vocab=st.integers(1, 4200), seed=st.integers(0, 10**6))
def test_property_the_kernels_match_float64_at_any_shape(rows, vocab, seed):
    _check("triton", rows, vocab, torch.float32, seed)


def test_which_path_runs():
    cpu32, cpu64 = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)
    assert not fused_cross_entropy(cpu32)  # CPU by default: the loss's own torch passes
    assert fused_cross_entropy(cpu32, backend="triton") and not fused_cross_entropy(cpu64, backend="triton")
    assert not fused_cross_entropy(cpu32, backend="torch")


# ----------------------------------------------------------------------------- the loss through the kernels
def _run(h, w, targets, backend, scale=0.37, **kw):
    set_default_backend(backend)
    try:
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        total, count = linear_cross_entropy_sum(h, w, targets, **kw)
        (total * scale).backward()
        return total.detach(), int(count), h.grad, w.grad
    finally:
        set_default_backend(None)


@interpreted
@pytest.mark.parametrize("chunk_elements", [7 * 53, 10**9], ids=["7-of-37", "one-chunk"])
def test_the_loss_through_the_kernels_equals_float64_and_its_torch_path(chunk_elements):
    h, w, targets = _problem(37, 16, 53)
    loss, count, dh, dw = _run(h, w, targets, "triton", chunk_elements=chunk_elements)
    ref, ref_count, ref_dh, ref_dw = _run(h, w, targets, None, chunk_elements=chunk_elements)
    exact, exact_dh, exact_dw = _float64_definition(h, w, targets, 0.37)
    assert count == ref_count == 37 - 8 and loss.dtype == torch.float32
    for want, want_dh, want_dw in ((ref, ref_dh, ref_dw), (exact, exact_dh, exact_dw)):
        assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
        _close(dh, want_dh, 1e-6)
        _close(dw, want_dw, 1e-6)


@interpreted
def test_the_loss_through_the_kernels_in_bf16_matches_its_torch_path():
    h, w, targets = _problem(64, 32, 97, seed=1, dtype=torch.bfloat16)
    loss, _, dh, dw = _run(h, w, targets, "triton", chunk_elements=9 * 97)
    ref, _, ref_dh, ref_dw = _run(h, w, targets, None, chunk_elements=9 * 97)
    assert dh.dtype == dw.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())  # the same bf16 logits, fp32 statistics
    _close(dh, ref_dh, 2**-6)
    _close(dw, ref_dw, 2**-6)


def _tp_rank(vocab, n, dim, chunk_elements, seed):
    rank, size = dist.get_rank(), dist.get_world_size()
    h, w, targets = _problem(n, dim, vocab, seed)
    start, stop = shard_range(vocab, rank, size)
    set_default_backend("triton")
    hr, wr = h.clone().requires_grad_(), w[start:stop].clone().requires_grad_()
    total, count = linear_cross_entropy_sum(
        copy_to_tp(hr, dist.group.WORLD),
        wr,
        targets,
        start,
        dist.group.WORLD,
        chunk_elements=chunk_elements,
        vocab_rows=-(-vocab // size),
    )
    (total * 0.37).backward()
    return total.item(), int(count), hr.grad, wr.grad, (start, stop)


@interpreted
@pytest.mark.parametrize(
    "tp, vocab, chunk_elements", [(2, 53, 5 * 27), (4, 3, 2)], ids=["tp2", "tp4-rank-without-columns"]
)
def test_tp_ranks_through_the_kernels_equal_one_process(tp, vocab, chunk_elements):
    n, dim = 37, 8
    h, w, targets = _problem(n, dim, vocab, 5)
    exact, exact_dh, exact_dw = _float64_definition(h, w, targets, 0.37)
    for loss, count, dh, dw, (start, stop) in run_ranks(_tp_rank, tp, vocab, n, dim, chunk_elements, 5, timeout=120):
        assert count == n - 8
        assert abs(loss - exact.item()) <= 1e-6 * abs(exact.item())
        _close(dh, exact_dh, 1e-6)
        if stop > start:
            _close(dw, exact_dw[start:stop], 1e-6)


@interpreted
def test_the_loss_kernels_benchmark_runs_and_records_both_paths(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_loss_kernels

    out = tmp_path / "loss.json"
    results = bench_loss_kernels.main(
        ["--device", "cpu", "--tokens", "48", "--dim", "16", "--vocab", "300", "--repeats", "1", "--out", str(out)]
    )
    assert out.exists() and set(results["paths"]) == {"torch", "triton"}
    assert results["agreement_at_this_size"]["loss_rel_diff"] <= 1e-6
    for path in ("torch", "triton"):
        assert results["float64_check"][path]["loss_rel_error"] <= 1e-4
        assert results["float64_check"][path]["dw_rel_error"] <= 2**-6
