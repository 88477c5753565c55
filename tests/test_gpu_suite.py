"""benchmarks/gpu_suite.py: one line and exit 2 without a GPU; --smoke runs every part at tiny sizes on CPU
(the JSON after every part, the profiles, the PNGs, the planner check's arithmetic); a run killed after its
second part leaves a valid JSON of two parts; parts that do not fit the budget are skipped and named; the
batch search starts from the planner, halves on out-of-memory and doubles while there is room. Figures are
never asserted here."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_suite import FULL, NEEDS, PARTS, SMOKE  # noqa: E402
from gpu_suite_parts import STARTUP_S, search_batch  # noqa: E402

from tessera.metrics.step_profile import KINDS, TOP_KERNELS  # noqa: E402

SUITE = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py")]


def _suite(*args, timeout=300):
    return subprocess.run([*SUITE, *args], capture_output=True, text=True, timeout=timeout)


def _readme_suite_commands() -> list[list[str]]:
    """The arguments of each README command line that runs the suite (up to a pipe or redirection)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "benchmarks.md").read_text(), re.S)
    found = re.findall(r"python benchmarks/gpu_suite\.py([^|&\n]*)", "\n".join(blocks))
    return [args.replace("2>", "").split() for args in found]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_fails_fast_with_one_line():
    full = next(c for c in _readme_suite_commands() if "--smoke" not in c)  # the README's GPU command
    out = _suite(*[a.replace("$OUT", "/tmp") for a in full])
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("gpu_suite: needs a CUDA GPU: ")


