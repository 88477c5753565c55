"""Attention variants any model may use -- a value head dim other than q/k's (DeepSeek-V3's MLA), a sliding
window (gpt-oss, Mistral) and attention sinks (gpt-oss) -- on every path (the torch paths the dispatcher picks
on CPU, the blockwise reference at small blocks, the Triton kernels under the interpreter), composed with
grouped-query heads, Sq != Sk and packed documents, against a float64 definition written here."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import apply_sinks, dispatch, flash_attention, flash_attention_backward
from tessera.kernels.attention_reference import attention_backward_reference, attention_reference, key_range
from tessera.models.layers import CausalAttention

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under TRITON_INTERPRET=1"
)


def definition(q, k, v, causal, window=None, sinks=None, q_docs=None, k_docs=None, q_offset=None):
    """Attention as defined, in float64, with every mask explicit: query i sits at key position
    p = i + q_offset (default Sk - Sq) and sees key j iff j <= p (causal), p - j < window, and both lie in
    one document; the sink logit s_h joins the softmax's denominator with no value. Returns (out, lse)
    with lse over the keys and the sink; a row with nothing (no key, no sink) gives 0 and lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    p = torch.arange(Sq).view(-1, 1) + (Sk - Sq if q_offset is None else q_offset)
    j = torch.arange(Sk).view(1, -1)
    visible = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        visible = visible & (j <= p)
    if window is not None:
        visible = visible & (p - j < window)
    if q_docs is not None:
        visible = visible & (q_docs[:, None, :, None] == k_docs[:, None, None, :])
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    weights = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return weights[..., :Sk] @ v, lse


def _case(B, Hq, Hkv, Sq, Sk, D, Dv, dtype, seed, sinks=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = make(B, Hq, Sq, D), make(B, Hkv, Sk, D), make(B, Hkv, Sk, Dv)
    s = (make(Hq) * 2).requires_grad_() if sinks else None
    return [t.requires_grad_() for t in (q, k, v)], s, make(B, Hq, Sq, Dv), make(B, Hq, Sq)


def _grads(o, lse, do, dlse, tensors):
    seen = torch.isfinite(lse)  # rows that see nothing have lse -inf and no gradient through it
    acc = torch.promote_types(o.dtype, torch.float32)
    loss = (o.to(acc) * do.to(acc)).sum() + (torch.where(seen, lse, 0) * dlse.to(lse.dtype)).sum()
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def _want(qkv, sinks, do, dlse, causal, window, docs, q_offset=None):
    args = [t.detach().double().requires_grad_() for t in qkv]
    s = None if sinks is None else sinks.detach().double().requires_grad_()
    o, lse = definition(*args, causal, window, s, *(docs or (None, None)), q_offset=q_offset)
    grads = _grads(o, lse, do.double(), dlse.double(), [*args] + ([s] if s is not None else []))
    return [o.detach(), lse.detach(), *grads]


def _close(got, want, tol, names=("out", "lse", "dq", "dk", "dv", "dsinks")):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def _docs(B, S, cuts):
    ids = torch.zeros(S, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids.expand(B, S).contiguous()


variant = st.fixed_dictionaries(
    {
        "heads": st.sampled_from([(2, 1), (2, 2), (4, 2)]),
        "sq": st.integers(1, 40),
        "sk": st.integers(1, 40),
        "dims": st.sampled_from([(8, 8), (16, 8), (8, 24), (24, 16)]),
        "window": st.one_of(st.none(), st.integers(1, 45)),
        "sinks": st.booleans(),
        "causal": st.booleans(),
        "docs": st.one_of(st.none(), st.lists(st.integers(1, 39), max_size=3)),
        "seed": st.integers(0, 1000),
    }
)


def _draw(c, dtype=torch.float32):
    causal = c["causal"] or c["window"] is not None
    sk = c["sk"]
    docs = None
    if c["docs"] is not None:  # documents over one sequence: queries and keys are the same tokens
        sk = c["sq"]
        ids = _docs(2, sk, sorted({x for x in c["docs"] if x < sk}))
        docs = (ids, ids)
    qkv, sinks, do, dlse = _case(2, *c["heads"], c["sq"], sk, *c["dims"], dtype, c["seed"], c["sinks"])
    return qkv, sinks, do, dlse, causal, c["window"], docs


@settings(max_examples=60, deadline=None)
@given(variant, st.sampled_from([None, "torch"]), st.sampled_from([torch.float32, torch.float64]), st.booleans())
def test_cpu_paths_match_the_definition(c, backend, dtype, use_lse):
    """What a model calls (out only: the fused CPU path where it applies) and what ring attention calls
    (out and a differentiable lse), forward and the gradients of q, k, v and the sinks."""
    qkv, sinks, do, dlse, causal, window, docs = _draw(c, dtype)
    if not use_lse:
        dlse = torch.zeros_like(dlse)
    q_docs, k_docs = docs or (None, None)
    kw = dict(causal=causal, backend=backend, window=window, sinks=sinks, q_docs=q_docs, k_docs=k_docs)
    if use_lse:
        o, lse = flash_attention(*qkv, return_lse=True, **kw)
    else:
        o = flash_attention(*qkv, **kw)
        lse = definition(*qkv, causal, window, sinks, q_docs, k_docs)[1].to(o.dtype)  # no gradient: dlse is 0
    tensors = [*qkv] + ([sinks] if sinks is not None else [])
    got = [o.detach(), lse.detach(), *_grads(o, lse, do, dlse, tensors)]
    want = _want(qkv, sinks, do, dlse, causal, window, docs)
    assert o.shape == (*qkv[0].shape[:3], qkv[2].shape[-1])
    _close(got, want, 1e-10 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 2, 24, 24, True), (2, 2, 9, 9, True), (4, 1, 7, 19, False)])
