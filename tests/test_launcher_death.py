"""Nothing outlives its launcher and nothing writes twice: a SIGKILLed `tessera train` takes its ranks with
it (an async save in flight too), its lock names the ranks as writers, a resume started at once continues
with every step recorded once; a run reading a live run's directory reads the step it pinned. The lock and
pin rules themselves on plain files."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.checkpointing.locks import directory_lock, metrics_lock, pinned, pinned_steps
from tessera.topology.errors import CheckpointError

TINY = ["--model", "debug", "--seq-len", "16", "--global-batch", "2", "--quiet"]


def _train(cwd, *args, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "tessera", "train", *TINY, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _steps(metrics: Path) -> list[int]:
    out = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "step" in record and record.get("type") != "header":
            out.append(record["step"])
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has stopped; only its parent has yet to reap it


def _wait_for(condition, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_step", [6, 7])  # 6: its async save has just begun; 7: between saves
def test_a_sigkilled_launcher_takes_its_ranks_and_a_resume_at_once_records_every_step_once(tmp_path, kill_after_step):
    saving = ["--dp", "2", "--checkpoint-dir", "ck", "--checkpoint-every", "2", "--checkpoint-async"]
    metrics = tmp_path / "m.jsonl"
    first = _train(tmp_path, *saving, "--steps", "16", "--metrics", "m.jsonl")
    try:
        lock = tmp_path / "ck" / ".lock"
        holder = _wait_for(lambda: lock.exists() and json.loads(lock.read_text() or "{}").get("pids"), 120, "the ranks")
        ranks = json.loads(lock.read_text())["pids"]
        assert json.loads(lock.read_text())["pid"] == first.pid and len(holder) == 2  # the ranks hold it too
        _wait_for(lambda: kill_after_step in _steps(metrics), 120, f"step {kill_after_step}")
        assert (tmp_path / "ck" / "latest").exists()  # an earlier save completed: there is a step to resume
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        _wait_for(lambda: not any(_running(pid) for pid in ranks), 5, "the ranks to die with their launcher")
    finally:
        if first.poll() is None:
            first.kill()
    written = metrics.read_text()
    time.sleep(1.0)
    assert metrics.read_text() == written  # nobody writes on
    resumed = _train(tmp_path, *saving, "--steps", "16", "--resume", "--metrics", "m.jsonl")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert _steps(metrics) == list(range(1, 17))  # each step once: the repeats trimmed
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000016"
    assert not (tmp_path / "ck" / ".lock").exists() and not (tmp_path / ".m.jsonl.lock").exists()


@pytest.mark.slow
def test_a_run_reading_a_live_runs_directory_reads_the_step_it_pinned(tmp_path):
    writer = _train(
        tmp_path, "--steps", "100000", "--checkpoint-dir", "ck", "--checkpoint-every", "1", "--keep-checkpoints", "1"
    )
    try:
        _wait_for(lambda: (tmp_path / "ck" / "latest").exists(), 120, "the writer's first checkpoint")
        reader = _train(tmp_path, "--steps", "100000", "--resume", "ck", "--metrics", "reader.jsonl")
        try:
            # while the reader's ranks start and load, the writer saves and rotates many steps. Both must live
            # on: one that ends fails at once with its error. The bound is generous because the other xdist
            # worker may run a 16-rank spawn meanwhile: in a clean-clone CI the reader's first step took more
            # than 120 s (31 s on the same machine with a lighter neighbour)
            def reader_stepped():
                for name, proc in (("reader", reader), ("writer", writer)):
                    if proc.poll() is not None:
                        raise AssertionError(f"the {name} ended ({proc.returncode}): {proc.stderr.read()[-3000:]}")
                return _steps(tmp_path / "reader.jsonl")

            first = _wait_for(reader_stepped, 300, "the reader's first step")
            pins = list((tmp_path / "ck" / ".pins").iterdir())
            assert len(pins) == 1 and pins[0].name.startswith(f"step_{first[0] - 1:08d}@")
            assert (tmp_path / "ck" / f"step_{first[0] - 1:08d}").is_dir()  # kept past keep-checkpoints 1
            assert reader.poll() is None and writer.poll() is None  # both train on
        finally:
            reader.send_signal(signal.SIGKILL)
            reader.wait(timeout=10)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)


def test_a_lock_stays_live_while_any_process_it_names_runs(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "ck" / ".lock"
        with directory_lock(tmp_path / "ck") as held:
            held.add_pids([rank.pid])
            record = json.loads(lock.read_text())
        lock.write_text(json.dumps({**record, "pid": 2**22 + 7}))  # the launcher gone, a rank it named alive
        with pytest.raises(CheckpointError, match=rf"checkpoint_dir={tmp_path / 'ck'} is in use by another run"):
            with directory_lock(tmp_path / "ck"):
                pass
    finally:
        rank.kill()
        rank.wait()
    with directory_lock(tmp_path / "ck"):  # all gone: stale, taken over
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_a_lock_held_only_by_an_unreaped_dead_rank_is_stale(tmp_path):
    """A rank that outlived its killed launcher exits as a zombie until something reaps it (in a container
    whose first process reaps nothing, never): it holds no directory, so a resume takes the lock over."""
    rank = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _wait_for(lambda: "\nState:\tZ" in Path(f"/proc/{rank.pid}/status").read_text(), 30, "the rank to exit")
        lock = tmp_path / "ck" / ".lock"
        with directory_lock(tmp_path / "ck") as held:
            held.add_pids([rank.pid])
            record = json.loads(lock.read_text())
        lock.write_text(json.dumps({**record, "pid": 2**22 + 7}))  # the launcher gone, its rank a zombie
        with directory_lock(tmp_path / "ck"):  # taken over, not refused
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        rank.wait()


def test_one_metrics_file_has_one_writer(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with metrics_lock(metrics):
        with pytest.raises(
            CheckpointError, match=r"metrics=.*m\.jsonl is in use by another run .*another metrics file"
        ):
            with metrics_lock(metrics):
                pass
    assert not (tmp_path / ".m.jsonl.lock").exists()


def test_pins_keep_a_step_while_their_reader_lives(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"step_{step:08d}").mkdir()
    with pinned(tmp_path / "step_00000001"):
        assert pinned_steps(tmp_path) == {"step_00000001"}
    assert pinned_steps(tmp_path) == set()
    (tmp_path / ".pins" / "step_00000002@elsewhere@123").write_text("")  # another host's: kept, unseen from here
    import socket

    dead = tmp_path / ".pins" / f"step_00000003@{socket.gethostname()}@{2**22 + 7}"
    dead.write_text("")
    assert pinned_steps(tmp_path) == {"step_00000002"} and not dead.exists()  # a dead reader's pin is dropped


@pytest.mark.slow
def test_a_killed_rank_without_restarts_ends_in_one_line_with_where_to_resume(tmp_path):
    run = _train(tmp_path, "--dp", "2", "--steps", "100000", "--checkpoint-dir", "ck", "--checkpoint-every", "2")
    try:
        lock = tmp_path / "ck" / ".lock"
        _wait_for(lambda: (tmp_path / "ck" / "latest").exists(), 120, "the first checkpoint")
        os.kill(json.loads(lock.read_text())["pids"][1], signal.SIGKILL)  # rank 1
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    lines = err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        "tessera train: error: rank 1 of 2 died without a result (killed by SIGKILL, exit code -9)"
    )
    assert lines[0].endswith("; resume from the last checkpoint in ck with --resume")


def test_a_rank_killed_while_the_oom_killer_struck_is_named_out_of_memory(tmp_path):
    from tessera.launching.host_memory import available_bytes, oom_kills, total_bytes
    from tessera.launching.launch import died_message

    assert died_message(1, 2, -9, 3, 3) == "rank 1 of 2 died without a result (exit code -9)"
    assert died_message(1, 2, -9, 3, 4).endswith(
        "; out of memory: the kernel's out-of-memory killer ended 1 process of this machine's memory group while "
        "the ranks ran"
    )
    assert died_message(1, 2, -15, 3, 4) == "rank 1 of 2 died without a result (exit code -15)"  # not the killer's
    assert died_message(0, 1, -9, None, None) == "rank 0 of 1 died without a result (exit code -9)"  # unknown here
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v2).mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("2147483648\n")
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684096 kB\nMemAvailable:   21844124 kB\n")
    assert oom_kills(v2) == 2 and oom_kills(v1) == 5 and oom_kills(tmp_path / "none") is None
    assert available_bytes(v2, meminfo) == 6 * 2**30  # the cgroup's limit less its usage, under MemAvailable
    assert available_bytes(v1, meminfo) == 21844124 * 1024  # no cgroup limit: MemAvailable
    assert available_bytes(tmp_path / "none", tmp_path / "no-meminfo") is None
    # what the host's processes may hold in all (tessera plan's CPU ranks): MemTotal, under the cgroup's limit
    assert total_bytes(v2, meminfo) == 8 * 2**30 and total_bytes(v1, meminfo) == 24684096 * 1024
    assert total_bytes(tmp_path / "none", tmp_path / "no-meminfo") is None
