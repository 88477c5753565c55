"""`tessera train --profile-summary N` (runtime/metrics/step_profile.py): the step's time by kind, its top kernels and
its memory by what held it. The pure parts (interval unions, idle gaps, kinds) against brute-force
definitions; the CUDA path on synthetic events; the refusals; runs on one and two ranks that keep the losses
of an unprofiled run."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import DeviceType

from helpers import cli_here

from tessera.metrics.step_profile import KINDS, STEP_RANGE, busy_seconds, idle_gaps, kind_of, summarize_events

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "debug", "--seq-len", "16", "--global-batch", "2"]

intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


@settings(max_examples=200, deadline=None)
@given(intervals, st.integers(0, 40), st.integers(0, 40))
def test_busy_time_is_the_length_of_the_union_and_the_gaps_are_the_rest(spans, a, length):
    start, end = a, a + length
    covered = {t for lo, hi in spans for t in range(lo, hi) if start <= t < end}  # unit cells, brute force
    assert busy_seconds(spans, start, end) == len(covered)
    gaps = idle_gaps(spans, start, end, top=1000)
    assert sum(g["seconds"] for g in gaps) == length - len(covered)
    assert all(g["seconds"] > 0 for g in gaps) and [g["seconds"] for g in gaps] == sorted(
        (g["seconds"] for g in gaps), reverse=True
    )
    for g in gaps:  # a gap holds no covered cell
        lo = start + g["at_s"]
        assert not any(lo <= t < lo + g["seconds"] for t in covered)


@pytest.mark.parametrize(
    "kernel, context, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", ["aten::mm"], "matmul"),
        ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", ["aten::addmm", "aten::linear"], "matmul"),
        ("Kernel2", ["aten::mm"], "matmul"),  # a generic name: the launching op says what it is
        ("_fwd_kernel", ["tessera::flash_attention_fwd"], "attention"),
        ("_attention_bwd_dkdv_kernel", [], "attention"),  # tessera's kernels say what they are without a context
        ("_rms_norm_fwd_kernel", [], "norms"),
        ("_rms_bwd_kernel", ["tessera::rms_norm_bwd"], "norms"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", [], "norms"),
        ("flash_fwd_kernel", ["aten::_scaled_dot_product_flash_attention"], "attention"),
        ("ncclDevKernel_AllGather_RING_LL", ["nccl:_all_gather_base"], "communication"),
        ("multi_tensor_apply_kernel", ["aten::_fused_adamw_", "tessera: optimizer"], "optimizer_and_clipping"),
        ("vectorized_elementwise_kernel", ["aten::mul_", "tessera: clip"], "optimizer_and_clipping"),
        ("sm90_xmma_gemm_bf16", ["aten::mm", "tessera: loss"], "matmul"),  # the kernel's name first
        ("vectorized_elementwise_kernel", ["aten::exp", "tessera: loss"], "loss"),
        ("unrolled_elementwise_kernel", ["aten::copy_", "aten::_to_copy", "aten::to"], "casts_and_copies"),
        ("vectorized_elementwise_kernel", ["aten::silu"], "other_elementwise"),
        ("_swiglu_fwd_kernel", ["tessera::swiglu_fwd"], "other_elementwise"),  # the activation is no cast
    ],
)
def test_kinds_come_from_the_kernel_then_the_ranges_then_the_launching_op(kernel, context, kind):
    assert kind_of(kernel, context) == kind


def _event(name, start, end, device=DeviceType.CPU, id=0, linked=0, parent=None):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=device,
        id=id,
        linked_correlation_id=linked,
        cpu_parent=parent,
        is_user_annotation=name.startswith("tessera: "),
        self_cpu_time_total=end - start,
    )


def test_the_cuda_summary_splits_the_kernels_time_by_kind_and_finds_the_idle_gaps():
    step = _event(STEP_RANGE, 0, 1000)
    optimizer = _event("tessera: optimizer", 800, 990, parent=step)
    mm = _event("aten::mm", 10, 20, id=7, parent=step)
    adam = _event("aten::_fused_adamw_", 810, 820, id=9, parent=optimizer)
    cuda = DeviceType.CUDA
    events = [
        step,
        optimizer,
        mm,
        adam,
        _event("sm90_xmma_gemm_bf16", 100, 400, cuda, linked=7),
        _event("Kernel2", 350, 500, cuda, linked=7),  # overlaps the first (two streams): counted once as busy
        _event("multi_tensor_apply_kernel", 850, 950, cuda, linked=9),
        _event("tessera: optimizer", 800, 990, cuda),  # the range's mirror on the GPU timeline: not a kernel
        _event("cudaLaunchKernel", 11, 12, id=9, linked=3),  # a launch call whose CUPTI id meets an op's
    ]
    s = summarize_events(events, "cuda")
    assert s["step_wall_s"] == pytest.approx(1000e-6)
    assert s["time_s"]["matmul"] == pytest.approx(450e-6)
    assert s["time_s"]["optimizer_and_clipping"] == pytest.approx(100e-6)
    assert s["device_busy_s"] == pytest.approx(500e-6) and s["time_s"]["idle"] == pytest.approx(500e-6)
    assert [g["seconds"] for g in s["idle_gaps"]] == pytest.approx([350e-6, 100e-6, 50e-6])
    assert [k["name"] for k in s["top_kernels"]] == ["sm90_xmma_gemm_bf16", "Kernel2", "multi_tensor_apply_kernel"]
    assert set(s["time_s"]) == set(KINDS) | {"idle"}
    with pytest.raises(ValueError, match="no 'tessera: profiled step' range"):
        summarize_events(events[1:], "cuda")


def test_a_kernel_whose_id_names_no_operator_takes_the_operators_around_its_launch_call():
    # torch 2.11 on an H200 linked no kernel by the operator's id: the launch call shares the kernel's
    # correlation, and its parents (the op, the loss range) classify the kernel
    step = _event(STEP_RANGE, 0, 1000)
    loss = _event("tessera: loss", 100, 300, parent=step)
    exp = _event("aten::exp", 110, 120, id=11, parent=loss)
    events = [
        step,
        loss,
        exp,
        _event("cudaLaunchKernel", 111, 112, id=40, linked=21, parent=exp),
        _event("vectorized_elementwise_kernel", 200, 260, DeviceType.CUDA, linked=21),
        _event("vectorized_elementwise_kernel", 400, 410, DeviceType.CUDA, linked=99),  # launched by nothing seen
    ]
    s = summarize_events(events, "cuda")
    assert s["time_s"]["loss"] == pytest.approx(60e-6)
    assert s["time_s"]["other_elementwise"] == pytest.approx(10e-6)
    assert s["kernels_linked"] == 1 and s["kernels_counted"] == 2


def test_a_kernel_no_id_links_takes_the_range_mirrored_on_the_gpu_timeline_around_it():
    # torch 2.11 on an H200 linked no kernel by either id (kernels_linked 0): the loss's eager softmax then
    # counted as casts and elementwise. The ranges' mirrors on the GPU timeline still place it.
    step = _event(STEP_RANGE, 0, 1000)
    cuda = DeviceType.CUDA
    events = [
        step,
        _event("tessera: loss", 100, 300, parent=step),
        _event("tessera: loss", 150, 400, cuda),  # the mirror: from its first kernel to its last
        _event("tessera: optimizer", 500, 700, cuda),
        _event("direct_copy_kernel_cuda", 150, 200, cuda, linked=5),
        _event("DivFunctor", 390, 400, cuda, linked=6),
        _event("multi_tensor_apply_kernel", 520, 560, cuda, linked=7),
        _event("direct_copy_kernel_cuda", 800, 830, cuda, linked=8),  # in no range: by its name
        _event("nvjet_sm90_tst_128x256", 200, 300, cuda, linked=9),  # a matmul in the loss: by its name first
    ]
    s = summarize_events(events, "cuda")
    assert s["time_s"]["loss"] == pytest.approx(60e-6)
    assert s["time_s"]["optimizer_and_clipping"] == pytest.approx(40e-6)
    assert s["time_s"]["casts_and_copies"] == pytest.approx(30e-6)
    assert s["time_s"]["matmul"] == pytest.approx(100e-6)
    assert s["kernels_linked"] == 0 and s["kernels_placed_by_range"] == 4 and s["kernels_counted"] == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "3", "--profile-summary", "1"], "--profile-summary 1 must be a step this run takes after its"),
        (["--steps", "3", "--profile-summary", "4"], "2 to 3 (--steps 3)"),
        (["--steps", "1", "--profile-summary", "2"], "raise --steps to at least 2"),
        (["--steps", "3", "--profile-summary", "3", "--profile", "PROF"], "falls in --profile's steps 2:3"),
    ],
)
def test_a_step_it_cannot_profile_is_refused_in_one_line(tmp_path, args, message):
    args = [str(tmp_path / "prof") if a == "PROF" else a for a in args]
    out = cli_here("train", *TINY, "--quiet", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("tessera train: error: "), out.stderr
    assert message in lines[0], lines[0]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()][1:]  # after the header


@pytest.mark.slow
def test_the_readme_command_profiles_its_step_and_prints_one_line(tmp_path):
    readme = (ROOT / "docs" / "training.md").read_text()
    command = re.search(r"^tessera train .*--profile-summary .*$", readme, re.M).group(0)
    argv = command.split()[1:]
    out = cli_here(*argv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    step = int(argv[argv.index("--profile-summary") + 1])
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"profile of step {step}: "))
    assert "matmul" in line and "memory peak" in line
    assert "profiler_start" not in out.stdout + out.stderr  # kineto's own lines kept out of the run's
    records = _records(tmp_path / argv[argv.index("--metrics") + 1])
    assert [("profile" in r) for r in records] == [r["step"] == step for r in records]
    profile = records[step - 1]["profile"]
    assert profile["time_s"]["matmul"] > 0 and profile["time_s"]["attention"] > 0
    memory = profile["memory"]
    assert memory["activations_bytes"] > 0 and memory["loss_bytes"] > 0 and memory["optimizer_state_bytes"] > 0


@pytest.mark.slow
def test_profiling_a_step_on_two_ranks_changes_no_loss(tmp_path):
    """dp2 x tp2 would be four ranks; dp2 keeps the test short and still sharded (FSDP2 gathers inside)."""
    runs = {}
    for name, extra in (("plain", []), ("profiled", ["--profile-summary", "2"])):
        metrics = tmp_path / f"{name}.jsonl"
        out = cli_here("train", *TINY, "--dp", "2", "--steps", "3", "--quiet", "--metrics", str(metrics), *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = _records(metrics)
    assert [r["loss"] for r in runs["plain"]] == [r["loss"] for r in runs["profiled"]]
    assert [r["grad_norm"] for r in runs["plain"]] == [r["grad_norm"] for r in runs["profiled"]]
    memory = runs["profiled"][1]["profile"]["memory"]
    assert memory["gradients_bytes"] > 0 and memory["peak_bytes"] > memory["parameters_bytes"]


def _committed_kernels() -> dict[str, str]:
    """Every top kernel's name in the committed H200 suite files -> the kind its profile gave it then."""
    names: dict[str, str] = {}

    def walk(x):
        if isinstance(x, dict):
            for k in x.get("top_kernels", []):
                names[k["name"]] = k["kind"]
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for f in sorted((ROOT / "benchmarks" / "results").glob("gpu_suite_h200*.json")):
        walk(json.loads(f.read_text())["results"])
    return names


