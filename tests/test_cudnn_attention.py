"""cuDNN's attention on Hopper: which calls the dispatcher sends to it, and that those are exactly the calls
torch's SDPA computes as flash_attention defines them.

No GPU here: `applies` and the routing run on fake CUDA tensors (FakeTensorMode makes tensors that say they
are on cuda:0 without a device), and SDPA's semantics are checked with the same call on CPU in float64
against the float64 definition (naive_attention). The GPU errors against float64 are
benchmarks/bench_attention_accuracy.py's `tessera_auto` rows.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.kernels import cudnn_attention, dispatch, naive_attention

HOPPER = (9, 0)


@contextlib.contextmanager
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def fake_cuda(shape_q, shape_kv, dtype=torch.bfloat16, dv=None):
    """q, k, v that report cuda:0 (no device needed), v's head dim `dv` if given."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(shape_q, device="cuda", dtype=dtype)
        k = torch.empty(shape_kv, device="cuda", dtype=dtype)
        v = torch.empty((*shape_kv[:-1], dv or shape_kv[-1]), device="cuda", dtype=dtype)
    return q, k, v


calls = st.fixed_dictionaries(
    {
        "heads": st.sampled_from([(4, 4), (4, 2), (8, 1)]),
        "sq": st.integers(1, 24),
        "sk": st.integers(1, 24),
        "d": st.sampled_from([8, 16, 24]),
        "causal": st.booleans(),
        "window": st.one_of(st.none(), st.integers(1, 8)),
        "offset": st.one_of(st.none(), st.integers(0, 24)),
        "scale": st.one_of(st.none(), st.floats(0.05, 2.0)),
    }
)


@settings(max_examples=60, deadline=None)
@given(calls)
def test_every_call_it_admits_sdpa_computes_as_flash_attention_defines(c):
    (hq, hkv), sq, sk, d = c["heads"], c["sq"], c["sk"], c["d"]
    offset = c["offset"] if c["offset"] is None else min(c["offset"], sk)
    q, k, v = fake_cuda((1, hq, sq, d), (1, hkv, sk, d))
    admitted = cudnn_attention.applies(q, k, v, c["causal"], c["window"], offset, HOPPER)
    if c["window"] is not None or (c["causal"] and sq != sk) or offset not in (None, sk - sq):
        assert not admitted
    if not admitted:
        return
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((1, hq, sq, d), *[(1, hkv, sk, d)] * 2))
    # the very call the dispatcher makes (on CPU its SDPA runs torch's CPU kernels: the same definition)
    got = cudnn_attention.cudnn_attention(q, k, v, c["causal"], c["scale"])
    want = naive_attention(q, k, v, c["causal"], c["scale"])[0]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_causal_with_sq_not_sk_is_where_sdpa_differs():
    """Why the rule refuses causal calls with Sq != Sk: SDPA's causal mask is top-left, ours bottom-right."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(sdpa, naive_attention(q, k, v, True)[0])
    assert not cudnn_attention.applies(*fake_cuda((1, 2, 4, 8), (1, 2, 9, 8)), True, None, None, HOPPER)


@pytest.mark.parametrize(
    "case, admitted",
    [
        ({}, True),
        ({"capability": (8, 0)}, False),  # Ampere: the Triton kernel (cuDNN not measured there)
        ({"capability": None}, False),
        ({"dtype": torch.float32}, False),
        ({"d": 256}, False),  # above cuDNN's training head dims
        ({"d": 12}, False),  # not a multiple of 8
        ({"dv": 32}, False),  # MLA's value head dim
        ({"window": 16}, False),
        ({"deterministic": True}, False),  # cuDNN's backward is not deterministic in torch; the kernel's is
    ],
)
def test_the_rule_on_a_training_steps_call(case, admitted):
    d = case.get("d", 64)
    q, k, v = fake_cuda((2, 8, 32, d), (2, 2, 32, d), case.get("dtype", torch.bfloat16), case.get("dv"))
    capability = case.get("capability", HOPPER)
    deterministic = case.get("deterministic", False)
    assert cudnn_attention.applies(q, k, v, True, case.get("window"), None, capability, deterministic) is admitted


def test_the_dispatcher_sends_plain_calls_to_cudnn_and_the_rest_to_the_kernel(monkeypatch):
    pytest.importorskip("triton")
    from tessera.kernels import triton_attention

    route: list[str] = []
    monkeypatch.setattr(cudnn_attention, "device_capability", lambda device: HOPPER)
    monkeypatch.setattr(cudnn_attention, "cudnn_attention", lambda q, k, v, causal, scale: route.append("cudnn") or q)

    def kernel(q, k, v, causal, scale, q_docs, k_docs, window, q_offset):
        route.append("triton")
        return q, q.new_zeros(q.shape[:3], dtype=torch.float32)  # (out, lse): the routing is what is tested

    monkeypatch.setattr(triton_attention, "attention", kernel)
    mode = FakeTensorMode()
    with mode:  # every op on the fake tensors inside the mode that made them
        q = torch.empty(1, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.empty(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        docs = torch.zeros(1, 16, dtype=torch.int64, device="cuda")
        cases = [
            ({}, "cudnn"),
            ({"causal": False}, "cudnn"),
            ({"return_lse": True}, "triton"),  # context parallel's ring: a differentiable LSE
            ({"q_docs": docs}, "triton"),  # packed documents
            ({"window": 8}, "triton"),
            ({"q_offset": 4}, "triton"),
            ({"backend": "triton"}, "triton"),  # --kernels triton: every call in the kernel
            ({"sinks": torch.zeros(4, device="cuda")}, "triton"),  # gpt-oss: the sinks need the LSE
        ]
        for kwargs, want in cases:
            route.clear()
            dispatch.flash_attention(q, k, v, **kwargs)
            assert route == [want], kwargs
        for q2, k2, v2 in (
            [t.float() for t in (q, k, v)],  # fp32
            (torch.empty(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16), k, v),  # causal, Sq != Sk: top-left
        ):
            route.clear()
            dispatch.flash_attention(q2, k2, v2)
            assert route == ["triton"]
        route.clear()
        with deterministic_algorithms():
            dispatch.flash_attention(q, k, v)
        assert route == ["triton"]
    dispatch.set_default_backend("triton")
    try:
        route.clear()
        with mode:
            dispatch.flash_attention(q, k, v)
        assert route == ["triton"]
    finally:
        dispatch.set_default_backend(None)
