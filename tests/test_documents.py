"""Packed documents, the kernels: document-masked attention on every path (the Triton kernels under the
interpreter, ATen's fused CPU path one document at a time, the blockwise reference) against a naive float64
definition, forward and backward, with document lengths drawn by hypothesis."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import flash_attention, flash_attention_backward, naive_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def docs_from_lengths(lengths: list[int]) -> torch.Tensor:
    """Document ids 0, 0, .., 1, 1, ..: one id per token, a run per document."""
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])


def document_lengths(total: int) -> st.SearchStrategy[list[int]]:
    """Lengths that fill `total` tokens: some documents of one token, some longer than the rest together."""
    return st.lists(st.integers(1, total), min_size=1, max_size=8).map(lambda xs: _fill(xs, total))


def _fill(xs: list[int], total: int) -> list[int]:
    out, left = [], total
    for x in xs:
        if left == 0:
            break
        out.append(min(x, left))
        left -= out[-1]
    if left:
        out.append(left)
    return out


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(B, h, s, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk))
    )
    do = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _naive_grads(q, k, v, do, causal, q_docs, k_docs):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qd, kd, vd, causal, q_docs=q_docs, k_docs=k_docs)
    out.backward(do.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


@settings(max_examples=25, deadline=None)
@given(lengths=st.data(), causal=st.booleans(), seed=st.integers(0, 2**16), gqa=st.booleans())
def test_cpu_document_attention_matches_the_float64_definition(lengths, causal, seed, gqa):
    S = 24
    docs = torch.stack([docs_from_lengths(lengths.draw(document_lengths(S))) for _ in range(2)])
    q, k, v, do = _inputs(2, 4, 2 if gqa else 4, S, S, 8, torch.float32, seed)
    want = _naive_grads(q, k, v, do, causal, docs, docs)
    out, lse = flash_attention(q, k, v, causal, return_lse=True, q_docs=docs)
    out.backward(do)
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want[1], atol=1e-5, rtol=1e-5)
    for got, ref in zip((q.grad, k.grad, v.grad), want[2:]):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_block_with_its_own_docs_and_the_backward_of_a_merged_softmax(backend):
    """A ring step's shapes: queries and keys from different shards (not causal), some queries with no key
    of their document: out 0 and lse -inf, and flash_attention_backward given the softmax's o and lse
    equals the definition's gradients."""
    q, k, v, do = _inputs(1, 2, 2, 8, 6, 8, torch.float64, 3)
    q_docs = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 3]])
    k_docs = torch.tensor([[0, 1, 1, 1, 2, 2]])
    out, lse = flash_attention(q, k, v, causal=False, return_lse=True, backend=backend, q_docs=q_docs, k_docs=k_docs)
    want = _naive_grads(q, k, v, do, False, q_docs, k_docs)
    torch.testing.assert_close(out, want[0])
    assert torch.isneginf(lse[0, :, 5:]).all() and (out[0, :, 5:] == 0).all()
    dq, dk, dv = flash_attention_backward(
        do, q, k, v, out.detach(), lse.detach(), causal=False, backend=backend, q_docs=q_docs, k_docs=k_docs
    )
    for got, ref in zip((dq, dk, dv), want[2:]):
        torch.testing.assert_close(got, ref)


def test_document_ids_are_checked():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"q_docs \(1, 3\) must be \(batch, seq\) = \(1, 4\)"):
        flash_attention(q, q, q, q_docs=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer document ids"):
        flash_attention(q, q, q, q_docs=torch.zeros(1, 4))


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests run under TRITON_INTERPRET=1")
@settings(max_examples=3, deadline=None)
@given(data=st.data(), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_triton_document_attention_matches_the_float64_definition(data, causal, seed):
    """The Triton kernels with document ids (tiles of 16 under the interpreter: documents shorter than a
    tile, across tiles, and tiles skipped whole), forward and backward, grouped-query heads."""
    S = 40
    docs = torch.stack([docs_from_lengths(data.draw(document_lengths(S))) for _ in range(2)])
    q, k, v, do = _inputs(2, 4, 2, S, S, 16, torch.float32, seed)
    want = _naive_grads(q, k, v, do, causal, docs, docs)
    out, lse = flash_attention(q, k, v, causal, return_lse=True, backend="triton", q_docs=docs)
    out.backward(do)
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want[1], atol=1e-5, rtol=1e-5)
    for got, ref in zip((q.grad, k.grad, v.grad), want[2:]):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests run under TRITON_INTERPRET=1")
def test_triton_block_backward_with_empty_rows():
    q, k, v, do = _inputs(1, 2, 1, 20, 18, 16, torch.float32, 5)
    q_docs = torch.tensor([[1] * 7 + [2] * 5 + [4] * 8])
    k_docs = torch.tensor([[0] * 3 + [1] * 10 + [2] * 5])
    want = _naive_grads(q, k, v, do, False, q_docs, k_docs)
    out, lse = flash_attention(q, k, v, causal=False, return_lse=True, backend="triton", q_docs=q_docs, k_docs=k_docs)
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    dq, dk, dv = flash_attention_backward(
        do, q, k, v, out.detach(), lse.detach(), causal=False, backend="triton", q_docs=q_docs, k_docs=k_docs
    )
    for got, ref in zip((dq, dk, dv), want[2:]):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the model on one process
from packing import SEPARATOR, one_process_model, packed_batch, packed_row, run_alone  # noqa: E402

from tessera.data.corpus import IGNORE_INDEX, pack_documents  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(0, 9), min_size=1, max_size=40))
def test_pack_documents_positions_restart_after_each_separator(ids):
    row = torch.tensor([SEPARATOR if i == 0 else i for i in ids])
    targets, positions = pack_documents(row[None], row[None] + 1, SEPARATOR)
    expect, p = [], 0
    for i, token in enumerate(row.tolist()):
        expect.append(p)
        p = 0 if token == SEPARATOR else p + 1
    assert positions[0].tolist() == expect
    assert (targets[0] == IGNORE_INDEX).tolist() == (row == SEPARATOR).tolist()


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_a_packed_batch_equals_each_document_run_alone_on_one_process(data):
    """Per-token losses and gradients of the packed batch through the one-process model (positions per
    document, attention masked to each) equal those of each document run alone, fp32 within 1e-5."""
    S = 48
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows = [packed_row(data.draw(document_lengths(S + 1)), S, g) for _ in range(3)] + [packed_row([S + 20], S, g)]
    inputs, targets, positions = packed_batch(rows)
    model = one_process_model()
    want_losses, want_grads = run_alone(model, inputs, targets, positions)
    model.zero_grad(set_to_none=True)
    logits = model(inputs, positions)
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    torch.testing.assert_close(per_token.detach(), want_losses, atol=1e-5, rtol=1e-5)
    (per_token.sum() / (targets != IGNORE_INDEX).sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_packing_is_refused_for_a_model_that_does_not_pass_positions_to_attention():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import custom_model

    from tessera.training.preflight import check_document_masking

    with pytest.raises(
        ValueError,
        match=r"--pack-documents: GPT calls its attention slots \(blocks\.\*\.attn\.core\) "
        r"without the positions",
    ):
        check_document_masking(custom_model.GPTConfig(), custom_model.GPT_SPEC)
