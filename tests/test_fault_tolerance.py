"""--fault-tolerant (torchft on the replicate axis), run as a user runs it: `tessera train --dp-replicate 2
--fault-tolerant`, the local launcher starting a lighthouse and every replica group, faults planted with
TESSERA_FT_DRILL. Without faults the run equals the HSDP run it replaces (losses and grad norms within 1e-6);
with a group killed (mid-forward, mid-reduction, a replacement killed while receiving), stopped, or two groups
lost at once, the survivors never lose a step, every step's record says whose rows it read, the run equals one
process trained on exactly those rows at the fp32 contract's 1e-5, and a replacement's weights equal its peers'
(the checksum of its shards' bits) from its first step back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ft_ranks import one_process_on_rows_read
from helpers import cli_here
from tessera.launching.launch import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (the ft extra)")

BASE = ["--model", "debug", "--seq-len", "32", "--global-batch", "4", "--lr", "3e-3", "--warmup", "1"]


def train_ft(tmp: Path, steps: int, drill: str | None = None, dp: int = 2, replicas: int = 2, *flags: str):
    """Every replica group's step records ({group: [records]}, each group's file in order) and the output."""
    env = {**os.environ, **({"TESSERA_FT_DRILL": drill} if drill else {})}
    args = [*BASE, "--dp", str(dp), "--dp-replicate", str(replicas), "--fault-tolerant", "--steps", str(steps)]
    args += ["--metrics", str(tmp / "run.jsonl"), "--ft-timeout", "8", "--quiet", *flags]
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    groups = {}
    for r in range(replicas):
        path = tmp / ("run.jsonl" if r == 0 else f"run.replica{r}.jsonl")
        groups[r] = steps_of(path)
    return groups, out.stderr


def steps_of(path: Path) -> list[dict]:
    """A metrics file's step records (its header records left out)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") != "header"]


def reference(steps: int, read: list[list[int]], replicas: int = 2):
    kw = dict(steps=steps, lr=3e-3, warmup=1, seq_len=32, global_batch=4)
    return run_ranks(one_process_on_rows_read, 1, kw, read, replicas, timeout=120)[0]


def assert_close(what: str, got: list[float], want: list[float], rel: float) -> None:
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rel * abs(b), f"{what} step {step}: {a} vs {b}"


def test_without_faults_a_fault_tolerant_run_equals_the_hsdp_run_it_replaces(tmp_path):
    groups, _ = train_ft(tmp_path, 4)
    metrics = str(tmp_path / "h.jsonl")
    hsdp = cli_here("train", *BASE, "--dp", "2", "--dp-replicate", "2", "--steps", "4", "--metrics", metrics, "--quiet")
    assert hsdp.returncode == 0, hsdp.stderr
    ref = steps_of(tmp_path / "h.jsonl")
    for r, records in groups.items():
        assert [x["replicas"]["replicas"] for x in records] == [[0, 1]] * 4, r
        assert_close(f"group {r} loss", [x["loss"] for x in records], [x["loss"] for x in ref], 1e-6)
        assert_close(f"group {r} grad norm", [x["grad_norm"] for x in records], [x["grad_norm"] for x in ref], 1e-6)
    assert [x["replicas"]["weights_bits"] for x in groups[0]] == [x["replicas"]["weights_bits"] for x in groups[1]]