def test_bad_parts_and_budget_are_refused_in_one_line():
    out = _suite("--smoke", "--parts", "eager,warp")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "warp" in out.stderr and "triton" in out.stderr
    out = _suite("--smoke", "--budget-s", "0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--budget-s 0" in out.stderr


def test_the_default_budget_fits_seven_minutes():
    assert sum(FULL["budgets"].values()) + STARTUP_S <= 420
    assert list(FULL["budgets"]) == list(PARTS) == list(NEEDS)
    assert all(NEEDS[p] <= FULL["budgets"][p] for p in PARTS)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("suite")
    smoke = next(c for c in _readme_suite_commands() if "--smoke" in c)  # the README's, into out_dir
    smoke[smoke.index("--out") + 1] = str(out_dir)
    out = _suite(*smoke)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, out_dir


def test_smoke_runs_every_part_and_writes_the_json_and_pngs(smoke):
    out, out_dir = smoke
    for part in PARTS:
        assert any(f"] {part}: " in ln for ln in out.stdout.splitlines()), part  # progress lines, with elapsed time
    # the whole stderr on failure: a leaked-semaphore warning was seen twice in 13 CI runs, never here
    assert "leaked semaphore" not in out.stderr, out.stderr[-6000:]
    assert "profiler_start" not in out.stdout + out.stderr
    files = sorted(p.name for p in out_dir.iterdir())
    assert len(files) <= 8 and all((out_dir / f).is_file() for f in files)  # flat, nothing left half-written
    assert files == [f"gpu_suite_smoke_cpu{s}" for s in ("-attention.png", "-planner.png", "-train.png", ".json")]
    data = json.loads((out_dir / "gpu_suite_smoke_cpu.json").read_text())
    assert data["device"]["device"] and data["versions"]["torch"] and data["config"]["smoke"] is True
    r = data["results"]
    assert r["parts_done"] == list(PARTS) and r["skipped"] == []
    assert r["triton"]["all_ok"] and {c["kernel"] for c in r["triton"]["checks"]} == {
        "attention",
        "rms_norm",
        "fp8_cast",
    }
    assert "causal attention" in r["mfu_formula"]
    eager = r["eager"]
    assert eager["planner_start"] == 2 and [a["outcome"] for a in eager["attempts"]] == ["ran"]
    for mode in ("eager", "compiled"):
        row = r[mode]["row"]
        assert row is not None, (mode, r[mode]["attempts"], out.stdout[-3000:])  # why no batch ran, by name
        assert row["global_batch"] == 2 and row["options"]["compile"] == (mode == "compiled")
        assert row["compute_dtype"] == "float32" and row["tokens_per_s"] > 0
        profile = row["profile"]
        assert profile["step"] == SMOKE["steps"]  # the last: after the warm-up, out of the timed steps
        assert set(profile["time_s"]) == set(KINDS) | {"idle"}
        assert sum(profile["time_s"].values()) == pytest.approx(profile["step_wall_s"], rel=1e-6)
        assert 0 < len(profile["top_kernels"]) <= TOP_KERNELS and profile["time_s"]["matmul"] > 0
        memory = profile["memory"]
        assert memory["parameters_bytes"] > 0 and memory["optimizer_state_bytes"] > 0
        assert memory["gradients_bytes"] > 0 and memory["activations_bytes"] > 0 and memory["loss_bytes"] > 0
        assert memory["peak_bytes"] == max(p["peak"] for p in memory["phases"].values())
        assert sum(memory["held_at_peak"].values()) + memory["other_at_peak_bytes"] == memory["peak_bytes"]
    base = r["baseline"]
    assert base["row"]["global_batch"] == 2 and base["row"]["compute_dtype"] == "float32"
    assert base["tessera_over_baseline"] == pytest.approx(eager["row"]["step_time_s"] / base["row"]["step_time_s"])
    # the strongest baseline (the backend tessera picks) and SDPA's default as a second named row, each naming
    # the backend that ran (on CPU both take SDPA's CPU flash kernel)
    assert base["row"]["attention_mode"] == "best" and base["row"]["attention_backend"] == "flash_attention"
    other = base["sdpa_default"]
    assert other is not None and other["attention_mode"] == "sdpa-default" and other["global_batch"] == 2
    assert base["tessera_over_sdpa_default_baseline"] == pytest.approx(
        eager["row"]["step_time_s"] / other["step_time_s"]
    )
    compiled = r["compiled"]
    assert compiled["tessera_over_baseline"] == pytest.approx(
        compiled["row"]["step_time_s"] / compiled["baseline"]["row"]["step_time_s"]
    )
    assert {a["impl"] for a in r["kernels"]["attention"]} >= {"tessera_triton"} and r["kernels"]["rms_norm"]
    assert {s["impl"] for s in r["kernels"]["swiglu"]} == {"tessera_triton", "torch_eager"}  # compile: CUDA only
    assert [x["fwd_bwd_vs_torch_eager"] > 0 for x in r["kernels"]["ratios"]["swiglu"]] == [True]
    check = r["planner"]
    assert check["calibration"]["matmul_flops_per_s"] > 0 and check["of"] == 2
    for c in check["rows"]:
        assert c["step_ratio"] == pytest.approx(c["measured_step_s"] / c["predicted_step_s"])
        assert c["memory_ratio"] == pytest.approx(c["measured_memory_bytes"] / c["predicted_memory_bytes"])
    for kind in ("attention", "train", "planner"):
        assert (out_dir / f"gpu_suite_smoke_cpu-{kind}.png").stat().st_size > 10_000


def test_a_run_killed_after_its_second_part_leaves_a_valid_json_of_both(tmp_path):
    proc = subprocess.Popen(
        [*SUITE, "--smoke", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its rank processes too, as a lease's end kills them
    )
    try:
        for line in proc.stdout:
            if re.match(r"\[\d\d:\d\d\] eager: tried ", line):  # printed once the JSON holds the part
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    r = json.loads((tmp_path / "gpu_suite_smoke_cpu.json").read_text())["results"]
    assert r["parts_done"][:2] == ["triton", "eager"] and r["eager"]["row"]["tokens_per_s"] > 0


def test_parts_that_do_not_fit_the_budget_are_skipped_and_named(tmp_path):
    # moe: the quickest part on CPU (the smoke above runs triton's interpreted kernels already); parts run in
    # the suite's order, so a part that fits still runs after two that did not
    out = _suite("--smoke", "--out", str(tmp_path), "--parts", "moe,eager,compiled", "--budget-s", "30")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads((tmp_path / "gpu_suite_smoke_cpu.json").read_text())["results"]
    assert r["parts_asked"] == ["eager", "compiled", "moe"] and r["parts_done"] == ["moe"]
    assert [s["part"] for s in r["skipped"]] == ["eager", "compiled"]
    assert "needs about 45 s" in r["skipped"][0]["why"] and "eager: skipped" in out.stdout


class OOM(RuntimeError):
    pass


def test_the_batch_search_halves_on_out_of_memory_and_doubles_while_there_is_room():
    def runner(limit, ran):
        def run(batch):
            ran.append(batch)
            if batch > limit:
                raise OOM("rank 0 failed:\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"global_batch": batch, "peak_bytes": batch}

        return run

    ran = []
    best, attempts = search_batch(runner(4, ran), 16, lambda row, b: True, lambda: 1e9)
    assert ran == [16, 8, 4] and best["global_batch"] == 4  # halved twice, never doubled after a failure
    assert [a["outcome"] for a in attempts] == ["out of memory", "out of memory", "ran"]
    assert "OutOfMemoryError" in attempts[0]["detail"]

    ran = []
    best, attempts = search_batch(runner(8, ran), 2, lambda row, b: b < 64, lambda: 1e9)
    assert ran == [2, 4, 8, 16] and best["global_batch"] == 8  # doubled while there was room, up to the failure

    ran = []
    best, _ = search_batch(runner(64, ran), 2, lambda row, b: b < 8, lambda: 1e9)
    assert ran == [2, 4, 8] and best["global_batch"] == 8  # grow() said no more room

    def broken(batch):
        raise ValueError("something else")

    best, attempts = search_batch(broken, 4, lambda row, b: True, lambda: 1e9)
    assert best is None and attempts == [{"batch": 4, "outcome": "error", "detail": "something else"}]

    ran = []  # no time left for a second attempt
    best, attempts = search_batch(runner(1, ran), 4, lambda row, b: True, lambda: 0.0)
    assert ran == [4] and best is None and attempts[-1]["outcome"] == "skipped"


def test_the_batch_grows_by_the_measured_per_sequence_bytes_not_the_whole_peak():
    """Issue 64 item 4, on the committed H200 row (2026-12-04): batch 16 peaked at 73.6 GB with 18.1 GB held at
    the step's start (weights and optimizer state, the same at any batch); batch 32 then needs 129.1 GB of the 135
    usable."""
    from gpu_suite_parts import peak_at

    results = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/gpu_suite_h200.json").read_text())
    row = results["results"]["eager"]["row"]
    start = row["profile"]["memory"]["step_start_bytes"]
    assert peak_at(row, 32) == pytest.approx(start + 2 * (row["peak_bytes"] - start))
    assert peak_at(row, 32) / 1e9 == pytest.approx(129.1, abs=0.1)
    capacity = 0.9 * results["device"]["gpu_memory_bytes"]
    assert peak_at(row, 32) <= capacity < 2 * row["peak_bytes"]  # the old rule (the whole peak doubled) stopped
    assert peak_at({"peak_bytes": 100, "global_batch": 4}, 8) == 200  # no profile: the whole peak scales


def test_the_one_call_lease_script_parses_and_runs_the_suite_before_the_peer_rows():
    """benchmarks/gpu_lease.sh (a whole lease in one device call): bash reads it, the suite comes first (its figures
    are the lease's first purpose), and it refuses to run without the OUT folder the files come back from."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_lease.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    commands = [ln for ln in script.read_text().splitlines() if ln.startswith(("python", "timeout"))]
    assert [i for i, ln in enumerate(commands) if "gpu_suite.py" in ln] < [
        i for i, ln in enumerate(commands) if "bench_peer.py" in ln
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "OUT must name the folder" in done.stderr
