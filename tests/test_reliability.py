"""Failures named, not hung; files from disk never run code (issue 11, first part)."""

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import small_config, cli_here
from tessera.checkpointing import checkpoint
from tessera.launching.launch import run_ranks


def _rank_one_freezes(config):
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    trainer.train_step()
    if trainer.rank == 1:
        time.sleep(config.runtime.timeout + 6)  # frozen through step 2, past every peer's timeout
        return None
    started = time.perf_counter()
    try:
        trainer.train_step()
    except Exception as e:
        return time.perf_counter() - started, type(e).__name__, str(e)
    return None


def test_a_frozen_rank_is_reported_within_the_timeout_by_every_peer_not_hung():
    # the mesh's subgroups (tp, FSDP's dp_shard_cp) get --timeout too, not torch's 30-minute default
    config = small_config(dp=2, tp=2, timeout=3.0)
    results = run_ranks(_rank_one_freezes, 4, config, timeout=90)
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        elapsed, kind, message = result
        assert kind == "CollectiveTimeout" and elapsed < 3.0 + 4, (rank, elapsed, message)
        assert message.startswith(f"rank {rank} stalled at training step 2 in"), message
    # rank 0 shares a tp group with the frozen rank 1: its stalled collective is tessera's own, named by axis
    assert results[0][2].startswith(
        "rank 0 stalled at training step 2 in all_reduce over the tp axis (group ranks [0, 1])"
    )
    # rank 3 shares FSDP2's shard group with rank 1: a collective torch issued, mapped to its mesh axis
    assert results[3][2].startswith("rank 3 stalled at training step 2 in an FSDP2 all-gather"), results[3][2]
    assert "over the dp_shard axis (group ranks [1, 3])" in results[3][2], results[3][2]


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('TESSERA_PWNED', '/tmp/tessera-pwned')}",))


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    from tessera.training.run import train

    root = tmp_path_factory.mktemp("safe")
    train(small_config(steps=2, checkpoint_dir=str(root), checkpoint_every=2))
    return root / "step_00000002"


