"""benchmarks/bench_qkv_projection.py on CPU: every row runs on the same parameters, the fused GEMM equals the three
separate ones up to float reassociation, FP8 (emulated) stays within tensorwise FP8's error, and the JSON is
written."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_qkv_projection  # noqa: E402


def test_every_row_runs_and_fusing_changes_only_the_summation_order(tmp_path):
    out = tmp_path / "qkv.json"
    results = bench_qkv_projection.main(["--smoke", "--no-compile", "--out", str(out)])
    rows = results["rows"]
    assert list(rows) == ["separate", "fused", "fp8 separate", "fp8 q only", "fp8 fused"]
    assert rows["separate"]["dx_rel_diff"] == 0.0
    for key in ("out_rel_diff", "dx_rel_diff", "dw_rel_diff"):
        assert rows["fused"][key] <= 1e-6  # fp32: the same dot products, perhaps summed in another order
        for fp8 in ("fp8 separate", "fp8 q only", "fp8 fused"):
            assert 1e-4 < rows[fp8][key] <= 0.125  # e4m3 / e5m2 rounding: present, and bounded
    assert all(r["forward_backward_s"] > 0 for r in rows.values())
    written = json.loads(out.read_text())
    assert (
        written["results"]["step_time_ratios"]["fused / separate"]
        == rows["fused"]["forward_backward_s"] / (rows["separate"]["forward_backward_s"])
    )
    assert written["config"]["dtype"] == "float32"


def test_the_fused_projection_is_the_three_projections():
    """Against a float64 definition: x @ [Wq; Wk; Wv].T split equals x @ Wq.T, x @ Wk.T, x @ Wv.T."""
    torch.manual_seed(0)
    m = bench_qkv_projection.Projections(24, 16, 8, fused=True)
    x = torch.randn(5, 24)
    q, k, v = m(x)
    for got, lin in zip((q, k, v), (m.q_proj, m.k_proj, m.v_proj)):
        want = x.double() @ lin.weight.double().T
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
