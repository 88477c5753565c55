"""The local rank spawner: run a function on N ranks of this machine and collect what each returns.

It is what `tessera train` uses outside torchrun, and what the multi-rank tests use. Ranks are forked
from a forkserver that has already imported torch, so starting 16 CPU ranks costs a fraction of a
second instead of ~15 s with `spawn` (and, unlike plain fork from a process that did OpenMP work, it
cannot inherit a locked thread pool).

Failure is reported, never waited out:
- a rank that raises fails the whole run with that rank's traceback (the other ranks are killed);
- a run that passes its deadline has every unfinished rank dump its Python stack (faulthandler on
  SIGUSR1), and the error names each stalled rank and the torch.distributed call it is stuck in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
from multiprocessing import reduction
from multiprocessing import util as mp_util
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from tessera.topology.errors import RankFailure, RankTimeout, TesseraError, is_restartable

from tessera.launching.host_memory import oom_kills

FAILURE_GRACE_S = 2.0  # after a rank fails, how long the others may take to report their own errors
# after every rank returned, how long they may take to exit before they are killed: a rank shuts its compile
# workers down first, which took more than 10 s on a starved 2-core CI machine (a killed rank leaks their
# semaphores: the GPU suite smoke's "leaked semaphore" line); a rank that exits at once waits for nothing
EXIT_GRACE_S = 30.0
# a rank stopped before it returned (a deadline, a peer's failure) gets SIGINT and this long to unwind, when no
# process of its own (a compile worker) makes it wait EXIT_GRACE_S: a rank unwinds from Python in well under it,
# and one stuck in a collective never would (it is killed after)
STOP_GRACE_S = 2.0
# what the forkserver imports once, so that each rank starts with torch and tessera loaded (`tessera train`
# starts it with the same list before its own imports: tessera.launching.rank_server.PRELOAD). First the rank
# server: it pauses the collector for the rest, and ends the server without the interpreter's shutdown
PRELOAD = ["tessera.launching.rank_server"]
PRELOAD += ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]
PRELOAD += ["tessera", "tessera.parallel", "tessera.topology", "tessera.models", "tessera.kernels"]
# and the trainer every rank imports (DCP, the metrics): each of N ranks importing it alone cost N x ~1 CPU second
PRELOAD += ["tessera.trainer"]
# and dynamo (1.7 CPU seconds): every rank's meta build imports it (torch's reference ops for meta tensors are
# wrapped to disable dynamo, which imports it on first call); tessera's own modules no longer do at import
PRELOAD += ["torch._dynamo"]
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


class Interrupted(RuntimeError):
    """The launcher got SIGTERM (a scheduler's preemption): its ranks were stopped."""


@contextlib.contextmanager
def _stop_ranks_on_sigterm(procs: list, forward: bool, forwarded: list) -> Iterator[None]:
    """Turn SIGTERM into an exception in the launcher, so the rank processes are killed on the way out
    (SIGINT already raises KeyboardInterrupt). Without it, SIGTERM ends the launcher and leaves its ranks
    training. With `forward`, the first SIGTERM is passed on to the ranks instead (they finish their step,
    save and return; the launcher then raises Interrupted), and a second one stops them at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if forward and not forwarded:
            forwarded.append(signum)
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            return
        raise Interrupted(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _RankSpec:
    rank: int
    world_size: int
    store_path: str
    backend: str
    collective_timeout: float
    stack_path: str
    threads: int
    env: dict[str, str]


class _LauncherFd:
    """One of the launcher's file descriptors (its stdout or stderr as it is when the ranks start), handed
    to a rank through the forkserver the way multiprocessing hands a Connection's: duplicated at pickling.
    Forked from the forkserver, a rank would otherwise write where the forkserver's stdio pointed when it
    started, not where the launcher's points now (a log it redirected to, a test's capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return (_detach_fd, (reduction.DupFd(self.fd),))  # DupFd works only while a process is being started


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _detach_fd(dup: Any) -> int:
    return dup.detach()


def _write_to_launchers_stdio(stdio: tuple[Any, Any]) -> None:
    """Point this rank's fds 1 and 2 where the launcher's pointed when it started the rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip((1, 2), stdio):
        if isinstance(target, int) and target != fd:
            os.dup2(target, fd)
            os.close(target)


def _die_with_launcher(lifeline: Connection) -> None:
    """Kill this rank as soon as the launcher's end of `lifeline` closes: the launcher ended, however it
    ended (SIGKILL too). The forkserver that forked the ranks outlives the launcher while they run, so its
    death is no signal of the launcher's; the pipe's end of file is."""

    def watch() -> None:
        try:
            lifeline.recv_bytes()  # the launcher never writes: this returns only at end of file
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tessera-lifeline", daemon=True).start()


def _rank_main(
    fn: Callable[..., Any],
    spec: _RankSpec,
    conn: Any,
    lifeline: Connection,
    stdio: tuple[Any, Any],
    args: tuple,
    kwargs: dict,
) -> None:
    _write_to_launchers_stdio(stdio)
    _die_with_launcher(lifeline)
    # the launcher stops a rank with SIGINT (_stop_ranks), and a rank inherits SIGINT ignored where its launcher
    # ignores it (pytest-xdist's workers, a shell script's background job): Python's own handler, whatever came
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(spec.env)
    os.environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(spec.rank))
    torch.set_num_threads(spec.threads)
    stack_file = open(spec.stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    try:
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.collective_timeout),
        )
        result = fn(*args, **kwargs)
        # plain pickle, by value: multiprocessing would share tensors through memory that dies with the rank
        conn.send_bytes(pickle.dumps(("ok", spec.rank, result)))
    except BaseException as e:  # report everything, including KeyboardInterrupt/SystemExit
        failed_at = time.time()  # before the report is formatted: which rank failed first
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        # what the parent decides by: the error's type, not its text
        cause = {
            "type": type(e).__name__,
            "message": next((ln for ln in str(e).splitlines() if ln.strip()), ""),
            "restartable": is_restartable(e),
            "exit_code": getattr(e, "exit_code", None),
            "tessera": isinstance(e, TesseraError),
            "at": failed_at,  # the others' errors may only follow from this rank's exit
        }
        conn.send_bytes(pickle.dumps(("error", spec.rank, (tb, cause))))
    finally:
        # leaving: a further SIGINT (Ctrl-C reached it, then the launcher's stop) must not cut the teardown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()  # without this gloo ranks can abort at exit
        finally:
            conn.close()
            # torch.compile's worker pool, and what the rank made through multiprocessing: os._exit skips
            # their shutdown and the finalizers that unlink their semaphores, which a resource tracker then
            # reports as leaked when the run ends
            compile_workers = sys.modules.get("torch._inductor.async_compile")
            with contextlib.suppress(Exception):
                if compile_workers is not None:
                    compile_workers.shutdown_compile_workers()
            with contextlib.suppress(Exception):  # apart: a failed worker shutdown must not skip the finalizers
                mp_util._run_finalizers()  # type: ignore[attr-defined]  # private, stable since Python 3.4
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _where_stuck(stack: str) -> str:
    """The innermost torch.distributed call in a faulthandler dump (most recent frame first), else the
    innermost frame, with the caller that made it."""
    frames = [m.groupdict() for m in _FRAME.finditer(stack)]
    if not frames:
        return "no stack captured (the rank may be stuck outside Python)"
    for i, f in enumerate(frames):
        if "torch/distributed" in f["file"]:
            # the innermost torch.distributed frame is the collective; its caller is the first frame outside
            caller = next((c for c in frames[i + 1 :] if "torch/distributed" not in c["file"]), None)
            at = f" called from {caller['file']}:{caller['line']} ({caller['func']})" if caller else ""
            return f"torch.distributed {f['func']}{at}"
    f = frames[0]
    return f"{f['func']} at {f['file']}:{f['line']}"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 60.0,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    threads: int = 1,
    env: dict[str, str] | None = None,
    forward_sigterm: bool = False,
    on_start: Callable[[list[int]], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks (process group initialized, RANK/WORLD_SIZE set);
    return the per-rank results in rank order.

    `fn` and its arguments must be picklable (a module-level function). Raises RankFailure if a rank
    raises, RankTimeout if the ranks are not all done within `timeout` seconds (None: no deadline).
    `collective_timeout` bounds any one collective (gloo raises, naming the operation); by default it
    stays 30 s behind `timeout`, so the deadline reports first, with every stalled rank's stack.
    SIGTERM to this process kills the ranks and raises Interrupted; with `forward_sigterm` the ranks get
    it first (to save and stop), and Interrupted follows once they have returned. The ranks die with this
    process however it ends, SIGKILL included (a pipe whose end they watch). `on_start(pids)` is called
    with the ranks' process ids once they run (a lock that names every writer).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="tessera-ranks-")
    procs: list[BaseProcess] = []
    conns: dict[Connection, int] = {}
    lifeline, keep_alive = ctx.Pipe(duplex=False)  # the ranks hold the reading end; this process the other
    finished = False  # every rank returned its result: let them finish their own exit before any kill
    try:
        forwarded: list[int] = []
        with _stop_ranks_on_sigterm(procs, forward_sigterm, forwarded):
            results = _start_and_collect(
                fn,
                world_size,
                args,
                kwargs,
                ctx,
                workdir,
                procs,
                conns,
                timeout,
                collective_timeout,
                backend,
                threads,
                env,
                lifeline,
                on_start,
            )
        finished = True
        if forwarded:
            raise Interrupted(f"stopped by {signal.Signals(forwarded[0]).name}; the ranks saved a checkpoint first")
        return results
    finally:
        if finished:  # a rank that has sent its result still tears down (its process group, compile workers)
            ends = time.monotonic() + EXIT_GRACE_S
            for p in procs:
                p.join(timeout=max(0.0, ends - time.monotonic()))
        else:  # a deadline, a failure or an interrupt: the ranks still running are stopped, each its own way out
            _stop_ranks(procs, [procs[rank] for rank in conns.values()])
        keep_alive.close()
        lifeline.close()
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc/PID/task/TID/children); [] where that cannot be read."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
    return found


def _stop_ranks(procs: list[BaseProcess], running: list[BaseProcess]) -> None:
    """Interrupt (SIGINT) the ranks in `running` and let every rank still alive unwind through _rank_main's
    `finally` (its process group, torch.compile's worker pool, the finalizers that unregister its
    semaphores): EXIT_GRACE_S for a rank with processes of its own (compile workers, a data loader's),
    STOP_GRACE_S for the rest; the caller kills what is left. Killed at once, a rank left its workers running
    on, and the resource tracker it shares with the launcher reported its semaphores leaked (the mp lock of
    the progress bar inductor shows while it waits for its compile workers: the GPU suite's compiled part cut
    off by its budget on a loaded machine). A rank stuck in a collective does not see the signal: its grace
    runs out."""
    for p in running:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGINT)
    began = time.monotonic()
    for p in procs:
        if p.is_alive() and p.pid is not None:
            grace = EXIT_GRACE_S if _children(p.pid) else STOP_GRACE_S
            p.join(timeout=max(0.0, began + grace - time.monotonic()))


def _start_and_collect(
    fn,
    world_size,
    args,
    kwargs,
    ctx,
    workdir,
    procs,
    conns,
    timeout,
    collective_timeout,
    backend,
    threads,
    env,
    lifeline,
    on_start,
) -> list[Any]:
    """Start one process per rank (appended to `procs`, so the caller can kill them) and collect results."""
    for rank in range(world_size):
        spec = _RankSpec(
            rank=rank,
            world_size=world_size,
            store_path=os.path.join(workdir, "store"),
            backend=backend,
            # gloo's own timeout stays behind ours, so our deadline reports first and with stacks
            collective_timeout=collective_timeout or ((timeout or 600.0) + 30.0),
            stack_path=os.path.join(workdir, f"stack{rank}.txt"),
            threads=threads,
            env=dict(env or {}),
        )
        recv, send = ctx.Pipe(duplex=False)
        stdio = tuple(_LauncherFd(fd) if _is_open(fd) else None for fd in (1, 2))
        p = ctx.Process(
            target=_rank_main, args=(fn, spec, send, lifeline, stdio, args, kwargs), name=f"tessera-rank{rank}"
        )
        p.start()
        send.close()
        procs.append(p)
        conns[recv] = rank
    if on_start is not None:
        on_start([int(p.pid) for p in procs if p.pid is not None])
    return _collect(procs, conns, world_size, timeout, workdir, oom_kills())


def died_message(rank: int, world_size: int, code: int | None, oom_before: int | None, oom_now: int | None) -> str:
    """A rank that exited without a result, in one line: its exit code (a signal: -N), and out of memory
    where the kernel's out-of-memory killer ended processes of this cgroup while the ranks ran."""
    text = f"rank {rank} of {world_size} died without a result (exit code {code})"
    if code == -signal.SIGKILL and oom_before is not None and oom_now is not None and oom_now > oom_before:
        killed = oom_now - oom_before
        text += (
            f"; out of memory: the kernel's out-of-memory killer ended {killed} process{'es' if killed > 1 else ''} "
            f"of this machine's memory group while the ranks ran"
        )
    return text


def _collect(
    procs: list[BaseProcess],
    conns: dict[Connection, int],
    world_size: int,
    timeout: float | None,
    workdir: str,
    oom_before: int | None = None,
) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(conns)
    # (when, rank, error) of the ranks that failed. After the first, the others get a moment to report too,
    # and the earliest is raised: a rank that raises closes its connections, and its peers' collectives then
    # fail with the backend's "connection closed", which may reach the parent first.
    failures: list[tuple[float, int, RankFailure]] = []
    grace_end: float | None = None
    while pending:
        ends = [t for t in (deadline, grace_end) if t is not None]
        ready = wait(list(pending), timeout=max(0.0, min(ends) - time.monotonic()) if ends else None)
        if not ready:
            break
        for conn in [c for c in pending if c in ready]:  # the connections `wait` returned, as typed in `pending`
            rank = pending.pop(conn)
            del conns[conn]  # what is left in `conns` names the ranks still running (run_ranks' way out)
            try:
                status, _, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=5)  # reaped: its exit code (a signal: -N) is known, not None
                code = procs[rank].exitcode
                error = RankFailure(died_message(rank, world_size, code, oom_before, oom_kills()))
                # first of all: a rank dies without a result by a signal or a crash of its own, never from a
                # peer's error (that it would catch and report)
                failures.append((float("-inf"), rank, error))
            else:
                if status == "ok":
                    results[rank] = payload
                    continue
                tb, cause = payload
                error = RankFailure(
                    f"rank {rank} of {world_size} raised:\n{tb}", restartable=cause["restartable"], cause=cause
                )
                failures.append((cause["at"], rank, error))
            if grace_end is None:
                grace_end = time.monotonic() + FAILURE_GRACE_S
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1]))[2]
    if pending:
        stalled = sorted(pending.values())
        for rank in stalled:
            pid = procs[rank].pid
            if pid is not None and procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)
        where = {}
        for rank in stalled:
            with open(os.path.join(workdir, f"stack{rank}.txt")) as f:
                where[rank] = _where_stuck(f.read())
        detail = "\n".join(f"  rank {r}: stuck in {w}" for r, w in where.items())
        raise RankTimeout(
            f"{len(stalled)} of {world_size} ranks did not finish within {timeout:g}s (ranks {stalled}):\n{detail}",
            where,
        )
    return [results[r] for r in range(world_size)]
