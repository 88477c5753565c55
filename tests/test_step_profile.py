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
