"""--fp8: torchao's float8 matmuls on the spec's linear layers (parallel/fp8.py), emulated on CPU.

Float8Matmul is torchao's float8 linear with the amax of a tp-split operand taken over tp: on one process
(no split) it must be torchao's own Float8Linear, bitwise, forward and backward, for each recipe. The
records must say the matmuls ran in FP8 (the dtype probe reads torchao's Float8TrainingTensor), and the
start-up line names what stays in high precision and that CPU emulates.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("torchao.float8")

from tessera.models.spec import get_preset, spec_of  # noqa: E402
from tessera.metrics.dtype_probe import MatmulDtypes  # noqa: E402
from tessera.parallel.fp8 import (  # noqa: E402
    FP8_RECIPES,
    Float8Linear,
    Float8Matmul,
    apply_fp8,
    check_fp8,
    float8_config,
    qualifies,
    to_float8,
)  # noqa: E402


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_matmul_is_torchaos_float8_linear(recipe, dtype):
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False).to(dtype)
    theirs = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False).to(dtype))
    theirs[0].weight = torch.nn.Parameter(linear.weight.detach().clone())
    convert_to_float8_training(theirs, config=float8_config(recipe, emulate=True))
    ours = to_float8(linear, Float8Matmul(float8_config(recipe, emulate=True)))
    x = torch.randn(2, 8, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, theirs[0].weight.grad)
    # and it is not the high-precision matmul
    assert not torch.equal(ya, torch.nn.functional.linear(x, linear.weight))


def test_unknown_recipe_is_named():
    with pytest.raises(ValueError, match=r"unknown --fp8 recipe 'blockwise'; use one of tensorwise, rowwise"):
        float8_config("blockwise", emulate=True)


def test_qualifies_needs_multiples_of_16():
    assert qualifies(64, 192) and not qualifies(64, 50) and not qualifies(24, 64)


def test_the_probe_counts_fp8_matmuls():
    layer = to_float8(torch.nn.Linear(32, 16, bias=False), Float8Matmul(float8_config("tensorwise", emulate=True)))
    x = torch.randn(4, 32, requires_grad=True)
    with MatmulDtypes() as probe:
        layer(x).sum().backward()
    report = probe.report()
    assert report["compute_dtype"] == "float8_emulated"
    assert report["matmul_calls_by_dtype"] == {"float8_emulated": 3}  # forward, grad input, grad weight
    assert report["matmul_flops_by_dtype"]["float8_emulated"] == 3 * 2 * 4 * 32 * 16


@pytest.mark.parametrize("model", ["debug", "qwen3-moe-debug"])
def test_the_spec_linears_convert_and_the_anchors_exceptions_stay(model):
    cfg = get_preset(model)
    spec = spec_of(cfg)
    built = spec.build_model(cfg, device="meta")
    report = apply_fp8(built, "tensorwise", spec, emulate=True)
    assert all(isinstance(built.get_submodule(n), Float8Linear) for n in report.converted)
    head = spec.head
    assert report.kept[head] == "the output head" and not isinstance(built.get_submodule(head), Float8Linear)
    if model == "debug":  # q, k, v, o, gate, up, down of 2 layers
        assert len(report.converted) == 14 and set(report.kept) == {head}
    else:  # attention's 4 of 2 layers; the router and grouped experts stay
        assert len(report.converted) == 8
        assert set(report.kept) == {head, "layers.*.mlp.gate", "layers.*.mlp.experts"}
    # parameter names unchanged (checkpoints, optimizer state and gradients compare by name)
    assert [n for n, _ in built.named_parameters()] == [
        n for n, _ in spec.build_model(cfg, device="meta").named_parameters()
    ]


def test_layers_whose_dims_are_not_multiples_of_16_stay_and_are_named():
    cfg = dataclasses.replace(get_preset("debug"), ffn_dim=200)
    spec = spec_of(cfg)
    report = apply_fp8(spec.build_model(cfg, device="meta"), "rowwise", spec, emulate=True)
    assert len(report.converted) == 8
    assert "not multiples of 16" in report.kept["layers.*.feed_forward.w1"], report.kept


def test_a_model_with_no_qualifying_layer_is_refused_naming_why():
    cfg = dataclasses.replace(get_preset("debug"), dim=40, ffn_dim=200)
    with pytest.raises(ValueError, match=r"^--fp8 tensorwise: no linear layer of this model qualifies .*drop --fp8$"):
        check_fp8("tensorwise", cfg, spec_of(cfg), 1, "cpu")
    check_fp8("tensorwise", get_preset("debug"), spec_of(get_preset("debug")), 2, "cpu")  # qualifies on tp2
    cfg = dataclasses.replace(get_preset("debug"), dim=16, n_heads=1, n_kv_heads=1, ffn_dim=16)
    with pytest.raises(ValueError, match=r"tp-local with --tp 2"):  # 16 rows split over tp2: 8 each
        check_fp8("rowwise", cfg, spec_of(cfg), 2, "cpu")
