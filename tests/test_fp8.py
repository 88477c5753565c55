"""--fp8: torchao's float8 matmuls on the spec's linear layers (parallel/fp8.py), emulated on CPU.

Float8Matmul is torchao's float8 linear with the amax of a tp-split operand taken over tp: on one process
(no split) it must be torchao's own Float8Linear, bitwise, forward and backward, for each recipe. The
records must say the matmuls ran in FP8 (the dtype probe reads torchao's Float8TrainingTensor), and the
start-up line names what stays in high precision and that CPU emulates.
"""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import NEEDS_TORCHAO, script_here

pytestmark = NEEDS_TORCHAO

from tessera.models.spec import get_preset, spec_of  # noqa: E402
from tessera.topology import Layout  # noqa: E402
from tessera.topology.errors import PlanError  # noqa: E402
from tessera.topology.estimators.fp8_model import (  # noqa: E402
    cast_bytes_per_step,
    fp8_flop_share,
    fp8_layer_groups,
    fp8_params,
    fp8_summary,
)
from tessera.topology.shapes import ModelShape  # noqa: E402
from tessera.topology.estimators.planner import Candidate, Hardware, estimate  # noqa: E402
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
    with pytest.raises(ValueError, match=r"unknown `fp8` recipe 'blockwise'; use one of tensorwise, rowwise"):
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
    with pytest.raises(ValueError, match=r"^fp8=tensorwise: no linear layer of this model qualifies .*drop `fp8`$"):
        check_fp8("tensorwise", cfg, spec_of(cfg), 1, "cpu")
    check_fp8("tensorwise", get_preset("debug"), spec_of(get_preset("debug")), 2, "cpu")  # qualifies on tp2
    cfg = dataclasses.replace(get_preset("debug"), dim=16, n_heads=1, n_kv_heads=1, ffn_dim=16)
    with pytest.raises(ValueError, match=r"tp-local with tp=2"):  # 16 rows split over tp2: 8 each
        check_fp8("rowwise", cfg, spec_of(cfg), 2, "cpu")


@pytest.mark.parametrize("model", ["debug", "qwen3-moe-debug", "qwen3-moe-shared-debug", "1b"])
def test_the_planners_fp8_layers_are_the_ones_parallelize_converts(model):
    """topology/estimators/fp8_model.py's torch-free rule counts the layers parallel/fp8.py converts, parameter
    for parameter."""
    cfg = get_preset(model)
    spec = spec_of(cfg)
    built = spec.build_model(cfg, device="meta") if model != "1b" else None
    shape = spec.shape(cfg)
    if built is not None:
        report = apply_fp8(built, "tensorwise", spec, emulate=True)
        assert fp8_params(shape) == sum(built.get_submodule(n).weight.numel() for n in report.converted)
    assert 0 < fp8_params(shape) < shape.num_params()


def test_the_planner_prices_fp8_matmuls_casts_and_the_float8_all_gather():
    cfg = get_preset("1b")
    shape = spec_of(cfg).shape(cfg)
    seq, batch = 4096, 64

    def plan(fp8, **layout):
        return estimate(shape, Candidate(Layout(**layout)), Hardware(gpus=8, fp8=fp8), seq, batch)

    bf16, tw, rw = plan(None, dp_shard=8), plan("tensorwise", dp_shard=8), plan("rowwise", dp_shard=8)
    share = fp8_flop_share(shape, seq)
    casts = cast_bytes_per_step(shape, seq * batch / 8, 1, 2, weight_casts=1 / 8) / (Hardware(gpus=8).hbm_gbps * 1e9)
    assert tw.time["compute"] == pytest.approx(bf16.time["compute"] * (1 - share / 2) + casts)
    assert 1.2 < tw.tokens_per_s / bf16.tokens_per_s < 2  # the datasheet's 2x on ~70% of the FLOPs, less the casts
    # rowwise: the same rate; its weights all-gather in bf16 and are cast whole on every use
    assert rw.time["compute"] == pytest.approx(tw.time["compute"] + casts_of_weights(shape, 7 / 8))
    assert tw.comm_bytes["dp_shard_cp"] < rw.comm_bytes["dp_shard_cp"] == bf16.comm_bytes["dp_shard_cp"]
    # under tp the weights all-gather in bf16 (parallelize's rule), so the bytes are bf16's
    tp_bf16, tp_tw = plan(None, dp_shard=4, tp=2), plan("tensorwise", dp_shard=4, tp=2)
    assert tp_tw.comm_bytes["dp_shard_cp"] == tp_bf16.comm_bytes["dp_shard_cp"]
    with pytest.raises(PlanError, match="fp8='blockwise'"):
        Hardware(gpus=8, fp8="blockwise")


