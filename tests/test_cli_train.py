import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_here


def _tessera(*args):
    return cli_here(*args)


def _records(path):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def test_tessera_train_writes_a_header_and_metrics_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = _tessera(
        "train",
        "--model",
        "debug",
        "--tp",
        "2",
        "--sequence-parallel",
        "--steps",
        "20",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--warmup",
        "3",
        "--metrics",
        str(metrics),
    )
    assert out.returncode == 0, out.stderr
    header, rows = _records(metrics)
    assert header["type"] == "header" and header["config"]["parallel"]["tp"] == 2 and header["run_id"]
    assert header["versions"]["torch"] and header["layout"]["tp"] == 2 and header["num_params"] > 0
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "peak_memory_bytes", "layout"} <= set(
            r
        )
        assert r["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2, "ep": 1}
        # the host's side of the step (runtime/metrics/host_account.py): the batch within the launch within the step
        host = r["host"]
        assert 0 < host["data_s"] < host["launch_s"] <= r["step_time_s"] and host["gc_s"] >= 0
        assert set(host["gc_collections"]) == {"gen0", "gen1", "gen2"} and "device_mallocs" not in host  # CPU
    # the logged lr is the one the step used: warm-up 1/3, 2/3, 3/3 of the peak
    assert [r["lr"] for r in rows[:3]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    lines = out.stdout.splitlines()
    assert (
        lines[0].startswith("tessera: debug (131.6K params, 2 layers) on tp2 + sequence parallel = 2 CPU ranks")
        and "metrics ->" in lines[0]
    )
    assert "step   20/20" in out.stdout and "eta " in out.stdout and "done: loss" in out.stdout


def test_n_layers_overrides_the_preset_and_microbatches_run(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = _tessera(
        "train",
        "--model",
        "small",
        "--n-layers",
        "1",
        "--dp",
        "2",
        "--microbatches",
        "2",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--quiet",
        "--metrics",
        str(metrics),
    )
    assert out.returncode == 0, out.stderr
    header, rows = _records(metrics)
    assert header["config"]["model"]["n_layers"] == 1 and header["config"]["data"]["microbatches"] == 2
    assert len(rows) == 2


def test_under_torchrun_it_joins_the_job_and_matches_the_spawned_run(tmp_path):
    common = ["train", "--tp", "2", "--steps", "3", "--seq-len", "32", "--global-batch", "4", "--quiet"]
    spawned, joined = tmp_path / "spawned.jsonl", tmp_path / "joined.jsonl"
    assert _tessera(*common, "--metrics", str(spawned)).returncode == 0
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    # --standalone: a free port picked by torchrun, never a fixed one; dp is inferred (2 ranks / tp 2 = 1)
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tessera.cli", *common, "--metrics", str(joined)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["loss"] for r in _records(joined)[1]] == [r["loss"] for r in _records(spawned)[1]]
    bad = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tessera.cli", "train", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in bad.stderr.splitlines() if line.startswith("tessera train: error:")]
    # one line from rank 0; no rank prints a Python traceback (torchrun's own ChildFailedError report remains)
    assert bad.returncode != 0 and len(errors) == 1 and "ValueError" not in bad.stderr, bad.stderr[-2000:]


def test_two_simulated_nodes_join_one_job_through_c10d_rendezvous(tmp_path):
    """Multi-node as far as one machine allows: two torchrun agents (2 processes each) meet at a c10d
    rendezvous on localhost, as two nodes would at --rdzv-endpoint HOST:PORT; the 4-rank dp2 x tp2 job
    trains exactly as the local launcher's."""
    import socket
    import uuid

    common = ["train", "--dp", "2", "--tp", "2", "--steps", "3", "--seq-len", "32", "--global-batch", "4", "--quiet"]
    local = tmp_path / "local.jsonl"
    assert _tessera(*common, "--metrics", str(local)).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    run_id = uuid.uuid4().hex[:8]
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc_per_node",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                "-m",
                "tessera",
                *common,
                "--metrics",
                str(tmp_path / f"node{n}.jsonl"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-1500:] for _, err in outs]
    written = [p for p in (tmp_path / "node0.jsonl", tmp_path / "node1.jsonl") if p.exists()]
    assert len(written) == 1  # global rank 0 writes the metrics, on whichever node the rendezvous made first
    assert [r["loss"] for r in _records(written[0])[1]] == [r["loss"] for r in _records(local)[1]]
