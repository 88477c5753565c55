"""One precision policy on every layout, and records that say what ran: the dtype of the matmuls is read
from the tensors during step 1 (runtime/metrics/dtype_probe.py), never from the config."""

import json

import pytest
import torch

from helpers import cli_here
from tessera.metrics.dtype_probe import MatmulDtypes


def _tessera(*args):
    return cli_here(*args)


def test_the_probe_counts_matmul_flops_by_the_dtype_they_ran_in():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    with MatmulDtypes() as probe:
        a @ b  # mm: 2 * 3 * 5 * 7
        torch.nn.functional.linear(a.bfloat16(), b.t().bfloat16(), torch.zeros(7, dtype=torch.bfloat16))  # addmm
        torch.bmm(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 4, 6, dtype=torch.float64))
        torch.randn(4) + 1  # not a matmul
    report = probe.report()
    assert report["matmul_flops_by_dtype"] == {
        "float32": 2 * 3 * 5 * 7,
        "bfloat16": 2 * 3 * 5 * 7,
        "float64": 2 * 2 * 3 * 4 * 6,
    }
    assert report["matmul_calls_by_dtype"] == {"float32": 1, "bfloat16": 1, "float64": 1}
    assert report["compute_dtype"] == "float64"  # the most FLOPs


def test_the_probe_sees_backward_matmuls_and_attention():
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    with MatmulDtypes() as probe:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert (
        set(probe.report()["matmul_flops_by_dtype"]) == {"bfloat16"} and probe.report()["compute_dtype"] == "bfloat16"
    )
    # the fused attention kernels themselves, forward and backward (4 B H S^2 D, and 2.5x that)
    assert probe.report()["matmul_flops_by_dtype"]["bfloat16"] >= 4 * 2 * 8 * 8 * 4 * 3.5


def test_the_probe_counts_every_matmul_of_the_chunked_loss():
    """dh is written with mm(out=) and dW accumulated with addmm_: every overload counts (3 matmuls of 2 N V D)."""
    from tessera.parallel.loss import linear_cross_entropy_sum

    n, v, d = 6, 10, 4
    h, w = torch.randn(n, d, requires_grad=True), torch.randn(v, d, requires_grad=True)
    with MatmulDtypes() as probe:
        linear_cross_entropy_sum(h, w, torch.randint(0, v, (n,)))[0].backward()
    assert probe.report()["matmul_flops_by_dtype"] == {"float32": 3 * 2 * n * v * d}


def _run(tmp_path, precision, *extra):
    metrics = tmp_path / f"{precision}.jsonl"
    out = _tessera(
        "train",
        "--model",
        "debug",
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--mixed-precision",
        precision,
        "--metrics",
        str(metrics),
        *extra,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return out.stdout, lines[0], lines[1:]


@pytest.mark.slow
def test_bf16_runs_in_bf16_on_one_process_and_says_so_from_what_ran(tmp_path):
    """The issue's reproduction: --mixed-precision bf16 printed bitwise fp32's losses on one process. (tp-only,
    pp-only and every other layout: tests/test_contract_bf16.py reads compute_dtype from their records.)"""
    bf16_out, bf16_header, bf16_rows = _run(tmp_path, "bf16")
    fp32_out, fp32_header, fp32_rows = _run(tmp_path, "fp32")
    assert all(a["loss"] != b["loss"] for a, b in zip(bf16_rows, fp32_rows))  # bf16 really ran
    assert all(abs(a["loss"] - b["loss"]) < 1e-2 * b["loss"] for a, b in zip(bf16_rows, fp32_rows))
    assert bf16_header["compute_dtype"] == "bfloat16" and fp32_header["compute_dtype"] == "float32"
    assert bf16_header["matmul_flops_by_dtype"]["bfloat16"] > 0.9 * sum(bf16_header["matmul_flops_by_dtype"].values())
    assert bf16_header["mixed_precision_configured"] == "bf16"
    assert [r["compute_dtype"] for r in bf16_rows] == ["bfloat16"] * 3
    assert [r["compute_dtype"] for r in fp32_rows] == ["float32"] * 3
    assert (
        "matmuls in bfloat16 (" in bf16_out.splitlines()[0] and "matmuls in float32 (100.0%" in fp32_out.splitlines()[0]
    )


@pytest.mark.slow
def test_the_readme_quotes_the_start_up_lines_matmul_shares():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "precision.md").read_text()
    quoted = re.search(
        r"\(`(matmuls in bfloat16 \([^`]*\))`\s+for `tessera train --model debug --mixed-precision bf16`", readme
    ).group(1)
    out = cli_here("train", "--model", "debug", "--mixed-precision", "bf16", "--steps", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert quoted in out.stdout.splitlines()[0], (quoted, out.stdout.splitlines()[0])


def _dtype_reports(config):
    from helpers import trainer_for

    trainer = trainer_for(config)
    records = [trainer.train_step().record() for _ in range(2)]
    return trainer.dtype_report, [r["compute_dtype"] for r in records], "matmul_flops_by_dtype" in records[0]


@pytest.mark.slow
def test_only_rank_0_which_writes_the_records_measures_the_matmul_dtypes():
    """The probe (a Python call per operator) runs on rank 0's first step alone; another rank's report says
    it did not measure rather than repeat rank 0's."""
    from helpers import small_config
    from tessera.metrics.dtype_probe import NOT_MEASURED
    from tessera.launching.launch import run_ranks

    (report, dtypes, has_flops), (other, other_dtypes, other_flops) = run_ranks(
        _dtype_reports, 2, small_config(dp=2, mixed_precision="bf16")
    )
    assert report["compute_dtype"] == "bfloat16" and report["matmul_flops_by_dtype"]["bfloat16"] > 0
    assert dtypes == ["bfloat16", "bfloat16"] and has_flops
    assert other == NOT_MEASURED and other_dtypes == [None, None] and not other_flops
