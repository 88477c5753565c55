"""Triton kernels against their torch references: on CPU through the interpreter (small shapes, fp32),
on GPU at real shapes in bf16 (marked gpu; skipped without CUDA)."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import attention_reference, flash_attention, rms_norm, rms_norm_reference

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under TRITON_INTERPRET=1"
)


def _attention_case(B, Hq, Hkv, Sq, Sk, D, causal, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=g, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, generator=g, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, Hq, Sq, D, generator=g, device=device, dtype=dtype)
    dlse = torch.randn(B, Hq, Sq, generator=g, device=device, dtype=torch.float32)
    return q, k, v, do, dlse


def _run(backend, q, k, v, do, dlse, causal, ref_dtype=None):
    args = [t.detach().to(ref_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    o, lse = flash_attention(*args, causal=causal, return_lse=True, backend=backend)
    seen = torch.isfinite(lse)  # rows that see no key have lse -inf and no gradient through it
    ((o.float() * do.float()).sum() + (torch.where(seen, lse, 0) * dlse).sum()).backward()
    return o.detach(), lse.detach(), *(t.grad for t in args)


@interpreted
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 1)]),
    st.integers(1, 45),
    st.integers(1, 45),
    st.sampled_from([16, 32, 64]),
    st.booleans(),
    st.integers(0, 1000),
)
def test_triton_attention_matches_reference(heads, sq, sk, d, causal, seed):
    case = _attention_case(1, heads[0], heads[1], sq, sk, d, causal, seed=seed)
    got = _run("triton", *case, causal)
    want = _run("torch", *case, causal)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@interpreted
def test_triton_attention_head_dim_128_and_batch():
    case = _attention_case(2, 4, 2, 33, 33, 128, True, seed=1)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], _run("triton", *case, True), _run("torch", *case, True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@interpreted
def test_attention_custom_ops_have_fake_and_autograd():
    from kernels.triton_attention import flash_attention_fwd

    q, k, v, _, _ = _attention_case(1, 2, 1, 20, 20, 16, True)
    torch.library.opcheck(flash_attention_fwd, (q, k, v, True, 0.25))
    with torch.device("meta"):
        o, lse = torch.ops.tessera.flash_attention_fwd(torch.empty(2, 8, 4096, 128), torch.empty(2, 2, 4096, 128),
                                                       torch.empty(2, 2, 4096, 128), True, 0.1)
    assert o.shape == (2, 8, 4096, 128) and lse.shape == (2, 8, 4096) and lse.dtype == torch.float32


@interpreted
@pytest.mark.parametrize("shape", [(3, 7, 48), (5, 100), (1, 1, 256), (4, 33)])
def test_triton_rms_norm_matches_reference(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = (torch.randn(shape[-1], generator=g) + 1).requires_grad_()
    dy = torch.randn(*shape, generator=g)
    outs = []
    for backend in ("triton", "torch"):
        x.grad = w.grad = None
        y = rms_norm(x, w, 1e-6, backend=backend)
        (y * dy).sum().backward()
        outs.append((y.detach(), x.grad.clone(), w.grad.clone()))
    for name, a, b in zip(["y", "dx", "dw"], *outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@interpreted
def test_rms_norm_custom_op_checks_and_meta():
    from kernels.triton_rmsnorm import rms_norm_fwd

    torch.library.opcheck(rms_norm_fwd, (torch.randn(6, 32, requires_grad=True), torch.randn(32, requires_grad=True), 1e-6))
    y, rstd = torch.ops.tessera.rms_norm_fwd(torch.empty(4, 1024, 8192, device="meta"), torch.empty(8192, device="meta"), 1e-5)
    assert y.shape == (4, 1024, 8192) and rstd.shape == (4096,)


@interpreted
def test_kernel_bad_input():
    q = torch.randn(1, 2, 8, 80)
    with pytest.raises(ValueError, match="head_dim 80 is not supported by the Triton attention kernel"):
        flash_attention(q, q, q, backend="triton")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), backend="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16), backend="triton")
    with pytest.raises(ValueError, match="backend='cuda'; use 'torch' or 'triton'"):
        flash_attention(q, q, q, backend="cuda")


# ----------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bf16_attention_against_fp32_reference(causal, d):
    case = _attention_case(2, 16, 4, 1024 + 17, 1024 + 17, d, causal, dtype=torch.bfloat16, device="cuda")
    got = _run("triton", *case, causal)
    ref = _run("torch", *case, causal, ref_dtype=torch.float32)
    bf16_ref = _run("torch", *case, causal)  # the same math in bf16: the error budget of the precision itself
    for name, a, b, c in zip(["out", "lse", "dq", "dk", "dv"], got, ref, bf16_ref):
        err = (a.float() - b.float()).abs().max().item()
        budget = max((c.float() - b.float()).abs().max().item(), 1e-3)
        assert err <= 2 * budget, f"{name}: triton bf16 error {err:.2e} vs torch bf16 error {budget:.2e}"


@pytest.mark.gpu
def test_gpu_bf16_rms_norm_against_fp32_reference():
    x = torch.randn(8, 2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w, 1e-5)
    ref = rms_norm_reference(x.float(), w.float(), 1e-5)
    assert (y.float() - ref).abs().max().item() < 0.05
    y.float().square().sum().backward()
