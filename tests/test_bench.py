"""`tessera bench`: layouts through the real training job, JSON with the figures and predictions, PNG plots."""

import json

import pytest

from helpers import cli_here
from hypothesis import given
from hypothesis import strategies as st

from tessera.commands.bench import parse_layout, series_layouts


def _tessera(*args, cwd=None):
    return cli_here(*args, cwd=cwd)


@given(
    st.dictionaries(st.sampled_from(["pp", "dpr", "dp", "cp", "tp", "ep"]), st.integers(1, 8), min_size=1),
    st.lists(st.sampled_from(["sp", "ac_op", "zero2"]), unique=True),
)
def test_layout_names_parse_to_their_degrees(degrees, options):
    name = "x".join(f"{a}{d}" for a, d in degrees.items()) + "".join("+" + o for o in options)
    kw = parse_layout(name)
    for axis in ("pp", "cp", "tp", "ep"):
        assert kw.get(axis, 1) == degrees.get(axis, 1)
    dp = degrees.get("dp", 1) * degrees.get("dpr", 1)
    assert kw.get("dp", 1) == dp and kw.get("dp_replicate", 1) == (degrees.get("dpr", 1) if dp > 1 else 1)
    assert kw.get("sequence_parallel", False) == ("sp" in options)


def test_series_double_the_ranks():
    assert series_layouts("weak", 4, 2) == [("one", 2), ("dp2", 4), ("dp4", 8)]
    assert series_layouts("strong", 4, 8) == [("one", 8), ("dp2", 8), ("dp4", 8)]
    with pytest.raises(ValueError, match="--max-ranks 3 must be a power of two"):
        series_layouts("weak", 3, 2)
    with pytest.raises(ValueError, match="--global-batch 6 fixed; it must divide over --max-ranks 4"):
        series_layouts("strong", 4, 6)


