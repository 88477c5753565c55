"""SwiGLU's activation, silu(gate) * up, by the fused Triton kernels (kernels/triton_swiglu.py; on CPU through the
interpreter) and by the dispatcher's torch path, against a float64 definition written here; the custom ops'
checks and fake shapes; the row amaxes the forward notes for an FP8 cast of its output."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels.dispatch import swiglu
from tessera.kernels.fp8_amax import row_amax

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under TRITON_INTERPRET=1"
)


def definition(gate, up):
    """silu(g) u = g u / (1 + exp(-g)), in float64; its gradients by autograd over the same float64 ops."""
    g, u = gate.double(), up.double()
    return g * u / (1 + torch.exp(-g))


def _case(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(shape, generator=gen)).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    dh = torch.randn(shape, generator=gen).to(dtype)
    return gate, up, dh


TOLERANCE = {
    torch.float32: 1e-5,
    torch.bfloat16: 8e-3,
}  # one bf16 ulp: torch rounds silu(g) and the product; the kernel only its store


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=interpreted), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# rows shorter than one chunk of the kernel's loop, longer (2 chunks and a partial one), a single element
@pytest.mark.parametrize("shape", [(3, 7, 48), (2, 2600), (1, 1), (5, 1024)])
def test_swiglu_matches_the_definition(shape, dtype, backend):
    gate, up, dh = _case(shape, dtype, 0)
    h = swiglu(gate, up, backend=backend)
    h.backward(dh)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    h64 = definition(g64, u64)
    h64.backward(dh.double())
    tol = TOLERANCE[dtype]
    assert h.dtype == gate.grad.dtype == up.grad.dtype == dtype and h.shape == shape
    for name, got, want in (("h", h, h64), ("dgate", gate.grad, g64.grad), ("dup", up.grad, u64.grad)):
        torch.testing.assert_close(got.detach().double(), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@interpreted
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 1500), seed=st.integers(0, 2**16))
def test_the_row_amax_is_torchs_amax_of_the_stored_output(rows, cols, seed):
    gate, up, _ = _case((rows, cols), torch.bfloat16, seed)
    h = swiglu(gate.detach(), up.detach(), backend="triton")
    noted = row_amax(h)
    assert noted is not None and noted.dtype == h.dtype
    assert torch.equal(noted.float(), h.float().abs().amax(dim=-1, keepdim=True))


@interpreted
def test_a_nan_row_notes_a_nan_and_an_inplace_change_voids_the_note():
    gate = torch.ones(3, 1100, dtype=torch.bfloat16)
    gate[1, 1050] = float("nan")  # in the second chunk of the row
    h = swiglu(gate, torch.ones_like(gate), backend="triton")
    noted = row_amax(h)
    assert torch.isnan(noted[1]).all() and not torch.isnan(noted[[0, 2]]).any()
    h.mul_(2)
    assert row_amax(h) is None


@interpreted
def test_the_custom_ops_check_and_have_fake_shapes():
    from tessera.kernels.triton_swiglu import swiglu_bwd, swiglu_fwd

    gate, up = torch.randn(4, 40, requires_grad=True), torch.randn(4, 40, requires_grad=True)
    torch.library.opcheck(swiglu_fwd, (gate, up))
    torch.library.opcheck(swiglu_bwd, (torch.randn(4, 40), gate.detach(), up.detach()))
    strided = torch.randn(40, 6).t().requires_grad_()  # a transposed input: the outputs are still contiguous
    torch.library.opcheck(swiglu_fwd, (strided, torch.randn(6, 40)))
    h, amax = torch.ops.tessera.swiglu_fwd(
        torch.empty(4, 512, 8192, device="meta"), torch.empty(4, 512, 8192, device="meta")
    )
    assert h.shape == (4, 512, 8192) and amax.shape == (2048,)


def test_bad_input_gets_one_line():
    with pytest.raises(ValueError, match=r"gate \(4, 8\) and up \(4, 9\) must have one shape"):
        swiglu(torch.ones(4, 8), torch.ones(4, 9))
    with pytest.raises(ValueError, match="gate and up must share a dtype and a device; got torch.float32 on cpu"):
        swiglu(torch.ones(4, 8), torch.ones(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gate and up must have at least one dim"):
        swiglu(torch.tensor(1.0), torch.tensor(2.0))


@pytest.mark.gpu
def test_gpu_bf16_swiglu_against_the_definition_and_its_default_on_cuda():
    gate, up, dh = (t.cuda() for t in _case((4096, 8192), torch.bfloat16, 7))
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    h = swiglu(gate, up)  # CUDA, eager: the fused kernels by default
    assert row_amax(h) is not None
    h.backward(dh)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    definition(g64, u64).backward(dh.double())
    tol = TOLERANCE[torch.bfloat16]
    for name, got, want in (("h", h, definition(g64, u64)), ("dgate", gate.grad, g64.grad), ("dup", up.grad, u64.grad)):
        torch.testing.assert_close(got.detach().double(), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