def _forge(src, dst, relative, payload):
    """A copy of the checkpoint with `relative` replaced and the manifest's checksums rewritten to match."""
    shutil.copytree(src, dst)
    (dst / relative).write_bytes(payload)
    manifest = json.loads((dst / checkpoint.MANIFEST).read_text())
    manifest["files"][relative] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    manifest["digest"] = checkpoint.manifest_digest(manifest)  # the attacker reseals the manifest too
    (dst / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return dst


def test_a_crafted_dcp_metadata_pickle_is_refused_even_with_matching_checksums(one_checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    os.environ["TESSERA_PWNED"] = str(marker)
    try:
        forged = _forge(one_checkpoint, tmp_path / "forged", "state/.metadata", pickle.dumps(_Boom()))
        out = cli_here("export", str(forged), "--out", str(tmp_path / "m.safetensors"))
        assert out.returncode == 2 and "refused" in out.stderr and "system" in out.stderr, out.stderr
        with pytest.raises(checkpoint.CheckpointError, match="refused"):
            checkpoint.SafeFileSystemReader(str(forged / "state")).read_metadata()
        assert not marker.exists()
    finally:
        os.environ.pop("TESSERA_PWNED", None)


def test_a_non_tensor_item_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    os.environ["TESSERA_PWNED"] = str(marker)
    try:
        buffer = io.BytesIO()
        torch.save({"lr": _Boom()}, buffer)
        buffer.seek(0)

        class Item:  # what DCP passes: a read item naming the key
            class dest_index:
                fqn = "optimizer.param_groups.lr"

        planner = checkpoint.SafeLoadPlanner()
        planner.flatten_state_dict = False
        planner.state_dict = {}
        with pytest.raises(checkpoint.CheckpointError, match="optimizer.param_groups.lr is not plain data"):
            planner.load_bytes(Item, buffer)
        assert not marker.exists()
    finally:
        os.environ.pop("TESSERA_PWNED", None)


def test_the_genuine_checkpoint_still_exports_through_the_safe_reader(one_checkpoint, tmp_path):
    out = tmp_path / "model.safetensors"
    manifest = checkpoint.export_checkpoint(one_checkpoint, out)
    assert manifest["step"] == 2 and "layers.0.attention.wq.weight" in checkpoint.read_safetensors(out)


def _poisoned_run(config, poisoned_step):
    """Train; on `poisoned_step` rank 1 finds a NaN in one gradient element (after backward)."""
    from helpers import gather_by_name, named_full_parameters
    from tessera.trainer import NonFiniteError, Trainer

    trainer = Trainer(config, torch.device("cpu"))

    def poison(parts):
        if trainer.rank == 1:
            for name, p in parts[0].named_parameters():
                if name == "layers.1.feed_forward.w2.weight":
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    g.view(-1)[0] = float("nan")

    records, error = [], None
    try:
        for s in range(config.runtime.steps):
            records.append(trainer.train_step(on_grads=poison if s + 1 == poisoned_step else None).record())
    except NonFiniteError as e:
        error = str(e)
    params = gather_by_name(named_full_parameters(trainer))
    return (records, error, params) if trainer.rank == 0 else None


def test_a_nan_gradient_is_named_and_stops_before_the_update():
    config = small_config(dp=2, tp=2, steps=3)
    records, error, params = run_ranks(_poisoned_run, 4, config, 2, timeout=120)[0]
    assert len(records) == 1 and error is not None
    assert error.startswith("non-finite values at step 2: loss ") and "grad norm nan" in error
    assert "rank 1: layers.1.feed_forward.w2.weight (shard" in error and "stopped before the update" in error
    assert all(torch.isfinite(p).all() for p in params.values())  # nothing poisoned was applied


def test_skip_drops_the_poisoned_update_and_counts_it():
    poisoned = run_ranks(_poisoned_run, 4, small_config(dp=2, tp=2, steps=3, on_nonfinite="skip"), 2, timeout=120)[0]
    records, error, params = poisoned
    assert error is None and [r["skipped"] for r in records] == [False, True, False]
    assert records[-1]["skipped_steps"] == 1 and all(torch.isfinite(p).all() for p in params.values())
    # the run goes on from the weights of step 1: step 3 trains on them
    clean = run_ranks(_poisoned_run, 4, small_config(dp=2, tp=2, steps=1), None, timeout=120)[0]
    assert records[0]["loss"] == clean[0][0]["loss"]


def test_nonfinite_policy_is_checked():
    with pytest.raises(ValueError, match="--on-nonfinite 'ignore'; use stop or skip"):
        small_config(on_nonfinite="ignore").check()


def test_a_second_run_writing_to_the_same_checkpoint_directory_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    with checkpoint.directory_lock(root):  # this test process plays the first run
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tessera",
                "train",
                "--steps",
                "2",
                "--seq-len",
                "32",
                "--checkpoint-dir",
                str(root),
                "--checkpoint-every",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            out.returncode == 2 and f"--checkpoint-dir {root} is in use by another run (pid {os.getpid()}" in out.stderr
        )
        assert "step" not in out.stdout
    assert not (root / ".lock").exists()
    (root / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": __import__("socket").gethostname()}))
    with checkpoint.directory_lock(root):  # a stale lock (its process is gone) is taken over
        pass


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from tessera.training.run import train

    root = tmp_path_factory.mktemp("fallback")
    history = train(small_config(steps=6, checkpoint_dir=str(root), checkpoint_every=2, keep_checkpoints=3))
    return root, [(m["loss"], m["grad_norm"]) for m in history]


def test_a_damaged_latest_falls_back_to_the_newest_intact_checkpoint(two_checkpoints, tmp_path, capsys, recwarn):
    from tessera.training.run import train

    root, history = two_checkpoints
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    assert (copy / "latest").read_text() == "step_00000006"
    shard = next((copy / "step_00000006" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.warns(
        UserWarning, match=r"the latest checkpoint .*step_00000006 is unusable \(truncated or altered checkpoint file"
    ):
        assert checkpoint.resolve(copy).name == "step_00000004"
    capsys.readouterr()
    recwarn.clear()
    resumed = train(small_config(steps=6, resume=str(copy)))
    # the launcher says it once, in one line (no warning with its source line, none again by the pre-run checks)
    warned = [line for line in capsys.readouterr().err.splitlines() if "is unusable" in line]
    assert len(warned) == 1 and warned[0].startswith(
        f"tessera: warning: the latest checkpoint {copy}/step_00000006 is "
        f"unusable (truncated or altered checkpoint file"
    )
    assert not [w for w in recwarn if "is unusable" in str(w.message)]
    assert [m["step"] for m in resumed] == [5, 6]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == history[4:]  # bitwise the uninterrupted run
    older = next((copy / "step_00000004" / "state").glob("*.distcp"))
    older.write_bytes(older.read_bytes()[:-10])
    with pytest.raises(checkpoint.CheckpointError, match="truncated or altered"):  # named explicitly: no fallback
        small_config(steps=6, resume=str(copy / "step_00000004")).check()


def test_an_edited_manifest_is_refused(two_checkpoints, tmp_path):
    root, _ = two_checkpoints
    bad = tmp_path / "edited"
    shutil.copytree(root / "step_00000004", bad)
    manifest = json.loads((bad / checkpoint.MANIFEST).read_text())
    manifest["step"] = 5
    (bad / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="was edited after the save"):
        checkpoint.read_manifest(bad)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("signum", [15, 2], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, signum):
    import signal
    import uuid

    marker = f"TESSERA_TEST_RUN={uuid.uuid4().hex}"
    env = dict(os.environ, TESSERA_TEST_RUN=marker.split("=", 1)[1])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tessera",
            "train",
            "--dp",
            "2",
            "--steps",
            "100000",
            "--seq-len",
            "32",
            "--global-batch",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a suite started in the background inherits SIGINT ignored (Python then raises no KeyboardInterrupt):
        # the launcher gets the disposition of a terminal's foreground job, as a user's Ctrl-C meets it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in proc.stdout:  # training has started on every rank
            if line.startswith("step "):
                break
        assert len(_processes_with(marker)) >= 3  # the launcher, and its ranks (and their forkserver)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"tessera train: error: stopped by {signal.Signals(signum).name}; every rank was stopped"), (
        stderr
    )
    deadline = time.time() + 10
    while _processes_with(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []  # no rank outlives the launcher


def _rank_pids(marker: str, launcher: int) -> list[int]:
    """Rank processes of a launcher: marked processes whose parent is not the launcher (the launcher's
    child is the forkserver, the ranks are the forkserver's children)."""
    out = []
    for pid in _processes_with(marker):
        try:
            with open(f"/proc/{pid}/status") as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if pid != launcher and ppid != launcher:
            out.append(pid)
    return out


@pytest.fixture(scope="module")
def train_reference(tmp_path_factory):
    """`train_reference(tmp_path, common)`: the uninterrupted run of the CLI flags `common` in tmp_path
    (checkpoints in reference/, metrics in reference.jsonl), trained once per flags in this module: the killed-rank
    test's dp2 x tp2 run and the torchrun test's are the same run (~9 s of 4 ranks each time)."""
    import argparse

    from tessera.config import add_arguments, config_from_args
    from tessera.training.run import train

    trained: dict[tuple, Path] = {}  # flags -> the directory of their run

    def reference(tmp_path, common):
        key = tuple(common)
        if key not in trained:
            root = trained[key] = tmp_path_factory.mktemp("reference")
            parser = argparse.ArgumentParser()
            add_arguments(parser)
            flags = ["--checkpoint-dir", str(root / "reference"), "--metrics", str(root / "reference.jsonl")]
            train(config_from_args(parser.parse_args([*common, *flags])))
        shutil.copytree(trained[key] / "reference", tmp_path / "reference")
        shutil.copy(trained[key] / "reference.jsonl", tmp_path / "reference.jsonl")

    return reference


def _wait_for_step(metrics, step: int, seconds: float = 120) -> None:
    """Until the metrics file records `step` (a line being written is skipped); fails after `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        steps = []
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            try:
                steps.append(json.loads(line).get("step", 0))
            except json.JSONDecodeError:
                continue  # its writer is mid-line
        if steps and max(steps) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"{metrics} did not reach step {step} in {seconds} s")


def _assert_matches_reference(tmp_path, metrics, total_steps: int) -> list[dict]:
    """Every step once, the reference's losses bitwise, and the final weights of run/ bitwise those of
    reference/; returns the run's metric records."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("type") != "header"]
    assert [r["step"] for r in steps] == list(range(1, total_steps + 1))  # none repeated, none missing
    reference = [json.loads(line) for line in (tmp_path / "reference.jsonl").read_text().splitlines()][1:]
    assert [r["loss"] for r in steps] == [r["loss"] for r in reference]  # bitwise
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    checkpoint.export_checkpoint(tmp_path / "reference", a)
    checkpoint.export_checkpoint(tmp_path / "run", b)
    ref_weights, run_weights = checkpoint.read_safetensors(a), checkpoint.read_safetensors(b)
    assert all(torch.equal(ref_weights[n], run_weights[n]) for n in ref_weights)
    return records


@pytest.mark.parametrize(
    "layout",
    [["--dp", "2", "--tp", "2"], ["--pp", "2", "--n-layers", "4", "--microbatches", "2"]],
    ids=["dp2xtp2", "pp2"],
)
def test_a_killed_rank_restarts_the_job_from_the_latest_checkpoint_bitwise(tmp_path, layout, train_reference):
    import signal
    import uuid

    common = ["--steps", "16", "--seq-len", "32", "--global-batch", "4", "--checkpoint-every", "4", "--quiet", *layout]
    train_reference(tmp_path, common)
    # the same run, with one rank killed (SIGKILL) mid-run
    marker = uuid.uuid4().hex
    metrics = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tessera",
            "train",
            *common,
            "--checkpoint-dir",
            str(tmp_path / "run"),
            "--metrics",
            str(metrics),
            "--max-restarts",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TESSERA_TEST_RUN=marker),
    )
    try:
        _wait_for_step(metrics, 7)
        victim = _rank_pids(f"TESSERA_TEST_RUN={marker}", proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "restarting every rank from the latest checkpoint" in stderr and "(restart 1 of 1)" in stderr
    _assert_matches_reference(tmp_path, metrics, 16)


class _Crash(BaseException):
    """Stands for the process dying at that point (not an Exception: nothing catches it)."""


def _save_then_crash_during_the_next(root, where):
    from unittest import mock

    from tessera.trainer import Trainer

    trainer = Trainer(small_config(steps=4), torch.device("cpu"))
    manager = checkpoint.CheckpointManager(root, keep=3)
    trainer.train_step()
    trainer.save(manager)  # step 1: complete
    trainer.train_step()

    real_rename, real_replace = os.rename, os.replace

    def rename(src, dst, *args, **kwargs):  # tessera's rename of the finished .step_N.tmp directory
        if str(src).endswith(".step_00000002.tmp"):
            raise _Crash(where)
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):  # the `latest` pointer update
        if str(dst).endswith("latest"):
            raise _Crash(where)
        return real_replace(src, dst, *args, **kwargs)

    patch = {
        "between shard writes and the rename": mock.patch("os.rename", side_effect=rename),
        "between the rename and the latest update": mock.patch("os.replace", side_effect=replace),
    }[where]
    crashed = False
    try:
        with patch:
            trainer.save(manager)  # step 2 dies part-way
    except _Crash:
        crashed = True
    return crashed, sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("where", ["between shard writes and the rename", "between the rename and the latest update"])
def test_a_crash_during_a_save_leaves_latest_loadable(tmp_path, where):
    root = tmp_path / "ckpt"
    crashed, left = run_ranks(_save_then_crash_during_the_next, 1, root, where, timeout=120)[0]
    assert crashed and "latest" in left and "step_00000001" in left
    # the half-written step 2 is left as a .tmp directory (removed by the next save) or complete but unnamed by latest
    assert (".step_00000002.tmp" in left) == (where == "between shard writes and the rename")
    assert (root / "latest").read_text() == "step_00000001"
    path = checkpoint.resolve(root)
    assert path.name == "step_00000001" and checkpoint.structural_problem(path) is None
    checkpoint.verify_files(path, checkpoint.read_manifest(path))  # every checksum holds
    from tessera.training.run import train

    resumed = train(small_config(steps=4, resume=str(root)))  # and the run goes on from it
    assert [m["step"] for m in resumed] == [2, 3, 4]


def test_checkpoint_on_signal_saves_then_stops_every_rank(tmp_path):
    import uuid

    marker = uuid.uuid4().hex
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tessera",
            "train",
            "--dp",
            "2",
            "--steps",
            "100000",
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--checkpoint-dir",
            str(root),
            "--checkpoint-every",
            "1000",
            "--checkpoint-on-signal",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TESSERA_TEST_RUN=marker),
    )
    try:
        for line in proc.stdout:
            if line.startswith("step    3/"):
                break
        proc.send_signal(15)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == (
        "tessera train: error: stopped by SIGTERM; the ranks saved a checkpoint first (resume with --resume)"
    ), stderr
    saved_line = next(line for line in stdout.splitlines() if line.startswith("stopping on SIGTERM at step "))
    step = int(saved_line.split("at step ")[1].split(":")[0])
    path = checkpoint.resolve(root)
    assert path.name == f"step_{step:08d}" and checkpoint.structural_problem(path) is None and step >= 3
    assert _processes_with(f"TESSERA_TEST_RUN={marker}") == []