def test_sinks_on_the_fused_cpu_path_match_the_definition(monkeypatch, shape, dtype):
    """The model's call with sinks (no lse asked, no window, one head dim) runs ATen's fused op with its
    own backward, not the reference: out and the q, k, v and sinks gradients against the definition."""
    hq, hkv, sq, sk, causal = shape
    monkeypatch.setattr(dispatch, "attention_reference", None)  # would fail if called
    qkv, sinks, do, _ = _case(2, hq, hkv, sq, sk, 16, 16, dtype, 11, sinks=True)
    o = flash_attention(*qkv, causal=causal, sinks=sinks)
    got = [o.detach(), *torch.autograd.grad((o * do).sum(), [*qkv, sinks])]
    want = _want(qkv, sinks, do, torch.zeros(do.shape[:3]), causal, None, None)
    _close(got, [want[0], *want[2:]], 1e-10 if dtype == torch.float64 else 1e-5, ("out", "dq", "dk", "dv", "dsinks"))


@settings(max_examples=40, deadline=None)
@given(variant, st.integers(1, 8), st.integers(-20, 20))
def test_the_blockwise_reference_at_small_blocks_and_any_q_offset(c, block, shift):
    """Small blocks make the window's skipped key blocks and the query blocks' edges real; q_offset places
    the queries anywhere among the keys (ring attention's blocks). The backward given the definition's
    out and lse is the definition's gradient."""
    qkv, _, do, dlse, causal, window, docs = _draw(c, torch.float64)
    q_offset = qkv[1].shape[2] - qkv[0].shape[2] + shift
    q_docs, k_docs = docs or (None, None)
    kw = dict(q_docs=q_docs, k_docs=k_docs, window=window, q_offset=q_offset)
    o, lse = attention_reference(*qkv, causal, None, block, **kw)
    want = _want(qkv, None, do, dlse, causal, window, docs, q_offset)
    grads = attention_backward_reference(do, *qkv, want[0], want[1], dlse, causal, None, block, **kw)
    _close([o, lse, *grads], want, 1e-10)
    # and the dispatcher with the same q_offset (one document at a time where there are documents)
    for backend in (None, "torch"):
        o, lse = flash_attention(*qkv, causal, return_lse=True, backend=backend, **kw)
        grads = flash_attention_backward(do, *qkv, want[0], want[1], dlse, causal, backend=backend, **kw)
        _close([o, lse, *grads], want, 1e-10)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 60),
    st.integers(1, 60),
    st.integers(-30, 30),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 20)),
)
def test_key_range_holds_every_visible_key_and_no_block_wholly_hidden(r0, length, offset, causal, window):
    sk, r1 = 50, r0 + length
    lo, hi = key_range((r0, r1), sk, causal, window, offset)
    p = torch.arange(r0, r1).view(-1, 1) + offset
    j = torch.arange(sk).view(1, -1)
    visible = torch.ones(r1 - r0, sk, dtype=torch.bool)
    if causal:
        visible &= j <= p
    if window is not None:
        visible &= p - j < window
    seen = visible.any(0).nonzero().flatten()
    if len(seen) == 0:
        assert lo >= hi
    else:  # exactly the span of the keys some row sees: the first and the last of the range are seen
        assert (lo, hi) == (int(seen[0]), int(seen[-1]) + 1)