def test_bench_runs_layouts_and_writes_json_and_plots(tmp_path):
    out = _tessera(
        "bench",
        "--model",
        "debug",
        "--layouts",
        "one,dp2,tp2+sp,pp2xdp2",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--seq-len",
        "32",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    progress = [ln for ln in out.stdout.splitlines() if ln.startswith("bench [")]
    assert len(progress) == 8 and "tok/s" in progress[-1]  # a line as each layout starts and one as it ends
    data = json.loads((tmp_path / "bench-debug-layouts-cpu.json").read_text())
    assert (
        data["device"]["device"]
        and data["versions"]["torch"]
        and "6 x matmul parameters" in data["config"]["mfu_formula"]
    )
    rows = data["results"]["layouts"]
    assert [r["layout"] for r in rows] == ["one", "dp2", "tp2+sp", "pp2xdp2"] and [r["ranks"] for r in rows] == [
        1,
        2,
        2,
        4,
    ]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_bytes_rank0"] > 0
        assert r["exposed_comm_s"] + r["compute_and_fsdp_s"] == pytest.approx(r["step_time_s"])
        assert r["predicted"]["memory_bytes"]["total"] > 0 and r["peak_tensor_bytes_rank0"] > 0
        for axis, want in r["predicted"]["comm_bytes"].items():  # the first step's bytes, counted and predicted
            if want:
                assert r["comm_bytes_counted"][axis] == pytest.approx(want, rel=0.02), (r["layout"], axis)
        assert r["losses"] == pytest.approx(rows[0]["losses"], rel=1e-5)  # every layout trains the same model
    assert rows[2]["collective_wait_s_by_axis"]["tp"] > 0 and rows[3]["comm_bytes_counted"]["pp"] > 0
    for kind in ("throughput", "memory", "predicted"):
        assert (tmp_path / f"bench-debug-layouts-cpu-{kind}.png").stat().st_size > 10_000
    # a dense model: no expert load anywhere (absent, not zeros), and the JSON says why
    assert all("moe" not in r for r in rows) and data["config"]["moe_load"].startswith("absent: debug is a dense model")
    assert not list(tmp_path.glob("*moe_load*"))


def test_bench_weak_series(tmp_path):
    out = _tessera(
        "bench",
        "--series",
        "weak",
        "--max-ranks",
        "2",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--seq-len",
        "32",
        "--global-batch",
        "2",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "bench-debug-weak-cpu.json").read_text())["results"]["layouts"]
    assert [(r["layout"], r["global_batch"]) for r in rows] == [("one", 2), ("dp2", 4)]
    assert rows[0]["scaling_efficiency"] == 1.0 and rows[1]["scaling_efficiency"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layouts", "dp2xq2"], r"layout 'dp2xq2': 'q2' is not <axis><degree>"),
        (["--layouts", "dp2+fast"], r"unknown option \+fast"),
        (["--layouts", "tp3"], r"tp=3 does not divide the 4 attention heads"),
        (["--layouts", "one", "--series", "weak"], r"give --layouts L1,L2,... or --series"),
        (["--layouts", "one", "--steps", "2", "--warmup", "2"], r"--steps 2 must exceed --warmup 2"),
        (["--layouts", "one", "--warmup", "1"], r"--warmup 1 must be at least 2"),
    ],
)
def test_bench_refuses_bad_requests_in_one_line(tmp_path, args, message):
    import re

    out = cli_here("bench", *args, "--out", str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and re.search(message, out.stderr), (
        out.stderr
    )


def test_bench_rows_carry_dtype_predictions_and_the_baseline_as_the_readme_runs_it(tmp_path):
    """The README's bench command with --baseline: each row has the dtype the matmuls ran in (from the step
    records), the planner's calibrated step time and memory with measured / predicted, and tessera / baseline."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for ln in block.splitlines()]
    command = next(ln for ln in lines if ln.startswith("tessera bench ") and "--baseline" in ln)
    args = command.split()[1:]
    args[args.index("--out") + 1] = str(tmp_path)
    out = _tessera(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bench: cpu: " in out.stdout and "bench [baseline]" in out.stdout
    model = args[args.index("--model") + 1]
    data = json.loads((tmp_path / f"bench-{model}-layouts-cpu.json").read_text())
    assert data["config"]["attention_flops_included"] and "causal attention" in data["config"]["mfu_formula"]
    assert data["config"]["calibration"]["matmul_flops_per_s"] > 0
    rows, base = data["results"]["layouts"], data["results"]["baseline"]
    assert [r["options"]["compile"] for r in rows] == [False, True]
    for r in rows:
        assert r["compute_dtype"] == "float32" and r["predicted"]["calibrated"]
        assert r["measured_over_predicted"]["step_time"] == pytest.approx(
            r["step_time_s"] / r["predicted"]["step_time_s"]
        )
        assert r["measured_over_predicted"]["memory"] == pytest.approx(
            r["peak_tensor_bytes_rank0"] / r["predicted"]["memory_bytes"]["total"]
        )
        assert r["step_time_vs_baseline"] == pytest.approx(r["step_time_s"] / base["step_time_s"])
    assert (
        base["compute_dtype"] == "float32" and base["global_batch"] == rows[0]["global_batch"] and not base["compile"]
    )
    assert base["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=1e-4)  # the same weights and batch


UNTIMED_CASES = {  # options -> whether a compiled block then holds collectives nothing times
    "tp2+sp": (dict(tp=2, sequence_parallel=True), False),
    "tp2+sp+compile": (dict(tp=2, sequence_parallel=True, compile=True), True),
    "cp2-allgather+compile": (dict(cp=2, cp_method="allgather", compile=True), True),
    "cp2-ring+compile": (dict(cp=2, compile=True), False),  # the ring's sends break the graph: eager, timed
}


@pytest.mark.parametrize("case", list(UNTIMED_CASES))
def test_a_row_whose_compiled_blocks_hold_collectives_says_its_exposed_comm_is_not_measured(case):
    """Inside a compiled block tp's collectives (and cp's all-gathers) are ops of its graph and nothing times them:
    such a row says its exposed communication was not measured instead of reporting the eager collectives' sum
    as the whole."""
    from helpers import small_config
    from tessera.commands.bench import _exposed, _row

    options, untimed = UNTIMED_CASES[case]
    config = small_config(**options)
    history = [
        dict(step=s, step_time_s=0.1, loss=5.0, collective_wait_s={"tp": 0.01}, peak_memory_bytes=1 << 20)
        for s in (1, 2, 3)
    ]
    row = _row(case, config, history, warmup=1, peak=None, on_gpu=False)
    if untimed:
        assert row["exposed_comm_s"] is None and row["compute_and_fsdp_s"] is None
        assert "not measured" in row["exposed_comm_note"] and "not measured" in _exposed(row)
    else:
        assert row["exposed_comm_s"] == pytest.approx(0.01) and row["compute_and_fsdp_s"] == pytest.approx(0.09)
        assert "exposed_comm_note" not in row and _exposed(row) == "10.0 ms exposed communication"


def test_a_rows_mfu_reads_the_dtype_probe_from_the_warmup_step_that_holds_it():
    """The probe's breakdown is in the first step's record only, and that step is a warmup: a row that read the
    first timed step's record found none and stated an FP8 step against the bf16 peak (66.8% on the H200 suite
    of 2026-12-04, where the FP8 peak gives half that)."""
    from helpers import small_config
    from tessera.commands.bench import _row

    config = small_config()
    history = [
        dict(step=s, step_time_s=0.1, loss=5.0, collective_wait_s={}, peak_memory_bytes=1 << 20) for s in (1, 2, 3)
    ]
    history[0].update(compute_dtype="float8", matmul_flops_by_dtype={"float8_e4m3fn": 3e12, "bfloat16": 1e12})
    peak = 989e12
    row = _row("fp8", config, history, warmup=1, peak=peak, on_gpu=False)
    assert row["compute_dtype"] == "float8" and row["mfu"] is None
    assert row["fp8_matmul_flop_share"] == pytest.approx(0.75)
    flops = row["mfu_fp8_peak"] * 0.1 * row["devices"] * 2 * peak
    assert row["mfu_fp8_blended_peak"] == pytest.approx(
        flops / (0.1 * row["devices"] / (0.75 / (2 * peak) + 0.25 / peak))
    )
    history[0].update(compute_dtype="bfloat16", matmul_flops_by_dtype={"bfloat16": 4e12})
    assert _row("bf16", config, history, warmup=1, peak=peak, on_gpu=False)["mfu"] > 0


def test_mfu_is_stated_only_against_the_peak_the_matmuls_ran_at():
    """Issue 64 item 2: an FP8 row's MFU was measured against the bf16 peak (64.7% where the FP8 peak gives 32.3%).
    The records' dtype probe decides: bf16 against the bf16 peak; FP8 against the FP8 peak and the peak blended by
    the FLOPs that ran in FP8, both named; emulated FP8 (CPU) against none."""
    from tessera.metrics.results import mfu_by_dtype

    peak = 989e12
    bf16 = mfu_by_dtype(1e15, 2.0, 1, peak, {"bfloat16": 9e14})
    assert bf16 == {"mfu": pytest.approx(1e15 / (2.0 * peak))}
    fp8 = mfu_by_dtype(1e15, 2.0, 1, peak, {"float8_e4m3fn": 3e14, "bfloat16": 1e14})
    assert fp8["mfu"] is None and fp8["fp8_matmul_flop_share"] == pytest.approx(0.75)
    assert fp8["mfu_fp8_peak"] == pytest.approx(1e15 / (2.0 * 2 * peak))
    blended = 1 / (0.75 / (2 * peak) + 0.25 / peak)  # a float64 definition of the FLOP-weighted peak
    assert fp8["mfu_fp8_blended_peak"] == pytest.approx(1e15 / (2.0 * blended))
    assert fp8["mfu_fp8_peak"] < fp8["mfu_fp8_blended_peak"] < bf16["mfu"]
    emulated = mfu_by_dtype(1e15, 2.0, 1, 1e11, {"float8_emulated": 3e14, "float32": 1e14})
    assert emulated["mfu"] is None and "emulated" in emulated["mfu_note"]
    assert mfu_by_dtype(1e15, 2.0, 1, None, {"bfloat16": 1.0}) == {"mfu": None}
