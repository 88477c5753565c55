"""Mixture of experts in the benchmarks: `tessera bench`'s expert-load entry and plot for an MoE model (a dense
model's absence of both is checked in test_bench.py's run), benchmarks/bench_moe.py --quick's JSON, and the
grouped-GEMM measurement gpu_suite.py runs as its "moe" row. Figures are never asserted, only their fields
and the arithmetic between them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import cli_here, script_here
from tessera.commands.bench import moe_load, parse_layout

ROOT = Path(__file__).resolve().parents[1]


def test_ep_layouts_parse():
    assert parse_layout("dp4xep2") == {"dp": 4, "dp_replicate": 1, "ep": 2}
    assert parse_layout("dp2xcp2xep4+sp")["ep"] == 4


def test_moe_load_summarizes_the_measured_steps_and_is_none_for_a_dense_model():
    def record(step: int, tokens: list[list[int]], aux: float) -> dict:
        imbalance = [max(layer) / (sum(layer) / len(layer)) for layer in tokens]
        return {
            "step": step,
            "moe": {
                "tokens_per_expert": tokens,
                "imbalance": imbalance,
                "max_imbalance": max(imbalance),
                "aux_loss": aux,
            },
        }

    records = [record(3, [[4, 0], [2, 2]], 0.5), record(4, [[3, 1], [1, 3]], 0.25), record(5, [[2, 2], [4, 0]], 0.75)]
    load = moe_load(records)
    assert [s["step"] for s in load["steps"]] == [3, 4, 5] and load["n_layers"] == 2 and load["n_experts"] == 2
    assert load["imbalance_median_per_layer"] == [1.5, 1.5] and load["max_imbalance"] == 2.0
    assert load["aux_loss_median"] == 0.5
    assert moe_load([{"step": 1, "loss": 1.0}, {"step": 2, "moe": None}]) is None  # dense: nothing, not zeros


def test_bench_of_an_moe_model_writes_the_expert_load_and_its_plot(tmp_path):
    out = cli_here(
        "bench",
        "--model",
        "qwen3-moe-debug",
        "--layouts",
        "one,dp2xep2",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--seq-len",
        "32",
        "--global-batch",
        "2",
        "--no-calibrate",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(
        "experts: max/mean imbalance" in ln
        for ln in out.stdout.splitlines()
        if ln.startswith("bench [") and "tok/s" in ln
    )
    data = json.loads((tmp_path / "bench-qwen3-moe-debug-layouts-cpu.json").read_text())
    assert "moe_load.png" in data["config"]["moe_load"]
    rows = data["results"]["layouts"]
    assert [r["degrees"]["ep"] for r in rows] == [1, 2]
    for r in rows:
        load = r["moe"]
        assert load["n_layers"] == 2 and load["n_experts"] == 8
        assert [s["step"] for s in load["steps"]] == [3]  # the measured steps only (after --warmup 2)
        last = load["steps"][-1]
        for layer, imbalance in zip(last["tokens_per_expert"], last["imbalance"]):
            assert len(layer) == 8 and sum(layer) == 2 * 32 * 2  # every token reaches its top-2 experts
            assert imbalance == pytest.approx(max(layer) / (sum(layer) / 8), abs=1e-4)
        assert last["max_imbalance"] == pytest.approx(max(last["imbalance"]), abs=1e-4) and last["aux_loss"] > 0
    # expert parallel routes as one process does: the same tokens to the same experts; its auxiliary loss is
    # equal up to float reassociation (the numerics contract's 1e-5)
    ep_step, one_step = rows[1]["moe"]["steps"][-1], rows[0]["moe"]["steps"][-1]
    assert ep_step["tokens_per_expert"] == one_step["tokens_per_expert"]
    assert ep_step["aux_loss"] == pytest.approx(one_step["aux_loss"], rel=1e-5)
    assert (tmp_path / "bench-qwen3-moe-debug-layouts-cpu-moe_load.png").stat().st_size > 10_000


def test_grouped_vs_loop_measures_each_path_and_compares_it_with_the_loop():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_moe import grouped_vs_loop

    r = grouped_vs_loop(4, 16, 8, 12, 2, reps=1, warmup=0, naive=True)  # about gpu_suite's smoke sizes
    assert r["routed_rows"] == 24 and sum(r["tokens_per_expert"]) == 24 and not r["grouped_mm_supported"]  # CPU
    loop, naive = r["rows"]["loop"], r["rows"]["token_by_token"]
    assert loop["forward_s"] > 0 and loop["forward_backward_s"] > 0 and loop["max_abs_diff_vs_loop"] == 0
    assert naive["max_abs_diff_vs_loop"] < 1e-5  # the same products, one row at a time
    assert naive["forward_backward_vs_loop"] == pytest.approx(naive["forward_backward_s"] / loop["forward_backward_s"])
    grouped = r["rows"]["grouped_mm"]  # times where torch._grouped_mm runs on this device, else its error
    assert ("error" in grouped) != ("forward_s" in grouped)


def test_bench_moe_quick_writes_its_json(tmp_path):
    out = script_here("bench_moe", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = tmp_path.glob("moe_*_quick.json")  # moe_cpu_quick.json here; moe_h100_quick.json on an H100
    data = json.loads(path.read_text())
    assert data["device"]["device"] and data["versions"]["torch"] and data["config"]["quick"]
    r = data["results"]
    assert 0 < r["model"]["expert_param_share"] < 1 and 0 < r["model"]["expert_matmul_flop_share"] < 1
    rows = r["ep"]["rows"]
    assert [row["ep"] for row in rows] == [1, 2] and [row["layout"] for row in rows] == ["dp2", "dp2xep2"]
    for row in rows:
        assert row["step_time_s"] > 0 and len(row["step_times_s"]) == 1 and len(row["step_times_s"][0]) == 1
        assert row["ratio_to_ep1"] == pytest.approx(row["step_time_s"] / rows[0]["step_time_s"])
        assert row["max_loss_diff_vs_ep1"] < 1e-4 and row["expert_load"]["tokens_per_expert"]
    assert (
        rows[0]["comm_bytes_step1_rank0"]["all_to_all_bytes"]
        == 0
        < rows[1]["comm_bytes_step1_rank0"]["all_to_all_bytes"]
    )
    cpu = r["gemm"]["cpu"]
    assert cpu["device"] == "cpu" and cpu["dtype"] == "float32" and cpu["routed_rows"] == 32 * 2 * 2
    assert {"grouped_mm", "loop", "token_by_token"} == set(cpu["rows"]) and cpu["rows"]["loop"][
        "forward_backward_s"
    ] > 0
    assert cpu["loop_speedup_over_token_by_token"]["forward_backward"] > 0
    assert set(r["grouped_mm_probe"]["cpu_float32"]) == {
        "forward",
        "backward_contiguous_grad",
        "backward_expanded_grad",
    }
    assert ("cuda" in r["gemm"]) == torch.cuda.is_available()
