"""The chunked (fused) linear cross-entropy of tessera.parallel.loss: equal to today's loss on full logits
(cross_entropy_sum, the vocab-parallel loss) and to an independent float64 definition, in value and in
the gradients of h and W; over tp ranks (gloo) equal to one process; the head in the model; its memory."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.launching.launch import run_ranks
from tessera.parallel.loss import (
    CrossEntropySum,
    LinearCrossEntropyHead,
    apply_loss_head,
    check_loss,
    chunk_tokens,
    cross_entropy_sum,
    has_loss_head,
    linear_cross_entropy_sum,
    vocab_parallel_cross_entropy_sum,
)
from tessera.parallel.tensor import copy_to_tp, shard_range
from tessera.topology.shapes import default_chunk_elements


def _problem(n: int, dim: int, vocab: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::5] = -100  # ignored positions
    return h, w, targets


def _float64_definition(h, w, targets, scale=1.0):
    """-sum over valid targets of log_softmax(h @ w^T)[target], naive, in float64; (loss, dh, dw)."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t(), dim=-1)
    valid = targets != -100
    loss = -logp[valid].gather(-1, targets[valid].unsqueeze(-1)).sum()
    (loss * scale).backward()
    return loss.detach(), h64.grad, w64.grad


def _run(fn, h, w, targets, scale=0.37, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    total, count = fn(h, w, targets, **kw)
    (total * scale).backward()
    return total.detach(), count, h.grad, w.grad


def _todays(h, w, targets):
    return cross_entropy_sum(h @ w.t(), targets)


def _close(got, want, rel):
    """Max abs difference within rel x the reference's largest magnitude (1e-6 for fp32)."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item(), f"{err} vs {rel} x {want.abs().max().item()}"


@pytest.mark.parametrize(
    "chunk_elements", [1, 7 * 53, 10 * 53, 10**9], ids=["1-token", "7-of-37", "10-of-37", "one-chunk"]
)
def test_chunked_equals_todays_loss_and_the_float64_definition(chunk_elements):
    h, w, targets = _problem(37, 16, 53)
    loss, count, dh, dw = _run(linear_cross_entropy_sum, h, w, targets, chunk_elements=chunk_elements)
    ref, ref_count, ref_dh, ref_dw = _run(_todays, h, w, targets)
    assert int(count) == int(ref_count) == 37 - 8 and loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    _close(dh, ref_dh, 1e-6)
    _close(dw, ref_dw, 1e-6)
    exact, exact_dh, exact_dw = _float64_definition(h, w, targets, 0.37)
    assert abs(loss.item() - exact.item()) <= 1e-6 * abs(exact.item())
    _close(dh, exact_dh, 1e-6)
    _close(dw, exact_dw, 1e-6)


def test_float64_inputs_stay_float64_and_match_to_1e_12():
    h, w, targets = _problem(29, 8, 31, seed=3, dtype=torch.float64)
    loss, _, dh, dw = _run(linear_cross_entropy_sum, h, w, targets, chunk_elements=4 * 31)
    exact, exact_dh, exact_dw = _float64_definition(h, w, targets, 0.37)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - exact.item()) <= 1e-12 * abs(exact.item())
    _close(dh, exact_dh, 1e-12)
    _close(dw, exact_dw, 1e-12)


def test_bf16_matches_todays_bf16_path_within_bf16_precision():
    h, w, targets = _problem(64, 32, 97, seed=1, dtype=torch.bfloat16)
    loss, _, dh, dw = _run(linear_cross_entropy_sum, h, w, targets, chunk_elements=9 * 97)
    ref, _, ref_dh, ref_dw = _run(_todays, h, w, targets)
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())  # the logits are the same bf16 matmul
    _close(dh, ref_dh, 2**-6)
    _close(dw, ref_dw, 2**-6)


def test_all_targets_ignored_and_evaluation_without_gradients():
    h, w, targets = _problem(10, 4, 7)
    loss, count, dh, dw = _run(linear_cross_entropy_sum, h, w, torch.full_like(targets, -100), chunk_elements=3 * 7)
    assert loss.item() == 0.0 and int(count) == 0 and not dh.any() and not dw.any()
    with torch.no_grad():
        total, _ = linear_cross_entropy_sum(h.requires_grad_(), w, targets, chunk_elements=3 * 7)
    assert not total.requires_grad
    assert total.item() == pytest.approx(_todays(h.detach(), w, targets)[0].item(), rel=1e-6)


def test_backward_hands_its_gradients_over_once_unless_asked_to_keep_them():
    h, w, targets = _problem(12, 4, 9)
    # the reference in the same chunks: bitwise equality across chunk sizes would hold on one CPU's GEMM kernels
    # only (an AMX machine's differ in the last bit between a 5-row and a 12-row dlogits @ w)
    ref, _, ref_dh, ref_dw = _run(linear_cross_entropy_sum, h, w, targets, scale=0.37, chunk_elements=5 * 9)
    for reuse in (False, True):
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        total, _ = linear_cross_entropy_sum(hr, wr, targets, chunk_elements=5 * 9, reuse_backward=reuse)
        (dh,) = torch.autograd.grad(total * 0.37, [hr], retain_graph=True)  # as the zero-bubble B pass
        assert torch.equal(dh, ref_dh)
        if not reuse:
            with pytest.raises(RuntimeError, match="reuse_backward=True"):
                torch.autograd.grad(total * 0.37, [wr])
        else:  # the W pass: the same gradients again
            dh2, dw = torch.autograd.grad(total * 0.37, [hr, wr])
            assert torch.equal(dh2, ref_dh) and torch.equal(dw, ref_dw)


def test_the_chunk_rule():
    assert chunk_tokens(2048, 128256, 2**24) == 128  # 16 even chunks of <= 2^24 fp32 logits
    assert chunk_tokens(37, 53, 7 * 53) == 7  # 6 chunks: 7 x 5 + 2
    assert chunk_tokens(10, 10**6, 16) == 1  # a row wider than the budget: a token at a time
    assert chunk_tokens(10, 5, 10**9) == 10
    for n, v, b in [(1000, 333, 5000), (4097, 128256, 2**24), (3, 2, 1)]:
        c = chunk_tokens(n, v, b)
        assert c == 1 or c * v <= b + v  # within the budget, up to one row of rounding


def test_the_default_chunk_rule_keeps_chunks_few_at_large_batches():
    # the 1b preset on one GPU: 16 x 2048 tokens, dim 2048, vocab 128256. The 2^24 floor alone cut 251 chunks of
    # 130 tokens, and their 251 weight-sized dW additions were 26% of the step on an H200
    assert chunk_tokens(32768, 128256, 2**24) == 131
    assert chunk_tokens(32768, 128256, hidden=2048) == 2048  # 16 chunks, 1 GiB of fp32 logits each
    assert chunk_tokens(2048, 128256, hidden=512) == 128  # small batches keep the 2^24 floor (CPU sizes)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10**6), vocab=st.integers(1, 300_000), hidden=st.integers(1, 16384))
def test_property_default_chunks(n, vocab, hidden):
    """The default budget: within max(2^24, 4 n D) fp32 logits (up to a row), and never more chunks than the
    floor alone cuts nor more than ceil(V / 4D) + 1 once the hidden states outweigh the floor."""
    c = chunk_tokens(n, vocab, hidden=hidden)
    budget = default_chunk_elements(n, hidden)
    assert budget == max(2**24, 4 * n * hidden)
    assert 1 <= c <= n and (c == 1 or c * vocab <= budget + vocab)
    chunks = -(-n // c)
    assert chunks <= -(-n // chunk_tokens(n, vocab, 2**24))
    if 4 * n * hidden >= 2**24:
        assert chunks <= -(-vocab // (4 * hidden)) + 1


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 24),
    dim=st.integers(1, 6),
    vocab=st.integers(1, 19),
    budget=st.integers(1, 400),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_and_chunk_size_matches_float64(n, dim, vocab, budget, seed):
    h, w, targets = _problem(n, dim, vocab, seed, dtype=torch.float64)
    loss, count, dh, dw = _run(linear_cross_entropy_sum, h, w, targets, chunk_elements=budget)
    exact, exact_dh, exact_dw = _float64_definition(h, w, targets, 0.37)
    assert int(count) == int((targets != -100).sum())
    assert loss.item() == pytest.approx(exact.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(dh, exact_dh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dw, exact_dw, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- over tp ranks (gloo)
def _tp_rank(vocab: int, n: int, dim: int, chunk_elements: int, seed: int):
    """This rank's vocab shard of W, h replicated (copy_to_tp sums its gradient); the chunked loss and the
    vocab-parallel loss on full local logits, each with its gradients."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    h, w, targets = _problem(n, dim, vocab, seed)
    start, stop = shard_range(vocab, rank, size)
    out = {}
    for kind in ("chunked", "vocab_parallel"):
        hr, wr = h.clone().requires_grad_(), w[start:stop].clone().requires_grad_()
        x = copy_to_tp(hr, group)
        if kind == "chunked":
            total, count = linear_cross_entropy_sum(
                x, wr, targets, start, group, chunk_elements=chunk_elements, vocab_rows=-(-vocab // size)
            )
        else:
            total, count = vocab_parallel_cross_entropy_sum(x @ wr.t(), targets, start, group)
        (total * 0.37).backward()
        out[kind] = (total.item(), int(count), hr.grad, wr.grad, (start, stop))
    return out


@pytest.mark.parametrize(
    "tp, vocab, chunk_elements",
    [(2, 53, 5 * 27), (4, 53, 3 * 14), (4, 3, 2)],
    ids=["tp2", "tp4-uneven", "tp4-rank-without-columns"],
)
def test_tp_ranks_equal_one_process(tp, vocab, chunk_elements):
    n, dim = 37, 8
    h, w, targets = _problem(n, dim, vocab, 5)
    ref, _, ref_dh, ref_dw = _run(_todays, h, w, targets)
    one, _, one_dh, one_dw = _run(linear_cross_entropy_sum, h, w, targets, chunk_elements=chunk_elements)
    for out in run_ranks(_tp_rank, tp, vocab, n, dim, chunk_elements, 5, timeout=120):
        loss, count, dh, dw, (start, stop) = out["chunked"]
        vp_loss, _, vp_dh, vp_dw, _ = out["vocab_parallel"]
        assert count == n - 8
        for want in (ref.item(), one.item(), vp_loss):
            assert abs(loss - want) <= 1e-6 * abs(want)
        for want in (ref_dh, one_dh, vp_dh):
            _close(dh, want, 1e-6)
        if stop > start:
            for want in (ref_dw[start:stop], one_dw[start:stop], vp_dw):
                _close(dw, want, 1e-6)
        assert dw.shape == (stop - start, dim)


# ----------------------------------------------------------------------------- the head in the model
def test_the_head_in_the_model_keeps_names_and_logits_and_gives_todays_loss():
    from tessera.models import build_model

    model = build_model("debug", seed=0)
    linear_weight = model.output.weight
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, 1)
    targets[:, -1] = -100
    logits = model(tokens)
    with pytest.raises(TypeError, match="apply_loss_head"):
        model(tokens, targets=targets)
    names = [n for n, _ in model.named_parameters()]
    apply_loss_head(model, chunk_elements=5 * 258)
    assert has_loss_head(model) and model.output.weight is linear_weight
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(model(tokens), logits)  # without targets: the logits, as before
    loss_fn = CrossEntropySum(258)
    total, count = loss_fn.model_loss(model, tokens, None, targets)
    total.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref, ref_count = loss_fn(model(tokens), targets)
    ref.backward()
    assert int(count) == int(ref_count) == 30
    assert abs(total.item() - ref.item()) <= 1e-6 * ref.item()
    for n, p in model.named_parameters():
        _close(fused[n], p.grad, 1e-5)


def test_apply_loss_head_leaves_other_models_alone():
    class UserModel(torch.nn.Module):  # forward takes no targets: its own loss, untouched
        def __init__(self):
            super().__init__()
            self.output = torch.nn.Linear(4, 9, bias=False)

        def forward(self, x):
            return self.output(x)

    user = apply_loss_head(UserModel())
    assert isinstance(user.output, torch.nn.Linear) and not has_loss_head(user)
    head = LinearCrossEntropyHead(torch.nn.Parameter(torch.randn(9, 4)))
    x = torch.randn(3, 4)
    assert torch.equal(head(x), F.linear(x, head.weight))


def test_an_unknown_loss_is_one_clear_line():
    assert check_loss("chunked") == "chunked"
    with pytest.raises(ValueError, match=r"unknown loss='fused'; use chunked .* or logits"):
        check_loss("fused")


def _peak_above_inputs(kind: str, n: int, dim: int, vocab: int, chunk_elements: int) -> int:
    from tessera.metrics.memtrack import LiveTensorBytes

    h, w, targets = _problem(n, dim, vocab)
    h.requires_grad_()
    head = LinearCrossEntropyHead(torch.nn.Parameter(w), chunk_elements=chunk_elements)
    tracker = LiveTensorBytes()
    tracker.track(h)
    tracker.track_existing([head])
    inputs = tracker.now
    with tracker:
        total, _ = cross_entropy_sum(head(h), targets) if kind == "logits" else head(h, targets)
        (total * 0.5).backward()
    return tracker.peak - inputs


def test_the_chunked_head_holds_at_least_4x_less_than_full_logits():
    """LiveTensorBytes (as benchmarks/bench_loss_memory.py measures) at a small shape: peak above the inputs."""
    todays = _peak_above_inputs("logits", 512, 16, 4096, 2**16)
    chunked = _peak_above_inputs("chunked", 512, 16, 4096, 2**16)
    assert todays >= 4 * chunked, (todays, chunked)