def test_sinks_merge_is_the_sink_softmax_and_an_empty_row_gives_zero_without_nan():
    o = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    lse = torch.tensor([[[0.5, float("-inf"), -1.0], [2.0, 0.0, float("-inf")]]], dtype=torch.float64)
    lse.requires_grad_()
    sinks = torch.tensor([0.3, -2.0], dtype=torch.float64, requires_grad=True)
    o2, lse2 = apply_sinks(o, lse, sinks)
    torch.testing.assert_close(lse2, torch.logaddexp(lse, sinks.view(1, 2, 1)))
    torch.testing.assert_close(o2, o * torch.exp(lse - lse2).unsqueeze(-1))
    assert torch.equal(o2[0, 0, 1], torch.zeros(4)) and torch.equal(o2[0, 1, 2], torch.zeros(4))
    (o2.sum() + lse2.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (o, lse, sinks))
    torch.autograd.gradcheck(
        lambda a, b, c: apply_sinks(a, b, c), (o, lse.detach().clamp(min=-5).requires_grad_(), sinks)
    )


def test_a_row_that_sees_no_key_with_a_sink_gives_zero_and_the_sinks_lse():
    (q, k, v), sinks, do, _ = _case(1, 2, 1, 6, 3, 8, 4, torch.float32, 0, sinks=True)
    o, lse = flash_attention(q, k, v, causal=True, window=2, sinks=sinks, return_lse=True)  # rows 0-2 see nothing
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))
    torch.testing.assert_close(lse[0, :, :3], sinks.detach().view(2, 1).expand(2, 3))
    (o * do).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))


def test_bad_window_and_sinks_are_one_clear_line():
    q = torch.randn(1, 4, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"^window=0 must be .*; use a positive number of tokens or None$"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match=r"^window=-3 must"):
        flash_attention_backward(q, q, k, v, q, q[..., 0], window=-3)
    with pytest.raises(ValueError, match=r"window=4 needs causal=True"):
        flash_attention(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match=r"sinks \(2,\) must be one logit per query head, \(4,\)"):
        flash_attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"k and v must have the same shape but for the head dim"):
        flash_attention(q, k, torch.randn(1, 2, 7, 16))
    with pytest.raises(ValueError, match=r"^window=0 must"):
        CausalAttention(window=0)
    assert "window=128" in repr(CausalAttention(window=128))