@given(
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4]),
    tokens=st.integers(1, 10**6),
    norm=st.sampled_from(["rms", "layer"]),
)
def test_shared_input_casts_count_each_input_once_a_direction(kv_heads, tp, tokens, norm):
    """tessera's eager casts (parallel/fp8_shared_casts.py) against torchao's: the weights and output gradients
    alike, each group's input cast twice (forward, backward) instead of twice per layer, its amax read once
    (tensorwise) or twice (rowwise), once fewer for an RMSNorm's output without tp."""
    shape = ModelShape(
        dim=256, n_layers=3, n_heads=8, n_kv_heads=kv_heads, head_dim=32, vocab_size=512, ffn_dim=768, norm=norm
    )
    e = 2
    apart = cast_bytes_per_step(shape, tokens, tp, e)
    for recipe, amaxes in (("tensorwise", 1), ("rowwise", 2)):
        saved = 0.0
        for producer, group in fp8_layer_groups(shape, tp):
            out, inp, split = group[0]
            in_l = inp if split == 0 else inp // tp
            noted = producer == "swiglu" or (producer == "norm" and tp == 1 and norm == "rms")
            saved += tokens * in_l * (len(group) * 2 * (2 * e + 1) - 2 * (e + 1) - (amaxes - noted) * e)
        shared = cast_bytes_per_step(shape, tokens, tp, e, shared_inputs=recipe)
        assert shared == pytest.approx(apart - shape.n_layers * saved) and shared < apart
    # under activation checkpointing the backward casts each layer's input for itself: less is shared
    checkpointed = cast_bytes_per_step(shape, tokens, tp, e, shared_inputs="tensorwise", shared_backward=False)
    assert cast_bytes_per_step(shape, tokens, tp, e, shared_inputs="tensorwise") < checkpointed < apart
    groups = fp8_layer_groups(shape, tp)
    assert [by for by, _ in groups] == ["norm", "attention", "norm", "swiglu"]
    assert len(groups[0][1]) == (3 if tp <= kv_heads else 1)  # q, k, v read one input


def casts_of_weights(shape, share: float) -> float:
    """Seconds of `share` of one round of weight casts at the default HBM rate (one microbatch)."""
    return share * cast_bytes_per_step(shape, 0.0, 1, 2) / (Hardware(gpus=8).hbm_gbps * 1e9)


