"""Running a training job: validate, then join the torchrun job or spawn the layout's ranks locally;
on each rank, the loop with its logging, metrics file and checkpoints.

Outside torchrun, `train` spawns pp*dp*cp*tp ranks on this machine with tessera.launching.launch: NCCL
with one GPU per rank when the machine has enough GPUs (else the config refuses), gloo on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tessera.kernels import set_default_backend
from tessera.metrics.loggers import Loggers, mfu_per_token, open_loggers
from tessera.metrics.profiling import StepProfiler
from tessera.metrics.results import strict_json
from tessera.metrics.step_profile import describe as describe_profile
from tessera.models.hf import load_hf_weights
from tessera.models.spec import shape_of
from tessera.checkpointing import checkpoint
from tessera.launching.launch import RankFailure, RankTimeout, run_ranks
from tessera.checkpointing.locks import RunLock, directory_lock, metrics_lock, pinned
from tessera.topology import Layout
from tessera.topology.estimators.step_estimate import model_flops_per_token

from .run_config import Config
from .ft_launch import replica_config, train_fault_tolerant
from .preflight import resolve_checkpoint
from .replicas import LAUNCH_ENV, group_config
from tessera.launching.rank_server import speaks_for_the_job
from tessera.launching.rank_server import under_torchrun  # noqa: F401  (tessera.training.run.under_torchrun, as before)
from .report import (  # noqa: F401  (re-exported: the commands and tests import them from here)
    compute_dtype_summary,
    done_line,
    error_exit,
    failed_message,
    failure_cause,
    header_record,
    layout_words,
    pipeline_summary,
    progress_line,
    run_label,
    startup_line,
    stopped_message,
)
from .training_loop import Trainer

RESUME_PIN_ENV = "TESSERA_RESUME_PIN"  # the ranks' environment: the launcher's pin of the resumed step


def _hf_model_section(config: Config):
    """After a restart the weights come from the checkpoint; a Hugging Face model keeps its config.json."""
    if config.checkpoint.init_from_hf:
        return dataclasses.replace(config.model, preset=f"hf:{config.checkpoint.init_from_hf}")
    return config.model


def _join_torchrun_job(backend: str, timeout: float, attempt: int) -> None:
    """init_process_group from torchrun's environment, with every store key under a per-attempt prefix.
    torchrun's store outlives a restart (--max-restarts): without the prefix, the restarted workers read
    the previous attempt's addresses for the mesh's subgroups (new_group names repeat) and fail to connect."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    store = dist.PrefixStore(f"tessera/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _announce(messages: list[str]) -> None:
    """Warnings of the launching process (a checkpoint fallback), one line each, once: on rank 0 under
    torchrun, where every worker runs the launch."""
    if speaks_for_the_job():
        for message in messages:
            print(f"tessera: warning: {message}", file=sys.stderr, flush=True)


def _keep_metrics_through(path: str, step: int) -> None:
    """After a restart or a --resume: drop the step records past `step` (the restored checkpoint's), which
    the run is about to repeat, so the file holds every step once. Headers stay (each marks a start); a line
    cut short by a killed writer goes."""
    p = Path(path)
    if not p.exists():
        return
    kept = []
    for line in p.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn: its writer died mid-line
        if record.get("type") == "header" or record.get("step", 0) <= step:
            kept.append(line)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, p)