# (a part of a committed H200 kernel name, its kind, what it is): issue 64 item 3's table
COMMITTED = [
    ("nvjet_sm90_tst_", "matmul", "GEMM"),
    ("nvjet_sm90_qrtst_", "matmul", "GEMM"),  # FP8 GEMMs
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "attention", "attention"),
    ("cudnn::fusion::compute_dot_do_o_specialized", "attention", "attention"),  # cuDNN's backward preprocessing
    ("_attention_bwd_dkdv_kernel", "attention", "attention"),
    ("FusedOptimizerTensorListMetadata", "optimizer_and_clipping", "fused AdamW"),
    ("TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpSca", "optimizer_and_clipping",
     "foreach (clip)"),
    ("_rms_norm_bwd_kernel", "norms", "norm"),
    ("triton_poi_fused_add_rms_norm_bwd_view_1", "norms", "norm"),
    ("float8_copy_kernel_cuda", "casts_and_copies", "FP8 cast"),
    ("triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_silu_t_view_21", "casts_and_copies", "FP8 cast"),
    ("_scaled_cast_kernel", "casts_and_copies", "FP8 cast"),  # tessera's one-pass cast (filed as elementwise once)
    ("launch_clamp_scalar", "casts_and_copies", "FP8 clamp"),
    ("AbsFunctor<c10::BFloat16>", "casts_and_copies", "FP8 amax"),
    ("MaxNanFunctor<c10::BFloat16>", "casts_and_copies", "FP8 amax"),
    ("triton_red_fused_abs_max_mul_silu_view_19", "casts_and_copies", "FP8 amax"),
    ("AbsMaxOps<c10::BFloat16", "casts_and_copies", "FP8 amax"),  # the fused cast's one-reduction amax
    ("chunk_cat_cuda_kernel", "casts_and_copies", "FSDP2 copy-in/out"),
    ("CatArrayBatchedCopy", "casts_and_copies", "FSDP2 copy-in/out"),
    ("bfloat16_copy_kernel_cuda", "casts_and_copies", "cast or copy"),
    ("direct_copy_kernel_cuda", "casts_and_copies", "cast or copy"),
    ("Memcpy DtoD (Device -> Device)", "casts_and_copies", "memcpy/memset"),
    ("_grad_kernel", "loss", "loss"),  # tessera's loss kernels: by the range they ran under
    # torch's plain elementwise loop is `gpu_kernel_impl_nocast`: an fp32 multiply (RoPE's, FP8's scaling) is no cast
    ("gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor",
     "other_elementwise", "other elementwise"),
    ("silu_backward_kernel", "other_elementwise", "other elementwise"),
    ("triton_poi_fused__unsafe_view_mul_silu_5", "other_elementwise", "other elementwise"),
]  # fmt: skip


