import json
import subprocess
import sys


def test_tessera_train_writes_metrics_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "parallel.cli", "train", "--model", "debug", "--tp", "2", "--sequence-parallel",
         "--steps", "20", "--seq-len", "32", "--global-batch", "4", "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        assert {"step", "loss", "grad_norm", "tokens_per_s", "peak_memory_bytes", "layout"} <= set(r)
        assert r["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert "step   20/20" in out.stdout and "done: loss" in out.stdout