class _StopOnSignal:
    """A rank's SIGTERM sets a flag; after each step the ranks agree (one tiny all-reduce) to stop."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self.requested = True

    def requested_anywhere(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def run_rank(config: Config, attempt: int = 0) -> list[dict[str, Any]] | None:
    """The training loop on this rank (process group initialized); rank 0 returns the step records.
    `attempt` > 0: a restart after a failure (the metrics file is cut back to the restored step)."""
    set_default_backend(None if config.runtime.kernels == "auto" else config.runtime.kernels)
    trainer = Trainer(config)
    rank, quiet = trainer.rank, config.runtime.quiet
    say = (lambda text: print(text, flush=True)) if rank == 0 and not quiet else (lambda text: None)
    if config.checkpoint.init_from:
        for part in trainer.parts:  # a pipeline stage takes the names it holds
            checkpoint.load_full_state_dict(part, config.checkpoint.init_from)
        say(f"loaded weights from {config.checkpoint.init_from}")
    if config.checkpoint.init_from_hf:
        for part in trainer.parts:  # each rank reads only the parameters it holds, cut to its shards
            load_hf_weights(part, config.checkpoint.init_from_hf)
        say(f"loaded Hugging Face weights from {config.checkpoint.init_from_hf}")
    if config.checkpoint.resume is not None:
        with warnings.catch_warnings():  # a fallback to an older checkpoint: the launcher announced it, once
            warnings.filterwarnings("ignore", message="the latest checkpoint .* is unusable")
            manifest = trainer.load(config.resume_path)
        say(
            f"resumed from {resolve_checkpoint(config.resume_path)[0]}: step {manifest['step']} "
            f"({manifest['consumed_tokens']:,} tokens) saved on {layout_words(Layout(**manifest['layout']))}"
        )
    # the launcher's pin of the step this run resumed from (RESUME_PIN_ENV): it stays while the step is read and
    # until this run saves newer ones, then --keep-checkpoints rotates it like any other
    manager = checkpoint.CheckpointManager(
        config.checkpoint.dir, keep=config.checkpoint.keep, own_pin=os.environ.get(RESUME_PIN_ENV)
    )
    history: list[dict[str, Any]] = []
    stop = _StopOnSignal() if config.checkpoint.on_signal else None
    if (attempt or config.checkpoint.resume is not None) and config.runtime.metrics and rank == 0:
        _keep_metrics_through(config.runtime.metrics, trainer.step)  # a restart and a --resume alike
    out = open(config.runtime.metrics, "a") if (config.runtime.metrics and rank == 0) else None
    loggers = _open_loggers(config, trainer) if rank == 0 else Loggers([])
    mfu_scale = None

    profiler = StepProfiler(config, rank, trainer.device, trainer.step)  # --profile (else it does nothing)
    header_written = started_up = False
    try:
        start, first_step = time.perf_counter(), trainer.step
        profiler.start()
        while trainer.step < config.runtime.steps:
            result = trainer.train_step()
            m = result.record()
            # the header and start-up line carry what the first step measured (a replica group that joined late
            # took its peers' state in that step: its first step is theirs)
            if not started_up:
                started_up = True
                say(startup_line(config, trainer))
                if out:
                    out.write(
                        strict_json({**header_record(config, trainer, uuid.uuid4().hex), "restart": attempt}) + "\n"
                    )
                    header_written = True
                mfu_scale = _mfu_scale(config, trainer)
            if result.skip_report and rank == 0:  # one line per skipped step, with --quiet too
                print(f"tessera: {result.skip_report}", flush=True)
            if config.data.eval_every and trainer.step % config.data.eval_every == 0:
                m["eval_loss"] = trainer.evaluate()
            if mfu_scale is not None:  # measured tokens/s over the device's datasheet peak (GPU, bf16 only)
                m["mfu"] = m["tokens_per_s"] * mfu_scale
            history.append(m)
            if out:  # before the checkpoint: a crash in between repeats the step (and its line is cut), never skips it
                out.write(strict_json(m) + "\n")
                out.flush()
            loggers.log(m)  # --tensorboard, --wandb: rank 0's, flushed
            completed = manager.poll()  # an async save whose files every rank has written becomes latest
            if completed is not None:
                say(f"saved checkpoint {completed} (written in the background)")
            saved = config.checkpoint.every and trainer.step % config.checkpoint.every == 0
            if saved:
                path = trainer.save(manager)
                say(
                    f"saving checkpoint {path} in the background (training waited {manager.blocked_s:.2f} s)"
                    if manager.pending is not None
                    else f"saved checkpoint {path}"
                )
            if stop is not None and stop.requested_anywhere(trainer.device):  # every rank decides alike
                path = path if saved else trainer.save(manager)
                manager.finish()
                say(f"stopping on SIGTERM at step {trainer.step}: saved checkpoint {path} (resume with --resume)")
                break
            profiler.step()
            say(progress_line(m, config, time.perf_counter() - start, trainer.step - first_step))
        else:  # the last step trained: a run that checkpoints saves it, whatever --checkpoint-every says
            final = trainer.step > first_step and config.checkpoint.every
            if final and trainer.step % config.checkpoint.every:
                path = trainer.save(manager)
                say(
                    f"saving checkpoint {path} of the final step in the background"
                    if manager.pending is not None
                    else f"saved checkpoint {path} of the final step"
                )
        completed = manager.finish()  # the last async save's files, then latest
        if completed is not None:
            say(f"saved checkpoint {completed} (written in the background)")
    finally:
        profiler.stop()  # a window cut short (SIGTERM, an error) is still written
        loggers.close()
        if out:
            if not header_written:  # nothing left to train (resumed at the last step), or step 1 failed
                out.write(strict_json({**header_record(config, trainer, uuid.uuid4().hex), "restart": attempt}) + "\n")
            out.close()
    for m in history if rank == 0 and not quiet else ():
        if "profile" in m:
            print(describe_profile(m["profile"], m["step"]), flush=True)
    summary = profiler.summary()
    if summary and rank == 0:  # asked for with --profile: printed even with --quiet
        print(summary, flush=True)
    return history if rank == 0 else None


def _open_loggers(config: Config, trainer: Any) -> Loggers:
    """--tensorboard and --wandb on rank 0, continuing a resumed run's curves from its next step."""
    resumed = config.checkpoint.resume is not None
    return open_loggers(
        config.runtime.tensorboard,
        config.runtime.wandb,
        first_step=trainer.step + 1,
        name=f"{config.model_name} {run_label(config, trainer.layout)}",
        config=config.to_dict(),
        checkpoint_dir=config.checkpoint.dir,
        resumed_root=resolve_checkpoint(config.resume_path)[0].parent if resumed else None,
    )