@pytest.mark.parametrize(
    "inside", [["--dp", "4"], ["--dp", "2", "--tp", "2"], ["--dp", "2", "--pp", "2", "--microbatches", "2"]],
    ids=["fsdp2-inside", "tp2-inside", "pp2-inside"],
)  # fmt: skip
def test_groups_of_several_ranks_equal_the_hsdp_run(tmp_path, inside):
    """Each group runs FSDP2, tp or pp inside it; rank i of every group is one replicate axis."""
    env = dict(os.environ)
    common = [*BASE, *inside, "--dp-replicate", "2", "--steps", "3", "--quiet"]
    ft = subprocess.run(
        [sys.executable, "-m", "tessera", "train", *common, "--fault-tolerant", "--metrics", str(tmp_path / "f.jsonl")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ft.returncode == 0, ft.stderr[-3000:]
    # torchft speaks only when something is wrong: its Rust side logged every quorum at INFO (its level is read
    # when the module loads) and its manager warned of NCCL's flight recorder on gloo, 35 lines of 46 a run
    noise = [ln for ln in (ft.stdout + ft.stderr).splitlines() if "[INFO]" in ln or "flight recorder" in ln]
    assert not noise, noise[:3]
    hsdp = cli_here("train", *common, "--metrics", str(tmp_path / "h.jsonl"))
    assert hsdp.returncode == 0, hsdp.stderr
    got, want = steps_of(tmp_path / "f.jsonl"), steps_of(tmp_path / "h.jsonl")
    assert_close("loss", [x["loss"] for x in got], [x["loss"] for x in want], 1e-6)
    assert_close("grad norm", [x["grad_norm"] for x in got], [x["grad_norm"] for x in want], 1e-6)


@pytest.mark.parametrize(
    "drill",
    [
        "replica=1,step=3,at=forward",  # SIGKILL of a group's rank mid-forward
        "replica=1,step=3,at=reduce",  # ... just before the all-reduce between the groups
        "replica=1,step=1,at=recover,launch=1",  # the replacement killed while receiving its peer's state
    ],
    ids=["forward", "reduce", "recover"],
)
def test_a_killed_group_leaves_the_other_training_and_its_replacement_rejoins_it(tmp_path, drill):
    recover = "recover" in drill
    steps = 9  # a short horizon: AdamW's normalization amplifies reassociation late in a run (HSDP's own too)
    replacements = "2" if recover else "1"
    first = "replica=1,step=3,at=forward;" if recover else ""  # the fault that calls the replacement
    # the replacement rejoins at step 6, whatever its start-up took (the groups wait for it there; under
    # `recover` the first replacement dies receiving the state there, the step is retried, the second joins)
    timing = ";rejoin_by=6;pace=0.1"
    groups, err = train_ft(tmp_path, steps, f"{first}{drill}{timing}", 2, 2, "--ft-replacements", replacements)
    survivor = groups[0]
    assert [x["step"] for x in survivor] == list(range(1, steps + 1)), "a survivor lost or repeated a step"
    read = [x["replicas"]["replicas"] for x in survivor]
    assert read[:2] == [[0, 1], [0, 1]] and read[2] == [0] and read[-1] == [0, 1], read
    assert survivor[2]["replicas"]["retries"] >= (1 if "reduce" in drill or "forward" in drill else 0)
    assert "left the quorum" in err and "starting a replacement" in err, err[-2000:]
    losses, norms = reference(steps, read)
    assert_close("loss", [x["loss"] for x in survivor], losses, 1e-5)
    assert_close("grad norm", [x["grad_norm"] for x in survivor], norms, 1e-5)
    # the replacement: healed once, from then on its weights are its peer's, exactly, every step
    back = [x for x in groups[1] if x["replicas"]["healed"]]
    assert len(back) == 1 and back[0]["replicas"]["recovered_bytes"] > 0, groups[1]
    joined = back[0]["step"]
    assert joined == 6, joined
    # under `recover`, the step the first replacement died receiving in was retried, not committed without it
    assert not recover or survivor[5]["replicas"]["retries"] >= 1, survivor[5]
    mine = {x["step"]: x["replicas"]["weights_bits"] for x in groups[1] if x["step"] >= joined}
    theirs = {x["step"]: x["replicas"]["weights_bits"] for x in survivor if x["step"] >= joined}
    assert mine == theirs and len(mine) == steps - joined + 1


def test_a_stopped_group_is_left_behind_and_named(tmp_path):
    groups, err = train_ft(tmp_path, 6, "replica=1,step=3,at=forward,signal=STOP,pace=0.2")
    survivor = groups[0]
    assert [x["step"] for x in survivor] == list(range(1, 7))
    assert [x["replicas"]["replicas"] for x in survivor][2:] == [[0]] * 4
    assert "step 3: replica group(s) [1] left the quorum" in err
    assert "replica group 1 had not finished" in err and "a straggler the quorum left behind" in err
    losses, norms = reference(6, [x["replicas"]["replicas"] for x in survivor])
    assert_close("loss", [x["loss"] for x in survivor], losses, 1e-5)
    assert_close("grad norm", [x["grad_norm"] for x in survivor], norms, 1e-5)


def test_the_lighthouse_lost_and_restarted_stops_no_group(tmp_path):
    """The launcher's lighthouse shut down as group 0 begins step 4 and a new one started on its address 1.5 s
    later. No group dies; the new lighthouse knows no quorum, so its first may hold one group (torchft's): that
    group steps alone and the other then takes its state. Every step is applied once, with the rows its record
    names, the run equals one process on those rows, and the groups end bitwise equal; no stall outlasts
    --ft-timeout (8 s) by more than a step."""
    steps = 10
    groups, err = train_ft(tmp_path, steps, "lighthouse=restart,step=4,down=1.5;pace=0.4")
    assert "drill: the lighthouse is down" in err and "drill: the lighthouse is back" in err, err[-2000:]
    assert "starting a replacement" not in err, err[-2000:]  # no group failed meanwhile
    run: dict[int, dict] = {}  # the run's history: each step from the groups that applied it
    for r, records in groups.items():
        mine = [x["step"] for x in records]
        assert mine == sorted(set(mine)) and mine[-1] == steps, (r, mine)  # none twice, to the end
        for before, x in zip(mine, records[1:]):
            assert x["step"] == before + 1 or x["replicas"]["healed"], (r, mine)  # a gap only where it healed
        for x in records:
            if x["step"] in run:  # both groups applied it: one quorum, one update
                assert x["replicas"]["replicas"] == run[x["step"]]["replicas"]["replicas"], x
                assert x["loss"] == run[x["step"]]["loss"], x
            run.setdefault(x["step"], x)
    assert sorted(run) == list(range(1, steps + 1))
    read = [run[s]["replicas"]["replicas"] for s in range(1, steps + 1)]
    losses, norms = reference(steps, read)
    assert_close("loss", [run[s]["loss"] for s in range(1, steps + 1)], losses, 1e-5)
    assert_close("grad norm", [run[s]["grad_norm"] for s in range(1, steps + 1)], norms, 1e-5)
    assert groups[0][-1]["replicas"]["weights_bits"] == groups[1][-1]["replicas"]["weights_bits"]
    ended = [run[s]["replicas"]["ended_unix"] for s in range(1, steps + 1)]
    assert max(b - a for a, b in zip(ended, ended[1:])) < 8 + 2, ended


def test_two_groups_lost_at_once_leave_the_third_training(tmp_path):
    drill = "replica=1,step=3,at=forward,pace=0.3"
    env_extra = "replica=2,step=3,at=forward"  # the second fault: a drill names one group; the launcher's env
    groups, err = train_ft(tmp_path, 6, drill + ";" + env_extra, 3, 3, "--ft-replacements", "0", "--global-batch", "6")
    survivor = groups[0]
    assert [x["step"] for x in survivor] == list(range(1, 7))
    assert [x["replicas"]["replicas"] for x in survivor][2:] == [[0]] * 4, survivor
    assert "replica group(s) [1, 2] left the quorum" in err
    read = [x["replicas"]["replicas"] for x in survivor]
    kw = dict(steps=6, lr=3e-3, warmup=1, seq_len=32, global_batch=6)
    losses, norms = run_ranks(one_process_on_rows_read, 1, kw, read, 3, timeout=120)[0]
    assert_close("loss", [x["loss"] for x in survivor], losses, 1e-5)
    assert_close("grad norm", [x["grad_norm"] for x in survivor], norms, 1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", "2"], "--fault-tolerant makes the replicate axis fault-tolerant, and --dp-replicate is 1"),
        (["--dp", "2", "--dp-replicate", "2", "--ft-replica-id", "5"], "--ft-replica-id 5 is not a replica group"),
        (
            ["--dp", "2", "--dp-replicate", "2", "--ft-replica-id", "0", "--lighthouse", "http://127.0.0.1:9"],
            "--lighthouse http://127.0.0.1:9: nothing answers there within --ft-timeout",
        ),
        (["--dp", "2", "--dp-replicate", "2", "--optimizer", "muon"], "--fault-tolerant with --optimizer muon"),
    ],
)
def test_bad_fault_tolerance_flags_are_refused_in_one_line(flags, message):
    out = cli_here("train", "--model", "debug", "--steps", "1", "--fault-tolerant", "--ft-timeout", "1", *flags)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_each_replica_group_is_its_own_job_beside_tessera_lighthouse(tmp_path):
    """The torchrun form of docs/reliability.md: `tessera lighthouse`, then one torchrun job per group. A group that
    starts late is healed by the first one's live state; the records say whose rows each step read."""
    port = _free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "tessera", "lighthouse", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert "tessera lighthouse: http://" in lighthouse.stdout.readline()
        jobs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "1",
                    "--master-port",
                    str(_free_port()),
                    "-m",
                    "tessera",
                    "train",
                    *BASE,
                    "--dp",
                    "2",
                    "--dp-replicate",
                    "2",
                    "--fault-tolerant",
                    "--ft-replica-id",
                    str(r),
                    "--lighthouse",
                    f"http://127.0.0.1:{port}",
                    "--steps",
                    "5",
                    "--metrics",
                    str(tmp_path / "run.jsonl"),
                    "--quiet",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(2)
        ]
        for job in jobs:
            _, err = job.communicate(timeout=240)
            assert job.returncode == 0, err[-3000:]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    first, second = steps_of(tmp_path / "run.jsonl"), steps_of(tmp_path / "run.replica1.jsonl")
    assert [x["step"] for x in first] == [1, 2, 3, 4, 5]
    joined = second[0]["step"]
    assert second[0]["replicas"]["healed"] == (joined > 1) and [x["step"] for x in second] == list(range(joined, 6))
    assert all(x["replicas"]["replicas"] == [0, 1] for x in first if x["step"] >= joined)
    assert [x["replicas"]["weights_bits"] for x in first if x["step"] >= joined] == [
        x["replicas"]["weights_bits"] for x in second
    ]


