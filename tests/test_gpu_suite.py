"""benchmarks/gpu_suite.py: one line and exit 2 without a GPU; --smoke runs every part at tiny sizes on CPU
(JSON schema, PNGs, the planner check's arithmetic); the batch sweep stops at the first out-of-memory.
Figures are never asserted here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_suite import sweep  # noqa: E402


def _suite(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_fails_fast_with_one_line():
    full = next(c for c in _readme_suite_commands() if "--smoke" not in c)  # the README's GPU command
    out = _suite(*full)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("gpu_suite: needs a CUDA GPU: ")


def _readme_suite_commands() -> list[list[str]]:
    import re

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [ln.split()[2:] for b in blocks for ln in b.splitlines() if ln.startswith("python benchmarks/gpu_suite.py")]


def test_smoke_runs_every_part_and_writes_the_json_and_pngs(tmp_path):
    smoke = next(c for c in _readme_suite_commands() if "--smoke" in c)  # the README's, into tmp_path
    smoke[smoke.index("--out") + 1] = str(tmp_path)
    out = _suite(*smoke)
    assert out.returncode == 0, out.stderr[-3000:]
    for part in ("calibrate", "kernels", "eager", "compiled", "baseline", "planner"):
        assert any(f"] {part}: " in ln for ln in out.stdout.splitlines()), part  # progress lines, with elapsed time
    data = json.loads((tmp_path / "gpu_suite_smoke_cpu.json").read_text())
    assert data["device"]["device"] and data["versions"]["torch"] and data["config"] == {"smoke": True}
    r = data["results"]
    assert r["calibration"]["matmul_flops_per_s"] > 0 and r["calibration"]["dtype"] == "float32"
    assert {a["impl"] for a in r["kernels"]["attention"]} >= {"tessera_triton"} and r["kernels"]["rms_norm"]
    assert "causal attention" in r["mfu_formula"]
    for mode in ("eager", "compiled"):
        sweep_ = r["train"][mode]
        assert [row["global_batch"] for row in sweep_["rows"]] == [1, 2] and sweep_["stopped"] is None
        assert sweep_["largest_batch"] == 2
        for row in sweep_["rows"]:
            assert row["options"]["compile"] == (mode == "compiled") and row["compute_dtype"] == "float32"
            assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_device"] > 0
            assert row["predicted"]["calibrated"] and row["predicted"]["step_time_s"] > 0
            assert row["measured_over_predicted"]["step_time"] == pytest.approx(
                row["step_time_s"] / row["predicted"]["step_time_s"]
            )
            assert row["measured_over_predicted"]["memory"] == pytest.approx(
                row["peak_tensor_bytes_rank0"] / row["predicted"]["memory_bytes"]["total"]
            )
    base = r["baseline"]
    assert base["row"]["global_batch"] == 2 and base["row"]["compute_dtype"] == "float32"
    eager2 = r["train"]["eager"]["rows"][1]
    assert base["tessera_eager_over_baseline"] == pytest.approx(eager2["step_time_s"] / base["row"]["step_time_s"])
    check = r["planner"]
    assert check["of"] == 4 and len(check["rows"]) == 4
    for c in check["rows"]:
        assert c["step_ratio"] == pytest.approx(c["measured_step_s"] / c["predicted_step_s"])
    for kind in ("attention", "train", "planner"):
        assert (tmp_path / f"gpu_suite_smoke_cpu-{kind}.png").stat().st_size > 10_000


class OOM(RuntimeError):
    pass


def test_the_batch_sweep_stops_at_the_first_out_of_memory_and_records_it():
    ran = []

    def run(batch):
        ran.append(batch)
        if batch >= 4:
            raise OOM("rank 0 failed:\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"global_batch": batch}

    rows, stopped = sweep(run, [1, 2, 4, 8], budget_s=1e9)
    assert ran == [1, 2, 4] and [r["global_batch"] for r in rows] == [1, 2]
    assert stopped["batch"] == 4 and stopped["reason"] == "out of memory" and "OutOfMemoryError" in stopped["detail"]

    def broken(batch):
        raise ValueError("something else")

    assert sweep(broken, [1, 2], 1e9) == ([], {"batch": 1, "reason": "error", "detail": "something else"})

    ticks = iter(range(0, 1000, 10))  # each run takes 10 "seconds" of a fake clock
    rows, stopped = sweep(lambda b: {"global_batch": b}, [1, 2, 4, 8], budget_s=25, clock=lambda: next(ticks))
    assert [r["global_batch"] for r in rows] == [1] and stopped["reason"] == "budget" and stopped["batch"] == 2