def test_checkpoint_on_signal_needs_a_directory():
    with pytest.raises(ValueError, match="--checkpoint-on-signal needs --checkpoint-dir"):
        small_config(checkpoint_on_signal=True).check()


def _rank_one_straggles(config):
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    if trainer.rank == 1:  # planted: this rank's optimizer step (work after its last collective) is slow
        step = trainer.optimizer.step

        def slow_step(*a, **kw):
            # well past 20% of a step, step 1 included (it also measures the matmul dtypes, slower on a loaded CPU)
            time.sleep(1.0)
            return step(*a, **kw)

        trainer.optimizer.step = slow_step
    return [
        (r.step, r.straggler and (r.straggler.rank, r.straggler.steps))
        for r in (trainer.train_step() for _ in range(5))
    ]


def test_a_straggler_is_named_after_three_slow_steps_in_the_progress_line():
    from tessera.training.run import progress_line

    named = run_ranks(_rank_one_straggles, 2, small_config(dp=2), timeout=120)
    assert named[0] == named[1] == [(1, None), (2, None), (3, (1, 3)), (4, (1, 4)), (5, (1, 5))]
    record = {
        "step": 3,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 1000.0,
        "peak_memory_bytes": 0,
        "layout": {"dp_shard": 2},
        "straggler": {"rank": 1, "lag_s": 0.31, "steps": 3},
    }
    assert progress_line(record, small_config(dp=2, steps=5), 1.0, 3).endswith(
        "| dp_shard2 | straggler rank 1 (+310 ms/step, 3 steps)"
    )