def test_causal_attention_slot_passes_window_and_sinks():
    (q, k, v), sinks, _, _ = _case(2, 4, 2, 12, 12, 16, 8, torch.float32, 3, sinks=True)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]).expand(2, 12)
    docs = torch.tensor([0] * 5 + [5] * 7).expand(2, 12)
    got = CausalAttention(window=3)(q, k, v, positions, sinks=sinks)
    want = definition(q, k, v, True, 3, sinks, docs, docs)[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got = CausalAttention()(q, k, v, torch.arange(12))
    torch.testing.assert_close(got.double(), definition(q, k, v, True)[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the Triton kernels (interpreted)
@interpreted
@settings(max_examples=12, deadline=None)
@given(variant, st.integers(-8, 8), st.booleans())
def test_triton_kernels_match_the_definition(c, shift, explicit_offset):
    """Forward and both backward kernels (fp32, the interpreter's 16 x 16 tiles): windows shorter and longer
    than a tile, Dv != D, sinks, GQA, documents, and q_offset away from bottom-right (ring blocks)."""
    qkv, sinks, do, dlse, causal, window, docs = _draw(c)
    q_offset = qkv[1].shape[2] - qkv[0].shape[2] + shift if explicit_offset else None
    q_docs, k_docs = docs or (None, None)
    kw = dict(q_docs=q_docs, k_docs=k_docs, window=window, q_offset=q_offset)
    o, lse = flash_attention(*qkv, causal, return_lse=True, backend="triton", sinks=sinks, **kw)
    tensors = [*qkv] + ([sinks] if sinks is not None else [])
    got = [o.detach(), lse.detach(), *_grads(o, lse, do, dlse, tensors)]
    want = _want(qkv, sinks, do, dlse, causal, window, docs, q_offset)
    _close(got, want, 1e-4)
    if sinks is None:  # the backward alone, given the definition's softmax (ring attention's call)
        grads = flash_attention_backward(
            do, *qkv, want[0].float(), want[1].float(), dlse, causal, backend="triton", **kw
        )
        _close(grads, want[2:], 1e-4, names=("dq", "dk", "dv"))


@interpreted
def test_triton_window_skips_the_key_blocks_outside_it(monkeypatch):
    """The loops' bounds, not only the masks: with a window of one token and keys poisoned with NaN outside
    every query tile's reach, nothing NaN is loaded (a masked load of a NaN block would still poison)."""
    (q, k, v), _, do, _ = _case(1, 2, 1, 64, 64, 16, 16, torch.float32, 5)
    q, k, v = (t.detach() for t in (q, k, v))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :32], v2[:, :, :32] = float("nan"), float("nan")  # queries 48..63 (the last tile) never reach them
    o = flash_attention(q[:, :, 48:], k2, v2, causal=True, window=16, backend="triton")
    want = definition(q[:, :, 48:], k, v, True, 16)[0]
    torch.testing.assert_close(o.double(), want, rtol=1e-4, atol=1e-4)
    # and backward: the dq kernel reads only keys 32..63, the dk/dv kernel of keys 0..31 no query row
    o, lse = definition(q[:, :, 48:], k, v, True, 16)
    dq, dk, dv = flash_attention_backward(
        do[:, :, 48:], q[:, :, 48:], k2, v2, o.float(), lse.float(), causal=True, window=16, backend="triton"
    )
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert not dk[:, :, :32].any() and not dv[:, :, :32].any()  # keys no query reaches: untouched, zero


@interpreted
def test_triton_custom_ops_with_window_offset_and_a_value_head_dim_of_its_own():
    from tessera.kernels.triton_attention import flash_attention_bwd, flash_attention_fwd  # lazy: triton is optional

    (q, k, v), _, _, _ = _case(1, 4, 2, 20, 24, 16, 8, torch.float32, 2)
    torch.library.opcheck(flash_attention_fwd, (q, k, v, True, 0.25, None, None, 5, 6))
    # the model's layout: [B, S, H, D] projections transposed to [B, H, S, D], not contiguous
    bshd = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    assert not bshd[2].is_contiguous()
    torch.library.opcheck(flash_attention_fwd, (*bshd, True, 0.25, None, None, 7, None))
    o, lse = flash_attention_fwd(*(t.detach() for t in bshd), True, 0.25, None, None, 7, None)
    assert o.shape == (1, 4, 20, 8) and o.is_contiguous()
    do = torch.randn_like(o).transpose(1, 2).contiguous().transpose(1, 2)
    args = (do, *(t.detach() for t in bshd), o, lse, torch.zeros_like(lse), True, 0.25, None, None, 7, None)
    torch.library.opcheck(flash_attention_bwd, args)
    with torch.device("meta"):
        o, lse = torch.ops.tessera.flash_attention_fwd(
            torch.empty(2, 8, 4096, 192), torch.empty(2, 2, 4096, 192), torch.empty(2, 2, 4096, 128), True, 0.1
        )
        grads = torch.ops.tessera.flash_attention_bwd(
            torch.empty(2, 8, 4096, 128), torch.empty(2, 8, 4096, 192), torch.empty(2, 2, 4096, 192),
            torch.empty(2, 2, 4096, 128), o, lse, lse, True, 0.1, None, None, 128, None,
        )  # fmt: skip
    assert o.shape == (2, 8, 4096, 128) and o.is_contiguous() and lse.shape == (2, 8, 4096)
    assert [tuple(g.shape) for g in grads] == [(2, 8, 4096, 192), (2, 2, 4096, 192), (2, 2, 4096, 128)]


# ----------------------------------------------------------------------------- GPU: the compiled kernels
GPU_CASES = {  # (Hq, Hkv, S, D, Dv, window, sinks, document cuts, q_offset shift)
    "mla-dims+window+sinks": (8, 2, 300, 192, 128, 100, True, None, 0),
    "documents+window+offset": (4, 2, 257, 64, 32, 40, True, [50, 180], -20),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_kernels_match_the_definition(name):
    Hq, Hkv, S, D, Dv, window, sinks, cuts, shift = GPU_CASES[name]
    qkv, s, do, dlse = _case(2, Hq, Hkv, S, S, D, Dv, torch.float32, 0, sinks)
    qkv = [t.detach().cuda().requires_grad_() for t in qkv]
    s = None if s is None else s.detach().cuda().requires_grad_()
    docs = None if cuts is None else (_docs(2, S, cuts).cuda(),) * 2
    q_offset = shift or None
    o, lse = flash_attention(
        *qkv, True, return_lse=True, window=window, sinks=s, q_offset=q_offset, q_docs=docs and docs[0]
    )
    tensors = [*qkv] + ([s] if s is not None else [])
    got = [t.cpu() for t in [o.detach(), lse.detach(), *_grads(o, lse, do.cuda(), dlse.cuda(), tensors)]]
    cpu = lambda ts: [t.detach().cpu() for t in ts]  # noqa: E731
    want = _want(cpu(qkv), None if s is None else s.cpu(), do, dlse, True, window, docs and cpu(docs), q_offset)
    _close(got, want, 2e-3)


@pytest.mark.gpu
def test_gpu_compiled_slot_with_window_sinks_and_transposed_inputs():
    """torch.compile over the slot as gpt-oss and DeepSeek-V3 call it: [B, S, H, D] projections transposed,
    bf16, window and sinks, v's head dim its own; equal to eager (the fakes' shapes and strides are the kernels')."""
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h, d: torch.randn(2, 512, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)  # noqa: E731
    q, k, v = make(8, 192), make(2, 192), make(2, 128)
    sinks = torch.randn(8, device="cuda", generator=g)
    slot = CausalAttention(window=128)
    outs = []
    for fn in (slot, torch.compile(slot)):
        args = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        o = fn(*args[:3], sinks=args[3])
        o.float().square().sum().backward()
        outs.append([o.detach().float(), *(t.grad.float() for t in args)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