def test_tessera_memory_says_what_fp8_changes(capsys):
    from tessera.cli import main

    f = fp8_summary(spec_of(get_preset("8b")).shape(get_preset("8b")), "tensorwise", tp=1, fsdp=8)
    assert f["all_gather_bytes_per_gather"] * 2 == f["all_gather_bytes_per_gather_without_fp8"]  # 1 byte, not 2
    tp2 = fp8_summary(spec_of(get_preset("8b")).shape(get_preset("8b")), "tensorwise", tp=2, fsdp=4)
    assert tp2["all_gather_bytes_per_gather"] == tp2["all_gather_bytes_per_gather_without_fp8"]  # bf16 under tp
    assert main(["memory", "--model", "8b", "--dp", "8", "--fp8", "tensorwise"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("--fp8 tensorwise: 6.98B of 8.03B parameters in FP8 linear layers"), line
    assert "FSDP2 all-gathers them in FP8: 6.11 GB a gather per rank against 12.21 GB in bf16" in line


def test_the_startup_line_says_eager_fp8_on_a_gpu_is_slower_than_bf16():
    """Measured on an H200: eager FP8 at 0.55x bf16's tokens/s; the start-up line says so and names --compile."""
    from types import SimpleNamespace

    from tessera.training.report import fp8_summary as startup_fp8

    report = SimpleNamespace(converted=["layers.0.mlp.up_proj"], float8_all_gather=0, kept={})
    for device, compile, slow in [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)]:
        config = SimpleNamespace(parallel=SimpleNamespace(fp8="tensorwise", compile=compile))
        trainer = SimpleNamespace(parts=[SimpleNamespace(fp8_report=report)], device=torch.device(device))
        line = startup_fp8(config, trainer)
        assert line.startswith("FP8 tensorwise (torchao, ") and "1 linear layers on rank 0" in line
        assert ("add --compile" in line) == slow, line


def test_the_convergence_benchmark_records_the_dtypes_it_measured_and_refuses_a_missing_gpu(tmp_path):
    """benchmarks/bench_fp8.py on a tiny setting: bf16 and both recipes, each curve's length, the gaps to bf16,
    and the dtype the records measured (emulated FP8 on CPU), not the recipe asked for; `--device cuda`
    without a GPU is one line naming the fix."""
    import json

    tiny = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch", "2", "--window", "2"]
    out = script_here("bench_fp8", *tiny, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "fp8-convergence-debug-cpu.json").read_text())["results"]
    assert {k: len(v) for k, v in data["losses"].items()} == {"bf16": 3, "fp8-tensorwise": 3, "fp8-rowwise": 3}
    assert data["compute_dtypes"] == {
        "bf16": "bfloat16",
        "fp8-tensorwise": "float8_emulated",
        "fp8-rowwise": "float8_emulated",
    }
    gap = data["gaps"]["fp8-rowwise"]
    want = max(abs(a - b) for a, b in zip(data["losses"]["fp8-rowwise"], data["losses"]["bf16"]))
    assert gap["max_abs_gap"] == pytest.approx(want) and 1 <= gap["max_abs_gap_step"] <= 3
    assert (tmp_path / "fp8-convergence-debug-cpu.png").stat().st_size > 0
    if not torch.cuda.is_available():
        refused = script_here("bench_fp8", "--device", "cuda")
        assert refused.returncode == 2 and "--device cuda: no GPU is visible here" in refused.stderr
        assert "--device cpu" in refused.stderr.strip().splitlines()[-1]


def test_the_per_step_scale_precompute_gives_the_all_gathers_own_scales_and_changes_no_step():
    """dp2 tensorwise (FSDP2 all-gathers the weights in FP8): each step's precomputed scale of every such weight
    is the one the all-gather computes from the whole weight, the run trains bitwise as it does without the
    precompute, and no scale outlives its step."""
    from tessera.launching.launch import run_ranks

    from fp8_ranks import precomputed_scales_run

    kw = dict(dp=2, fp8="tensorwise", steps=2)
    on = run_ranks(precomputed_scales_run, 2, kw, True, timeout=180)
    off = run_ranks(precomputed_scales_run, 2, kw, False, timeout=180)
    for (losses, norms, n, pairs, cleared), (off_losses, off_norms, *_, off_pairs, _) in zip(on, off):
        assert n > 0 and len(pairs) == n and cleared
        assert all(got == want for got, want in pairs), pairs
        assert all(got is None for got, _ in off_pairs)  # without it the all-gathers cast by their own amax
        assert losses == off_losses and norms == off_norms
    # the all-gathers do cast with the precomputed scales: scaled by 0.7 they change the first step's gradients
    planted = run_ranks(precomputed_scales_run, 2, kw, True, True, timeout=180)
    assert planted[0][1][0] != on[0][1][0]


def test_a_run_without_fp8_never_imports_torchao(tmp_path):
    """The per-step scale hooks run on every step; without FP8 weights they must not load torchao (a rank that
    did printed its import warning, and a killed-rank run's one-line error became three lines)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import torch.distributed as dist\n"
        "from tessera.config import Config\n"
        "from tessera.trainer import Trainer\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "Trainer(Config.create(model='debug', seq_len=16, global_batch=2, steps=1, quiet=True)).train_step()\n"
        "print('torchao' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_an_fp8_run_prints_nothing_of_torchaos_enum_registration(tmp_path):
    """Issue 65 item 12: every FP8 run printed torch's 'KernelPreference is an Enum subclass ... deprecated' notice
    about torchao's own registration, once per process."""
    import subprocess
    import sys

    code = "import sys; from tessera.commands.main import main; sys.exit(main(sys.argv[1:]))"
    argv = ["train", "--fp8", "tensorwise", "--steps", "1", "--quiet", "--seq-len", "32", "--global-batch", "2"]
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "KernelPreference" not in out.stderr + out.stdout