def test_a_whole_job_resumes_from_group_0s_checkpoint_like_the_run_it_continues(tmp_path):
    """Group 0 alone saves (DCP, on --checkpoint-every); every group of a resumed job loads it: steps 3-4 of the
    resumed run equal the uninterrupted run's, bitwise here."""
    common = [*BASE, "--dp", "2", "--dp-replicate", "2", "--fault-tolerant", "--steps", "4", "--quiet"]
    ckpt = str(tmp_path / "ck")
    saving = ["--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--keep-checkpoints", "0"]
    for extra in (
        [*saving, "--metrics", str(tmp_path / "a.jsonl")],
        ["--resume", f"{ckpt}/step_00000002", "--metrics", str(tmp_path / "b.jsonl")],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "tessera", "train", *common, *extra], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
    straight, resumed = steps_of(tmp_path / "a.jsonl"), steps_of(tmp_path / "b.jsonl")
    assert [x["step"] for x in resumed] == [3, 4]
    # the resumed job's first step waits for both groups (one alone would train on its own rows only)
    assert [x["replicas"]["replicas"] for x in resumed] == [[0, 1], [0, 1]]
    assert [x["loss"] for x in resumed] == [x["loss"] for x in straight[2:]]
    assert [x["grad_norm"] for x in resumed] == [x["grad_norm"] for x in straight[2:]]