def test_under_torchrun_max_restarts_a_killed_rank_resumes_the_job_bitwise(tmp_path, train_reference):
    """torchrun restarts every worker after one is SIGKILLed; tessera joins the new attempt (its store keys
    under a per-attempt prefix, so the mesh's subgroups reconnect) and resumes from --checkpoint-dir."""
    import shutil
    import signal
    import uuid

    common = [
        "--steps",
        "16",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--checkpoint-every",
        "4",
        "--quiet",
        "--dp",
        "2",
        "--tp",
        "2",
    ]
    train_reference(tmp_path, common)
    marker = uuid.uuid4().hex
    metrics = tmp_path / "run.jsonl"
    torchrun = shutil.which("torchrun", path=str(os.path.dirname(sys.executable))) or "torchrun"
    proc = subprocess.Popen(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "4",
            "--max-restarts",
            "1",
            "-m",
            "tessera",
            "train",
            *common,
            "--checkpoint-dir",
            str(tmp_path / "run"),
            "--metrics",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TESSERA_TEST_RUN=marker, OMP_NUM_THREADS="1"),
    )
    try:
        _wait_for_step(metrics, 6)
        workers = [
            pid
            for pid in _processes_with(f"TESSERA_TEST_RUN={marker}")
            if pid != proc.pid and int(open(f"/proc/{pid}/status").read().split("PPid:")[1].split()[0]) == proc.pid
        ]
        assert len(workers) == 4, workers
        os.kill(sorted(workers)[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    records = _assert_matches_reference(tmp_path, metrics, 16)
    assert [r["restart"] for r in records if r.get("type") == "header"] == [0, 1]
