"""A replica group's side of `--fault-tolerant` (parallel/fault_tolerance.py): the group's config (the layout
without dp_replicate, its share of the global batch), its share of the data, and the torchft Manager each of
its ranks joins, with the store the group's managers meet at.

The launcher (runtime/training/ft_launch.py) gives each group its id and the lighthouse's address; under torchrun
each group is its own job and its store is torchrun's (MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tessera.parallel.fault_tolerance import (
    FaultTolerance,
    ReplicaRows,
    ReplicaSync,
    load_rank_state,
    rank_state,
)

from .run_config import Config

DRILL_ENV = "TESSERA_FT_DRILL"  # fault drills (runtime/training/ft_launch.py's docstring)
LAUNCH_ENV = "TESSERA_FT_LAUNCH"  # which launch of its group a process is (0: the first)
DRILL_LOG_ENV = "TESSERA_FT_DRILL_LOG"  # a file each planted fault appends its time to
OUTAGE_ENV = "TESSERA_FT_OUTAGE"  # the file group 0 creates to tell the launcher a lighthouse drill's step began


def group_config(config: Config) -> Config:
    """The config one replica group trains: the layout with its dp_replicate replaced by replica groups (dp /
    R data ranks, dp_replicate 1), its share of the global batch (B / R rows), and R in ft_replica_groups.
    A group's config is returned as it is."""
    if config.ft.ft_replica_groups:
        return config
    R = config.parallel.dp_replicate
    parallel = dataclasses.replace(config.parallel, dp_replicate=1, dp=config.parallel.dp // R)
    data = dataclasses.replace(config.data, global_batch=config.data.global_batch // R)
    ft = dataclasses.replace(config.ft, ft_replica_groups=R)
    return dataclasses.replace(config, parallel=parallel, data=data, ft=ft)


def fault_tolerance(config: Config) -> FaultTolerance:
    f = config.ft
    if f.ft_replica_id is None or f.lighthouse is None:
        raise ValueError("a replica group needs --ft-replica-id and --lighthouse (the local launcher gives both)")
    return FaultTolerance(f.ft_replica_groups, f.ft_replica_id, f.lighthouse, f.ft_timeout, f.ft_min_replicas)


def replica_rows(config: Config, data: Any, open_stream: Any) -> ReplicaRows:
    """The group's share of the whole run's data: the stream of the whole global batch (`open_stream(batch)`),
    cut to this group's rows."""
    replicas = config.ft.ft_replica_groups
    whole = data if data is not None else open_stream(config.data.global_batch * replicas)
    return ReplicaRows(whole, config.ft.ft_replica_id or 0, replicas)


def group_store() -> tuple[str, int]:
    """Where this group's torchft managers meet: torchrun's store, else a TCPStore its rank 0 opens (the port
    sent to the group's other ranks over the process group)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    host = socket.gethostname()
    port = [0]
    if dist.get_rank() == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _KEEP.append(store)  # alive for the run: the managers' store
        port[0] = store.port
    dist.broadcast_object_list(port, src=0)
    return host, int(port[0])


_KEEP: list[Any] = []


def replica_sync(trainer: Any) -> ReplicaSync:
    """This rank's ReplicaSync, giving and taking the trainer's parts, optimizers and small pieces."""
    _, small = trainer.checkpoint_pieces()
    optimizers = trainer.optimizer.optimizers
    host, port = group_store()
    return ReplicaSync(
        fault_tolerance(trainer.config),
        dist.get_rank(),
        dist.get_world_size(),
        host,
        port,
        trainer.device.type,
        lambda: rank_state(trainer.parts, optimizers, small),
        lambda state: load_rank_state(trainer.parts, optimizers, small, state),
        lambda at: drill(trainer.config, trainer.progress.step + 1, at),
    )


class NothingToRejoin(RuntimeError):
    """A replacement group found no live group to take the run's state from (the run had ended, or every
    group died): it stops instead of training alone from step 0."""


def is_replacement() -> bool:
    return os.environ.get(LAUNCH_ENV, "0") != "0"


def drill_faults() -> list[dict[str, str]]:
    """TESSERA_FT_DRILL's faults (";"-separated), each its `key=value` fields ("," between them)."""
    spec = os.environ.get(DRILL_ENV, "")
    return [dict(part.split("=", 1) for part in one.split(",") if "=" in part) for one in spec.split(";") if one]


def rejoin_step() -> int | None:
    """TESSERA_FT_DRILL's `rejoin_by=N`: at step N every group waits (up to a minute) until its quorum holds
    every group again, a replacement included: a rehearsal's rejoin at a known step, whatever the start-up took."""
    return next((int(f["rejoin_by"]) for f in drill_faults() if "rejoin_by" in f), None)


def drill(config: Config, step: int, at: str) -> None:
    """TESSERA_FT_DRILL's faults (";"-separated), each on the group, step, point and launch it names; a
    `pace=SECONDS` field makes every group's every step last at least that long (a rehearsal's step time)."""
    faults = drill_faults()
    if not faults:
        return
    pace = next((float(f["pace"]) for f in faults if "pace" in f), None)
    if at == "forward" and pace:
        time.sleep(pace)
    import torch.distributed as dist  # lazy: (as above)

    for fields in faults:
        outage = os.environ.get(OUTAGE_ENV)
        if (
            outage
            and fields.get("lighthouse") == "restart"
            and at == "forward"
            and int(fields.get("step", 3)) == step
            and config.ft.ft_replica_id == 0
            and dist.get_rank() == 0
        ):
            Path(outage).touch()  # the launcher takes the lighthouse down now
        if (
            "replica" not in fields
            or int(fields["replica"]) != config.ft.ft_replica_id
            or int(fields.get("step", -1)) != step
            or fields.get("at", "forward") != at
            or os.environ.get(LAUNCH_ENV, "0") != fields.get("launch", "0")
            or dist.get_rank() != int(fields.get("rank", 0))
        ):
            continue
        log = os.environ.get(DRILL_LOG_ENV)
        if log:  # when the fault struck, for the benchmark's clock
            with open(log, "a") as f:
                f.write(f"{time.time()} replica={config.ft.ft_replica_id} step={step} at={at}\n")
        os.kill(os.getpid(), signal.SIGSTOP if fields.get("signal", "KILL") == "STOP" else signal.SIGKILL)
