"""tests/helpers.py round_like_tp's layers, which the bf16 contract's tolerance for tp rows is measured with
(tests/test_contract_bf16.py): one process rounding its matmuls' partial sums where tp ranks round them."""

import torch

from helpers import _ColumnParallelRounding, _RowParallelRounding


def test_rounding_like_tp_is_tps_partial_sums_and_exact_in_float64():
    """helpers.round_like_tp's layers: in float64 the plain linear layer (forward and both gradients); in bf16 the
    row-parallel forward is each half's product rounded, then their bf16 sum, and the column-parallel input
    gradient likewise, bitwise."""
    gen = torch.Generator().manual_seed(0)
    x0, w0, g0 = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((3, 5, 8), (6, 8), (3, 5, 6)))
    for rounding in (_RowParallelRounding, _ColumnParallelRounding):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = rounding.apply(x, w, 2)
        dx, dw = torch.autograd.grad(y, (x, w), g0)
        assert torch.allclose(y, x0 @ w0.t(), rtol=1e-12, atol=1e-12)
        assert torch.allclose(dx, g0 @ w0, rtol=1e-12, atol=1e-12)
        assert torch.allclose(dw, g0.flatten(0, 1).t() @ x0.flatten(0, 1), rtol=1e-12, atol=1e-12)
    x, w, g = x0.bfloat16().requires_grad_(), w0.bfloat16(), g0.bfloat16()
    halves = (x[..., :4] @ w[:, :4].t()) + (x[..., 4:] @ w[:, 4:].t())
    assert torch.equal(_RowParallelRounding.apply(x, w, 2), halves)
    (dx,) = torch.autograd.grad(_ColumnParallelRounding.apply(x, w, 2), (x,), g)
    assert torch.equal(dx, (g[..., :3] @ w[:3]) + (g[..., 3:] @ w[3:]))