@pytest.mark.parametrize("part, kind, what", COMMITTED, ids=[c[0][:40] for c in COMMITTED])
def test_every_committed_h200_kernel_is_classified_by_the_explicit_table(part, kind, what):
    from tessera.metrics.kernel_kinds import what_of

    names = [n for n in _committed_kernels() if part in n]
    assert names, f"no committed H200 kernel name holds {part!r}"
    for name in names:
        context = ["tessera: loss"] if name in ("_grad_kernel", "_row_stats_kernel") else []
        assert kind_of(name, context) == kind, name
        assert what_of(name, kind) == what, name


def test_every_committed_kernel_name_is_covered_and_no_nocast_kernel_is_a_cast():
    names = _committed_kernels()
    covered = {n for n in names for part, *_ in COMMITTED if part in n}
    assert len(names) >= 60 and covered, len(names)
    for name in names:
        if "nocast" in name and "copy_kernel" not in name:
            assert kind_of(name) != "casts_and_copies", name


def test_fragmentation_is_the_reserve_less_the_steps_true_peak():
    """Issue 64 item 3 on the H200 eager row's phases: the true peak is the backward's 74.4 GB; the reserve
    (81.6 GB) less it is 7.2 GB, where reserved minus the optimizer phase's own peak said 57.6 GB."""
    from tessera.metrics.step_profile import reserve_of

    gib = 2**30
    phases = {
        "forward": {"held_after": 66 * gib, "peak": 67 * gib, "reserved_peak": 70 * gib},
        "backward": {"held_after": 22 * gib, "peak": 69 * gib, "reserved_peak": 76 * gib},
        "optimizer": {"held_after": 22 * gib, "peak": 22 * gib, "reserved_peak": 23 * gib},
    }
    assert reserve_of(phases) == (76 * gib, 7 * gib)
    assert reserve_of({"forward": {"held_after": 1, "peak": 2}}) == (None, None)  # CPU: no allocator reserve