def _mfu_scale(config: Config, trainer: Any) -> float | None:
    """MFU per token/s on this run's devices (None on CPU, or where no bf16 peak is known)."""
    if trainer.device.type != "cuda":
        return None
    flops = model_flops_per_token(shape_of(trainer.model_config), config.data.seq_len)
    name = torch.cuda.get_device_name(trainer.device)
    compute = (trainer.dtype_report or {}).get("compute_dtype")
    return mfu_per_token(name, compute, flops, trainer.layout.world_size)


def _backend(config: Config) -> str:
    return "nccl" if config.device_type() == "cuda" else "gloo"


def train(config: Config) -> list[dict[str, Any]] | None:
    """Validate, then run: join the torchrun job, or spawn the layout's ranks locally. Returns rank 0's
    step records (None on other torchrun ranks)."""
    config.check()
    if config.checkpoint.resume is not None:  # a damaged latest checkpoint, and the older one used instead
        _announce(resolve_checkpoint(config.resume_path)[1])
    if config.ft.fault_tolerant and not under_torchrun():
        with contextlib.ExitStack() as held:  # the launcher holds what the groups write
            _lock_what_this_run_writes(config, held)
            if config.ft.ft_replica_id is None:  # the lighthouse and every group, here
                train_fault_tolerant(config, replica_main)
            else:  # one group, started by hand beside a lighthouse
                train_group(config)
        return None
    if config.ft.fault_tolerant:  # under torchrun: this job is one replica group (its files, its share)
        if config.ft.ft_replica_id is None or config.ft.lighthouse is None:
            raise ValueError(
                "--fault-tolerant under torchrun: each replica group is its own job; give it --ft-replica-id R "
                "and --lighthouse ADDR (tessera lighthouse starts one)"
            )
        config = group_config(replica_config(config, config.ft.ft_replica_id, config.ft.lighthouse))
    if _backend(config) == "nccl":  # a stalled NCCL collective dumps torch's flight recorder (every rank's last ops)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(config.checkpoint.dir or ".") / "nccl_trace_rank_"))
    if under_torchrun():
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun --max-restarts restarted us
        config = _resuming_after_failure(config) if attempt else config
        with contextlib.ExitStack() as held:
            if not attempt and int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the metrics and the latest
                _lock_what_this_run_writes(config, held)
            _join_torchrun_job(_backend(config), config.runtime.timeout, attempt)
            try:
                return run_rank(config, attempt)
            finally:
                dist.destroy_process_group()

    world = config.layout.world_size
    with contextlib.ExitStack() as held:  # one writer per directory and metrics file; a resumed step pinned
        locks = _lock_what_this_run_writes(config, held)
        config, pin = _pin_resumed_checkpoint(config, held)
        attempt = 0
        while True:
            try:
                return run_ranks(
                    run_rank,
                    world,
                    config,
                    attempt,
                    timeout=None,
                    collective_timeout=config.runtime.timeout,
                    backend=_backend(config),
                    forward_sigterm=config.checkpoint.on_signal,
                    env={RESUME_PIN_ENV: pin} if pin else None,
                    on_start=functools.partial(_name_writers, locks),  # the ranks write too
                )[0]
            except (RankFailure, RankTimeout) as e:
                if attempt >= config.runtime.max_restarts or _deterministic(e):
                    raise
                attempt += 1
                config = _resuming_after_failure(config)
                where = (
                    f"the latest checkpoint in {config.checkpoint.dir}"
                    if config.checkpoint.resume is not None
                    else "step 0"
                )
                first = failure_cause(e)
                print(
                    f"tessera: {first}; restarting every rank from {where} (restart {attempt} of "
                    f"{config.runtime.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )


def replica_main(config: Config, launch: int) -> None:
    """A replica group's process (the local fault-tolerant launcher's): its own process group, so that it and
    its ranks are killed together (a stopped rank too), then its ranks."""
    os.setpgrp()
    os.environ[LAUNCH_ENV] = str(launch)
    train_group(config)


def train_group(config: Config) -> None:
    """One replica group of a fault-tolerant run on this machine: its ranks, training the group's config."""
    group = group_config(config)
    try:
        run_ranks(
            run_rank,
            group.layout.world_size,
            group,
            0,
            timeout=None,
            collective_timeout=config.runtime.timeout,
            backend=_backend(config),
        )
    except RankFailure as e:
        if "NothingToRejoin" not in str(e):
            raise
        print(f"tessera: {str(e).splitlines()[-1].split(': ', 1)[-1]}", file=sys.stderr, flush=True)


def _name_writers(locks: list[RunLock], pids: list[int]) -> None:
    for lock in locks:
        lock.add_pids(pids)


def _lock_what_this_run_writes(config: Config, held: contextlib.ExitStack) -> list[RunLock]:
    """Lock the checkpoint directory (when the run saves) and the metrics file for the run's length: a second
    live run writing either is refused in one line."""
    locks = []
    if config.checkpoint.dir and config.checkpoint.every:
        locks.append(held.enter_context(directory_lock(config.checkpoint.dir)))
    if config.runtime.metrics:
        locks.append(held.enter_context(metrics_lock(config.runtime.metrics)))
    return locks


def _pin_resumed_checkpoint(config: Config, held: contextlib.ExitStack) -> tuple[Config, str | None]:
    """(the config resuming from the exact checkpoint resolved now, pinned for the run's length; the pin's
    name): a live run writing the same directory rotates its old checkpoints away, and one this run reads
    stays until it ends (but for this run's own rotation, once it has saved newer ones). The ranks then read
    that step, not whatever `latest` names by the time they start."""
    if config.checkpoint.resume is None:
        return config, None
    for _ in range(3):  # resolved, then removed by the writer before the pin landed: resolve again
        step, _ = resolve_checkpoint(config.resume_path)
        pin = held.enter_context(pinned(step))
        if checkpoint.structural_problem(step) is None:
            resumed = dataclasses.replace(config.checkpoint, resume=str(step))
            return dataclasses.replace(config, checkpoint=resumed), pin
    raise checkpoint.CheckpointError(
        f"resume={config.resume_path}: the checkpoint it names was removed three times before it could be pinned "
        f"(a live run rotates that directory); resume from a fixed step with --resume DIR/step_N"
    )


def _deterministic(error: Exception) -> bool:
    """Failures a restart would only repeat (bad input, a damaged checkpoint, a non-finite value), by the
    error's type (tessera.topology.errors), never its text."""
    return not getattr(error, "restartable", True)


def _resuming_after_failure(config: Config) -> Config:
    """The config of a restart: resume from the latest complete checkpoint of --checkpoint-dir, if any
    (else start over from step 0, as the failed attempt did)."""
    root = config.checkpoint.dir
    if root and (Path(root) / "latest").exists():
        try:
            _announce(resolve_checkpoint(root)[1])
        except checkpoint.CheckpointError:
            return config
        return dataclasses.replace(
            config,
            checkpoint=dataclasses.replace(config.checkpoint, resume="", init_from=None, init_from_hf=None),
            model=_hf_model_section(config),
        )
    return config
