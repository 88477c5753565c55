"""The one-pass FP8 cast (kernels/triton_fp8_cast.py), run here by Triton's CPU interpreter: torchao's eager
cast's bits (to_fp8_saturated of the fp32 product) for every shape, scale granularity, layout and format, the
float64 definition (the nearest of the format's values, ties to the even one, saturated), and tessera's FP8
matmul with the fused cast equal to the one with torchao's, forward and both gradients, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchao", reason="the FP8 tests need torchao (the test extra)")

from torchao.float8.float8_utils import to_fp8_saturated  # noqa: E402

from tessera.kernels.triton_fp8_cast import FORMATS, scaled_cast_fp8  # noqa: E402

DTYPES = list(FORMATS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def nearest_fp8_float64(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The definition: each value of `v` (float64) saturated at the format's largest finite value and taken to
    the nearest value the format holds, a tie to the one whose last mantissa bit is 0; zero keeps v's sign."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).to(torch.float64)
    finite = torch.isfinite(values) & (codes < 128)  # the non-negative finite values, each once (+0 included)
    grid, grid_codes = values[finite], codes[finite]
    order = torch.argsort(grid)
    grid, grid_codes = grid[order], grid_codes[order]
    fmax = FORMATS[dtype][2]
    a = v.abs().clamp(max=fmax)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (grid_codes[hi] % 2 == 0))
    code = torch.where(take_hi, grid_codes[hi], grid_codes[lo])
    code = code | torch.where(torch.signbit(v), 128, 0).to(torch.uint8)
    return code


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    granularity=st.sampled_from(["tensor", "row", "col"]),
    dtype=st.sampled_from(DTYPES),
    transposed=st.booleans(),
    spread=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from([None, "row", "col"]),
)
def test_the_cast_is_torchaos_eager_cast_bit_for_bit(rows, cols, granularity, dtype, transposed, spread, seed, layout):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen) * spread).to(torch.bfloat16)
    if transposed:  # a weight's transpose: column-major
        x = x.t().contiguous().t() if rows > 1 and cols > 1 else x
    shape = {"tensor": (), "row": (rows, 1), "col": (1, cols)}[granularity]
    scale = (torch.rand(shape, generator=gen) * 100 + 1e-3).float()
    got = scaled_cast_fp8(x, scale, dtype, layout)
    want = to_fp8_saturated(x.to(torch.float32) * scale, dtype)
    # None keeps torchao's order; "row" / "col" the one asked (a dim of one: either)
    assert got.shape == want.shape
    if layout is None:
        assert got.stride() == want.stride()
    elif rows > 1 and cols > 1:
        assert got.stride({"row": 1, "col": 0}[layout]) == 1
    assert torch.equal(_bits(got), _bits(want)), (_bits(got) != _bits(want)).sum().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["e4m3", "e5m2"])
def test_the_cast_is_the_float64_definition_ties_and_signed_zeros_included(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    values = values[torch.isfinite(values)].unique()
    midpoints = (values[1:] + values[:-1]) / 2  # every tie between neighbours (exact in fp32)
    fmax = FORMATS[dtype][2]
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, fmax, -fmax, fmax * 1.01, -fmax * 3, 1e30, float("inf")])
    gen = torch.Generator().manual_seed(0)
    samples = torch.randn(4096, generator=gen) * torch.logspace(-8, 4, 4096)
    v = torch.cat([values, midpoints, special, samples])
    got = scaled_cast_fp8(v, torch.ones(()), dtype)
    want = nearest_fp8_float64(v.to(torch.float64), dtype)
    bad = (_bits(got) != want).nonzero().flatten()
    assert bad.numel() == 0, [(v[i].item(), _bits(got)[i].item(), want[i].item()) for i in bad[:5]]


@pytest.mark.parametrize("dtype", DTYPES, ids=["e4m3", "e5m2"])
def test_a_nan_stays_nan_as_torchaos_cast_keeps_it(dtype):
    x = torch.tensor([1.0, float("nan"), -float("nan"), -3.0])
    got = scaled_cast_fp8(x, torch.tensor(2.0), dtype).float()
    want = to_fp8_saturated(x * 2.0, dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[1:3]).all()
    assert torch.equal(got[[0, 3]], want[[0, 3]])
    bits = scaled_cast_fp8(x, torch.tensor(2.0), dtype).view(torch.uint8)
    assert torch.equal(bits, to_fp8_saturated(x * 2.0, dtype).view(torch.uint8))  # NaN's sign too


def test_bad_input_gets_one_line():
    with pytest.raises(ValueError, match="scaled_cast_fp8: dtype torch.bfloat16 is not one of"):
        scaled_cast_fp8(torch.ones(4), torch.ones(()), torch.bfloat16)
    with pytest.raises(ValueError, match="scaled_cast_fp8: scale is torch.float64; torchao's scales are float32"):
        scaled_cast_fp8(torch.ones(4), torch.ones((), dtype=torch.float64))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fp8_matmul_with_the_fused_cast_equals_torchaos_bit_for_bit(recipe):
    from tessera.parallel.fp8 import Float8Matmul, float8_config

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 48, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(80, 64, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(3, 48, 80, generator=gen).to(torch.bfloat16)
    runs = []
    for fused in (False, True):
        mm = Float8Matmul(float8_config(recipe, emulate=True), fused_cast=fused, record=True)
        out = mm(x, w)
        gx, gw = torch.autograd.grad(out, (x, w), grad)
        runs.append((out, gx, gw, [s for _, _, s in mm.scales]))
    (out0, gx0, gw0, s0), (out1, gx1, gw1, s1) = runs
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert len(s0) == len(s1) == 6 and all(torch.equal(a, b) for a, b in zip(s0, s1))  # every operand's scale


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fused_cast_writes_each_operand_in_the_order_scaled_mm_takes_it(recipe, monkeypatch):
    """torchao's mm copies an operand that is not in torch._scaled_mm's order (the first row-major, the second
    column-major): with its own cast, three of the six operands of a linear's three matmuls were copied (on the
    H200's eager FP8 step 336 strided kernels, 149 ms of its 667); the fused cast writes each in the order it is
    taken, so none is, at the same bits (the test above)."""
    import torchao.float8.float8_ops as ops

    from tessera.parallel.fp8 import Float8Matmul, float8_config

    copies: list[str] = []
    preprocess = ops.preprocess_addmm

    def watched(a, b):
        if not ops.is_row_major(a._data.stride()):
            copies.append(f"first operand {tuple(a._data.shape)} {a._data.stride()}")
        if ops.is_row_major(b._data.stride()):
            copies.append(f"second operand {tuple(b._data.shape)} {b._data.stride()}")
        return preprocess(a, b)

    monkeypatch.setattr(ops, "preprocess_addmm", watched)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 32, 48, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(64, 48, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    for fused, expected in ((False, 3), (True, 0)):
        copies.clear()
        mm = Float8Matmul(float8_config(recipe, emulate=True), fused_cast=fused)
        torch.autograd.grad(mm(x, w), (x, w), torch.ones(2, 32, 64, dtype=torch.bfloat16))
        assert len(copies) == expected, (fused, copies)


def test_a_layout_is_the_memory_order_asked_at_the_same_bits():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 70, generator=gen).to(torch.bfloat16)
    for source in (x, x.t().contiguous().t()):
        want = to_fp8_saturated(source.float() * 3.0, torch.float8_e4m3fn)
        for layout, contiguous_dim in (("row", 1), ("col", 0)):
            got = scaled_cast_fp8(source, torch.tensor(3.0), layout=layout)
            assert got.stride(contiguous_dim) == 1 and torch.equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="layout='diagonal' needs a 2-D x"):
        scaled_cast_fp8(x, torch.tensor(1.0), layout="diagonal")
    with pytest.raises(ValueError, match="layout='col' needs a 2-D x \\(got 3-D\\)"):
        scaled_cast_fp8(x.reshape(1, 37, 70), torch.tensor(1.0), layout="col")
