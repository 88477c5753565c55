"""One writer per checkpoint directory and per metrics file, and checkpoints pinned while a run reads them.

A lock is a file created exclusively (O_EXCL) holding the launcher's pid, its host and the pids of every rank
it started: it stays live while any of them runs, so a launcher that died leaves no window in which its ranks
still write and a new run takes over. A lock whose processes are all gone on this host is stale and taken
over; one from another host is refused with the file to remove if that run has ended.

A pin is a file under the checkpoint root's `.pins/` naming a step a run reads (a `--resume` beside a live
writer): the writer's keep-K rotation leaves a step with a live pin in place until the reader ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from tessera.topology.errors import CheckpointError

PINS = ".pins"


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (one of another user counts as running; a zombie, which
    has exited and waits for a parent to reap it, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited unreaped. A rank whose launcher was killed outlives it as a zombie until
    init reaps it, and in a container whose first process reaps nothing it stays one: without this a
    resume after the crash was refused as if the dead run still held its directory. (Linux /proc; False
    where there is none.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the state follows the parenthesized name


def _holder(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # half-written by a process killed at that instant: stale


def _live(holder: dict, host: str) -> bool:
    return _live_pid(holder, host) is not None


def _live_pid(holder: dict, host: str) -> int | None:
    """The first process the lock names that still runs on this host (the launcher, then its ranks)."""
    if holder.get("host") != host:
        return None
    pids = [int(holder.get("pid", -1)), *(int(p) for p in holder.get("pids", []))]
    return next((p for p in pids if alive(p)), None)


class RunLock:
    """A held lock: `add_pids` names more writers (the ranks, once started)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record

    def add_pids(self, pids: list[int]) -> None:
        self.record["pids"] = sorted(set(self.record.get("pids", [])) | set(pids))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path)  # the lock file never goes missing while it is rewritten


@contextlib.contextmanager
def hold(lock: Path, what: str, remedy: str) -> Iterator[RunLock]:
    """Hold `lock` for the duration; `what` names the resource in a refusal (e.g. checkpoint_dir=DIR),
    `remedy` says what to do instead."""
    host = socket.gethostname()
    record = {"pid": os.getpid(), "host": host, "since": time.time(), "pids": []}
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            holder = _holder(lock)
            running = _live_pid(holder, host)
            if running is not None:
                which = "" if running == holder.get("pid") else f", its process {running}"
                raise CheckpointError(
                    f"{what} is in use by another run (pid {holder['pid']}{which} on {host}); {remedy}"
                ) from None
            if holder.get("host") not in (None, host):
                raise CheckpointError(
                    f"{what} is locked by a run on host {holder['host']} (pid {holder.get('pid')}); if it has "
                    f"ended, remove {lock}"
                ) from None
            lock.unlink(missing_ok=True)  # stale: every process it named is gone
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    try:
        yield RunLock(lock, record)
    finally:
        lock.unlink(missing_ok=True)
        lock.with_name(lock.name + ".tmp").unlink(missing_ok=True)


def directory_lock(root: str | os.PathLike) -> contextlib.AbstractContextManager[RunLock]:
    """Hold `root/.lock` while a run writes checkpoints there; a second live run is refused."""
    return hold(Path(root) / ".lock", f"checkpoint_dir={root}", "use another directory, or wait for that run to end")


def metrics_lock(path: str | os.PathLike) -> contextlib.AbstractContextManager[RunLock]:
    """Hold `.NAME.lock` beside the metrics file NAME while a run appends to it."""
    path = Path(path)
    return hold(
        path.with_name(f".{path.name}.lock"),
        f"metrics={path}",
        "give this run another metrics file, or wait for that run to end",
    )


@contextlib.contextmanager
def pinned(step: Path) -> Iterator[str]:
    """Keep checkpoint `step` from the writer's rotation while this process runs (a file in ROOT/.pins); yields
    the pin's name (`pinned_steps` leaves it out for the run that resumed from the step: see there)."""
    pins = step.parent / PINS
    pins.mkdir(exist_ok=True)
    mine = pins / f"{step.name}@{socket.gethostname()}@{os.getpid()}"
    mine.write_text(str(time.time()))
    try:
        yield mine.name
    finally:
        mine.unlink(missing_ok=True)


def pinned_steps(root: Path, own: str | None = None) -> set[str]:
    """The step directories of `root` a live process has pinned (pins of other hosts count as live: their
    processes cannot be seen from here; remove ROOT/.pins/STEP@HOST@PID if that run has ended). `own`: the
    pin of the run asking, which resumed from that step and has saved newer ones since: its pin kept other
    writers from rotating the step away while it was read, not its own rotation (--keep-checkpoints)."""
    host, names = socket.gethostname(), set()
    for pin in (root / PINS).glob("step_*@*@*") if (root / PINS).is_dir() else ():
        if pin.name == own:
            continue
        step, pin_host, pid = pin.name.split("@")
        if pin_host != host or alive(int(pid)):
            names.add(step)
        else:
            pin.unlink(missing_ok=True)  # its reader is gone
    return names
