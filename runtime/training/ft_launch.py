"""`tessera train --fault-tolerant --dp-replicate R` outside torchrun: a torchft lighthouse, then R replica groups,
each its own process spawning its ranks, and a replacement for a group that dies (up to --ft-replacements),
which rejoins its peers at a step boundary with their live state.

Replica group r writes the metrics file (`--metrics run.jsonl`: group 0's; group r > 0's `run.replica{r}.jsonl`:
one writer per file), and only group 0 saves checkpoints; a whole-job resume loads the same one in every group.
Under torchrun or Slurm each group is its own job (`--ft-replica-id r --lighthouse ADDR`, `tessera lighthouse`
starting the lighthouse): docs/reliability.md's fault-tolerance section.

Fault drills for tests and rehearsals (`TESSERA_FT_DRILL`, faults separated by `;`):
`replica=1,step=3,at=forward,signal=KILL` kills (or with STOP suspends) that group's rank 0 (`rank=N` another)
during step 3's forward on its first launch (`launch=1`: its first replacement); `at` is one of forward,
reduce (just before the all-reduce between groups) or recover (while taking a peer's state, at the
replacement's step 1); `pace=SECONDS` makes every step last at least that long; `rejoin_by=N` makes every
group wait at step N until a replacement has joined; `lighthouse=restart,step=N,down=D` shuts the launcher's
lighthouse down when group 0 begins step N and starts a new one on its port D seconds later.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .run_config import Config
from .replicas import OUTAGE_ENV, drill_faults

POLL_S = 0.2


def replica_metrics(path: str | None, replica: int) -> str | None:
    """Group 0 writes `path`; group r > 0 `stem.replica{r}.suffix` beside it."""
    if path is None or replica == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.replica{replica}{p.suffix}"))


def replica_config(config: Config, replica: int, lighthouse: str) -> Config:
    """The whole run's config for replica group `replica`: its id and the lighthouse, its metrics file, its
    loggers and checkpoint saving (group 0's alone)."""
    ft = dataclasses.replace(config.ft, ft_replica_id=replica, lighthouse=lighthouse)
    runtime = dataclasses.replace(
        config.runtime,
        metrics=replica_metrics(config.runtime.metrics, replica),
        tensorboard=config.runtime.tensorboard if replica == 0 else None,
        wandb=config.runtime.wandb if replica == 0 else None,
    )
    ckpt = config.checkpoint if replica == 0 else dataclasses.replace(config.checkpoint, every=0)
    return dataclasses.replace(config, ft=ft, runtime=runtime, checkpoint=ckpt)


def start_lighthouse(min_replicas: int, timeout: float, port: int = 0) -> Any:
    """A torchft lighthouse on `port` of this machine (0: a free one; its address: `.address()`)."""
    from tessera.parallel.fault_tolerance import quiet_torchft  # lazy: as the lighthouse below

    quiet_torchft()
    from torchft._torchft import LighthouseServer  # lazy: the ft extra

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=1000,  # a quorum waits this long for every heartbeating group to join
        quorum_tick_ms=100,
        heartbeat_timeout_ms=int(min(timeout, 2.0) * 1000),  # a group silent this long is left out
    )


def train_fault_tolerant(config: Config, replica_main: Any) -> None:
    """The lighthouse and every replica group on this machine, each a process running `replica_main(config,
    launch)` (run.py's: its ranks); a dead group replaced up to --ft-replacements times. Returns when every
    group has ended; raises RuntimeError naming the groups that failed for good."""
    replicas = config.parallel.dp_replicate
    lighthouse = start_lighthouse(config.ft.ft_min_replicas, config.ft.ft_timeout)
    address = lighthouse.address()
    print(
        f"tessera: {replicas} replica groups of {config.layout.world_size // replicas} rank(s), fault-tolerant "
        f"(torchft lighthouse {address})",
        flush=True,
    )
    outage = _lighthouse_drill()  # (group 0's step it goes down at, seconds it stays down) or None
    flag: Path | None = None
    if outage is not None:  # group 0 creates this file when it begins that step (replicas.drill)
        flag = Path(tempfile.mkdtemp(prefix="tessera-outage-")) / "now"
        os.environ[OUTAGE_ENV] = str(flag)
    ctx = multiprocessing.get_context("spawn")
    launches = dict.fromkeys(range(replicas), 0)
    procs = {}
    for r in range(replicas):
        procs[r] = ctx.Process(target=replica_main, args=(replica_config(config, r, address), 0), daemon=False)
        procs[r].start()
    failed: dict[int, int] = {}
    replacements = config.ft.ft_replacements
    finished_at: float | None = None  # when the first group finished: the others get --ft-timeout more
    try:
        while procs:
            time.sleep(POLL_S)
            if outage is not None and flag is not None and flag.exists():
                port = int(address.rsplit(":", 1)[1])
                lighthouse.shutdown()  # the drill: the lighthouse lost, then a new one on the same address
                print(f"tessera: drill: the lighthouse is down for {outage[1]:g} s", file=sys.stderr, flush=True)
                time.sleep(outage[1])
                lighthouse = start_lighthouse(config.ft.ft_min_replicas, config.ft.ft_timeout, port)
                print(f"tessera: drill: the lighthouse is back at {lighthouse.address()}", file=sys.stderr, flush=True)
                outage = None
            if finished_at is not None and time.monotonic() > finished_at + config.ft.ft_timeout:
                for r, p in procs.items():  # a straggler (stopped, or stuck) the quorum left behind
                    _kill_group(p)
                    failed[r] = -signal.SIGKILL
                    print(
                        f"tessera: replica group {r} had not finished {config.ft.ft_timeout:g} s (--ft-timeout) "
                        f"after the first group did (a straggler the quorum left behind): killed",
                        file=sys.stderr,
                        flush=True,
                    )
                break
            for r, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[r]
                if p.exitcode == 0:
                    finished_at = finished_at or time.monotonic()
                    continue
                if launches[r] < replacements and procs:  # survivors to rejoin
                    launches[r] += 1
                    print(
                        f"tessera: replica group {r} ended with exit code {p.exitcode}; starting a replacement "
                        f"({launches[r]} of {replacements}), which rejoins the live groups",
                        file=sys.stderr,
                        flush=True,
                    )
                    procs[r] = ctx.Process(
                        target=replica_main, args=(replica_config(config, r, address), launches[r]), daemon=False
                    )
                    procs[r].start()
                else:
                    failed[r] = p.exitcode
                    print(
                        f"tessera: replica group {r} ended with exit code {p.exitcode} and is not replaced; "
                        f"the other groups train on",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for p in procs.values():
            _kill_group(p)
        lighthouse.shutdown()
    if len(failed) == replicas:
        raise RuntimeError(f"every replica group failed (exit codes {failed})")


def _lighthouse_drill() -> tuple[int, float] | None:
    """TESSERA_FT_DRILL's `lighthouse=restart,step=N,down=D` fault: the launcher's lighthouse shut down when
    group 0 begins step N and started again on its port D seconds later."""
    for fields in drill_faults():
        if fields.get("lighthouse") == "restart":
            return int(fields.get("step", 3)), float(fields.get("down", 1.0))
    return None


def _kill_group(p: Any) -> None:
    """SIGKILL a replica group's process and its ranks (its process group: a stopped rank dies too)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.join(timeout=5)
