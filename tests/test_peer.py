"""The torchtitan peer of benchmarks/bench_peer.py: its checks pass on this torch (its commands read by torchtitan's
own config manager, its model in tessera's shapes, torchtitan's own trainer on the CPU in bf16 and through its
float8 converter), its log parser reads torchtitan's step lines, and its bad input gets one line."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

pytest.importorskip("torchtitan", reason="the test extra installs torchtitan (pyproject.toml)")

import bench_peer  # noqa: E402
import peer_torchtitan as peer  # noqa: E402


def _docs_commands() -> list[str]:
    """The bench_peer.py command lines of docs/benchmarks.md's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (BENCH.parent / "docs" / "benchmarks.md").read_text(), re.S)
    return re.findall(r"python benchmarks/bench_peer\.py[^|&\n]*", "\n".join(blocks))


@pytest.mark.slow
def test_the_peer_checks_pass_as_the_docs_run_them():
    (command,) = [c for c in _docs_commands() if "--check" in c]
    args = command.split()[2:]
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_peer.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "both rows' commands read as asked" in line and "1,498,482,688 parameters" in line, line
    assert "bf16: losses" in line and "fp8: losses" in line, line


@pytest.mark.slow
def test_the_smoke_runs_every_row_of_both_trainers_and_writes_the_json(tmp_path):
    (command,) = [c for c in _docs_commands() if "--smoke" in c]
    args = [a.replace("/tmp/peer", str(tmp_path)) for a in command.split()[2:]]
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_peer.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "peer-torchtitan-smoke-cpu.json").read_text())
    results = record["results"]
    for precision in ("bf16", "fp8"):
        ours, theirs = results["rows"][precision]["tessera"], results["rows"][precision]["torchtitan"]
        assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0 and theirs["returncode"] == 0, (ours, theirs)
        ratio = results[f"tessera_over_torchtitan_{precision}"]
        assert math.isclose(ratio, ours["tokens_per_s"] / theirs["tokens_per_s"])
        assert theirs["float8_linears"] == (precision == "fp8")
        assert [s["step"] for s in theirs["steps"]] == list(range(1, record["config"]["steps"] + 1))


def _torchtitan_line(step: int, loss: float, grad_norm: float, gib: float, pct: float, tps: float, color: bool):
    """A step line as torchtitan 0.2.2's MetricsProcessor.log formats it (components/metrics.py), its colour
    codes included where asked."""
    c = (lambda code: f"\x1b[{code}m") if color else (lambda code: "")
    return (
        f"[titan] 2026-12-03 09:07:44,035 - root - INFO - {c(31)}step: {step:2}  {c(32)}loss: {loss:8.5f}  "
        f"{c(33)}grad_norm: {grad_norm:7.4f}  {c(36)}memory: {gib:5.2f}GiB({pct:.2f}%)  "
        f"{c(34)}tps: {round(tps):,}  {c(96)}tflops: {tps * 1e-6:,.2f}  {c(35)}mfu: {pct:.2f}%{c(39)}"
    )


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.floats(0.0, 20.0),
            st.floats(0.0, 100.0),
            st.floats(0.0, 140.0),
            st.floats(0.0, 100.0),
            st.floats(1.0, 5e6),
        ),
        min_size=1,
        max_size=6,
    ),
    color=st.booleans(),
)
def test_parse_steps_reads_back_every_step_torchtitan_logs(rows, color):
    lines = ["[titan] INFO - Training starts at step 1"]
    for i, (loss, grad_norm, gib, pct, tps) in enumerate(rows, start=1):
        lines.append(_torchtitan_line(i, loss, grad_norm, gib, pct, tps, color))
        lines.append("[titan] INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40")
    steps = peer.parse_steps("\n".join(lines))
    assert [s["step"] for s in steps] == list(range(1, len(rows) + 1))
    for s, (loss, grad_norm, gib, _, tps) in zip(steps, rows):
        assert math.isclose(s["loss"], round(loss, 5), abs_tol=1e-5)
        assert math.isclose(s["grad_norm"], round(grad_norm, 4), abs_tol=1e-4)
        assert math.isclose(s["memory_gib"], round(gib, 2), abs_tol=1e-2)
        assert s["tps"] == round(tps)


def test_the_peer_builds_tessera_presets_and_refuses_a_width_torchtitan_cannot():
    for preset in peer.PRESETS:
        from tessera.models import get_preset

        c, a = get_preset(preset), peer.model_args(preset)
        ffn = a.multiple_of * -(-int(8 * a.dim / 3) // a.multiple_of)  # torchtitan's FeedForward width rule
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, ffn) == (
            c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.ffn_dim
        )  # fmt: skip
    with pytest.raises(ValueError, match="emulates float8 tensorwise only, not rowwise"):
        peer.command_args(peer.PeerRow("debug", 2, 32, 3, False, fp8="rowwise", emulate=True), "/tmp")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precisions", "bf16,fp4"], "precision 'fp4' is not one of bf16, fp8"),
        (
            ["--steps", "4"],
            "--steps 4 leaves no timed step after the 3 warmup steps and tessera's profiled last one: use --steps 5 "
            "or more",
        ),
        ([], "no CUDA device here (torchtitan's trainer runs on CUDA); --check runs on CPU"),
    ],
)
def test_bench_peer_refuses_bad_input_in_one_line(argv, message):
    if not argv:  # the docs' GPU command, as written
        (command,) = [c for c in _docs_commands() if "--out" in c and "--smoke" not in c]
        argv = [a.replace("$OUT", "/tmp") for a in command.split()[2:]]
    import torch

    if message.startswith("no CUDA") and torch.cuda.is_available():
        pytest.skip("a GPU is here: the command would run")
    with pytest.raises(SystemExit) as e:
        bench_peer.main(argv)
    assert str(e.value) == f"bench_peer: {message}"
