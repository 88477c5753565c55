"""Running a training job: validate, then join the torchrun job or spawn the layout's ranks locally;
on each rank, the loop with its logging, metrics file and checkpoints.

Outside torchrun, `train` spawns pp*dp*cp*tp ranks on this machine with tessera.parallel.launch: NCCL
with one GPU per rank when the machine has enough GPUs (else the config refuses), gloo on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
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
from tessera import __version__
from tessera.kernels import set_default_backend
from tessera.metrics.loggers import Loggers, mfu_per_token, open_loggers
from tessera.metrics.profiling import StepProfiler
from tessera.metrics.results import strict_json
from tessera.metrics.step_profile import describe as describe_profile
from tessera.models.hf import load_hf_weights
from tessera.models.spec import shape_of
from tessera.parallel import checkpoint
from tessera.parallel.launch import RankFailure, RankTimeout, run_ranks
from tessera.parallel.locks import RunLock, directory_lock, metrics_lock, pinned
from tessera.parallel.pipeline import split_layers
from tessera.parallel.schedule import simulate
from tessera.topology import Layout
from tessera.topology.planner import model_flops_per_token
from torch.distributed.tensor import DTensor

from .config import Config
from .preflight import resolve_checkpoint
from .straggler import Straggler
from .trainer import Trainer


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ)


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


def header_record(config: Config, trainer: Any, run_id: str) -> dict[str, Any]:
    return {
        "type": "header",
        "run_id": run_id,
        "created_unix": time.time(),
        "config": config.to_dict(),
        "layout": trainer.layout.as_dict(),
        "world_size": dist.get_world_size(),
        "device": str(trainer.device.type),
        "num_params": trainer.model_config.num_params(),
        # measured from the tensors during this process's first step, never the config's label
        **(trainer.dtype_report or {"compute_dtype": None}),
        "mixed_precision_configured": config.mixed_precision,
        # this record and every step's are strict JSON: a NaN or infinite number (a skipped step's loss, the
        # config's --max-grad-norm inf) is written as null
        "nonfinite_as": "null",
        "versions": {"tessera": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def run_label(config: Config, layout: Layout | None = None) -> str:
    """The layout as a run's lines name it: its degrees ("one process" for a single rank), with sequence
    parallel when it is on (it changes what each rank holds and sends, so the label says it)."""
    layout = layout or config.layout
    text = "one process" if layout.world_size == 1 else str(layout)
    return text + (" + sequence parallel" if config.parallel.sequence_parallel and layout.tp > 1 else "")


def startup_line(config: Config, trainer: Any) -> str:
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.parameters())
    total = trainer.model_config.num_params()
    where = [f"metrics -> {config.runtime.metrics}" if config.runtime.metrics else "no metrics file"]
    if config.checkpoint.dir:
        every = f"every {config.checkpoint.every} steps" if config.checkpoint.every else "never (--checkpoint-every 0)"
        where.append(f"checkpoints -> {config.checkpoint.dir} ({every})")
    if trainer.layout.pp > 1:
        where.insert(0, pipeline_summary(config))
    fewest = config.microbatches_chosen and config.layout.pp > 1
    return (
        f"tessera: {config.model_name} ({_human(total)} params, {trainer.model_config.n_layers} layers) on "
        f"{run_label(config, trainer.layout)} = {trainer.layout.world_size} {trainer.device.type.upper()} "
        f"rank{'s' if trainer.layout.world_size > 1 else ''}; "
        f"{_human(local)} params on rank 0; "
        f"{compute_dtype_summary(trainer.dtype_report)}; "
        f"{config.runtime.steps} steps of {config.data.global_batch} x {config.data.seq_len} tokens"
        f"{' (packed documents, each attending only to itself)' if config.data.pack_documents else ''}"
        f"{f' in {config.microbatches} microbatches' if config.microbatches > 1 else ''}"
        f"{' (the fewest the schedule runs; --microbatches M to choose)' if fewest else ''}; " + "; ".join(where)
    )


def compute_dtype_summary(report: dict[str, Any] | None) -> str:
    """'matmuls in bfloat16 (97.3% of step 1's matmul FLOPs; float32 2.7%)', as step 1 measured them."""
    if not report or not report.get("compute_dtype"):
        return "matmul dtype not measured"
    flops = report["matmul_flops_by_dtype"]
    total = sum(flops.values()) or 1
    top = report["compute_dtype"]
    rest = "".join(f"; {d} {f / total:.1%}" for d, f in sorted(flops.items(), key=lambda kv: -kv[1]) if d != top)
    return f"matmuls in {top} ({flops[top] / total:.1%} of step 1's matmul FLOPs{rest})"


def pipeline_summary(config: Config) -> str:
    """The schedule (a kind, or a --schedule-file's actions), the stages' layers, and the schedule's bubble
    simulated with F = B = W; for a file also its peak activations in flight (its memory, which no kind's
    rule bounds)."""
    pc = config.parallel_config().pipeline
    pp = config.layout.pp
    layers = split_layers(config.model_config.n_layers, pp * pc.virtual, pc.layers_per_stage)
    timeline = simulate(pc.actions(pp))
    what = pc.kind or (
        f"schedule from {config.parallel.schedule_file} ({pc.microbatches} microbatches, at most "
        f"{max(timeline.peak_activations)} in flight on a rank)"
    )
    v = " on a V (rank r holds stages r and 2 pp - 1 - r)" if pc.placement == "v" else ""
    return (
        f"pipeline {what} over {len(layers)} stages{v} (layers "
        + " | ".join(f"{r.start}-{r.stop - 1}" for r in layers)
        + f"), simulated bubble {timeline.bubble:.1%}"
    )


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


def progress_line(m: dict[str, Any], config: Config, elapsed: float, done_here: int) -> str:
    remaining = config.runtime.steps - m["step"]
    eta = elapsed / max(1, done_here) * remaining
    skipped = (
        f"skipped: non-finite, no update ({m.get('skipped_steps', 0)} skipped so far) | " if m.get("skipped") else ""
    )
    return (
        f"step {m['step']:>4}/{config.runtime.steps} | {skipped}loss {m['loss']:.4f} | "
        f"grad_norm {m['grad_norm']:.3f} | "
        f"lr {m['lr']:.2e} | {m['tokens_per_s']:,.0f} tok/s | peak {m['peak_memory_bytes'] / 2**20:,.0f} MiB | "
        f"eta {_duration(eta)} | {run_label(config, Layout(**m['layout']))}"
        + (f" | moe aux {m['moe']['aux_loss']:.2e} imbalance {m['moe']['max_imbalance']:.2f}" if m.get("moe") else "")
        + (
            f" | {m['documents']['documents']} docs, mean {m['documents']['mean_length']:.0f} tokens"
            if m.get("documents")
            else ""
        )
        + (f" | eval loss {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else "")
        + (f" | {Straggler(**m['straggler']).describe()}" if m.get("straggler") else "")
    )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def done_line(history: list[dict[str, Any]], config: Config) -> str:
    """The last line of a finished run: the loss over the steps this run took (a resumed or restarted run
    took only those after its checkpoint, and says from which step)."""
    first, last = history[0], history[-1]
    took = last["step"] - first["step"] + 1
    resumed = f" ({first['step']}-{last['step']}, resumed after step {first['step'] - 1})" if first["step"] > 1 else ""
    return (
        f"done: loss {first['loss']:.4f} -> {last['loss']:.4f} over {took} step{'s' if took != 1 else ''}"
        f"{resumed} on {run_label(config)}"
    )


def _where_to_resume(config: Config) -> str:
    """Where a stopped or failed run resumes from: its last checkpoint, or why there is none."""
    root = config.checkpoint.dir
    if root and (Path(root) / "latest").exists():
        return f"resume from the last checkpoint in {root} with --resume"
    if root:
        return f"no checkpoint was saved in {root} yet: nothing to resume from"
    return "no --checkpoint-dir was given: this run saved nothing to resume from"


def stopped_message(why: str, config: Config) -> str:
    """The one line of a run stopped by SIGTERM or SIGINT: suggest --resume only where a checkpoint can be."""
    if "saved a checkpoint" in why:  # --checkpoint-on-signal
        return f"{why} (resume with --resume)"
    return f"{why}; every rank was stopped ({_where_to_resume(config)})"


def failed_message(error: Exception, config: Config) -> str:
    """The one line of a run whose rank died (a signal, the out-of-memory killer) or ran out of GPU memory,
    without restarts left: what happened, and where to resume from."""
    cause = failure_cause(error)
    if "OutOfMemoryError" in cause:
        cause += " (lower --global-batch, raise --microbatches, or add --ac; tessera memory estimates a layout)"
    where = _where_to_resume(config)
    if where.startswith("resume"):
        return f"{cause}; {where}"
    return f"{cause}; {where} (--max-restarts N restarts the ranks from the latest checkpoint by itself)"


def failure_cause(error: Exception) -> str:
    """A rank's failure in one line: the exception a rank raised ('rank 1 of 4 raised RuntimeError: ...'),
    or a death by a signal named ('rank 1 of 4 died without a result (killed by SIGKILL, exit code -9)')."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    if first.endswith(" raised:") and len(lines) > 1:  # a traceback follows: its last line is the exception
        first = f"{first[: -len(' raised:')]} raised {lines[-1].strip()}"

    def named(match: re.Match) -> str:
        code = int(match.group(1))
        try:
            return f"(killed by {signal.Signals(-code).name}, exit code {code})" if code < 0 else match.group(0)
        except ValueError:
            return match.group(0)

    return re.sub(r"\(exit code (-?\d+)\)", named, first)


def _announce(messages: list[str]) -> None:
    """Warnings of the launching process (a checkpoint fallback), one line each, once: on rank 0 under
    torchrun, where every worker runs the launch."""
    if int(os.environ.get("RANK", "0")) == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
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
            f"({manifest['consumed_tokens']:,} tokens) saved on {Layout(**manifest['layout'])}"
        )
    manager = checkpoint.CheckpointManager(config.checkpoint.dir, keep=config.checkpoint.keep)
    history: list[dict[str, Any]] = []
    stop = _StopOnSignal() if config.checkpoint.on_signal else None
    if (attempt or config.checkpoint.resume is not None) and config.runtime.metrics and rank == 0:
        _keep_metrics_through(config.runtime.metrics, trainer.step)  # a restart and a --resume alike
    out = open(config.runtime.metrics, "a") if (config.runtime.metrics and rank == 0) else None
    loggers = _open_loggers(config, trainer) if rank == 0 else Loggers([])
    mfu_scale = None

    profiler = StepProfiler(config, rank, trainer.device, trainer.step)  # --profile (else it does nothing)
    header_written = False
    try:
        start, first_step = time.perf_counter(), trainer.step
        profiler.start()
        while trainer.step < config.runtime.steps:
            result = trainer.train_step()
            m = result.record()
            if trainer.step == first_step + 1:  # the header and start-up line carry what step 1 measured
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
        config = _pin_resumed_checkpoint(config, held)
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


def _pin_resumed_checkpoint(config: Config, held: contextlib.ExitStack) -> Config:
    """The config resuming from the exact checkpoint resolved now, pinned for the run's length: a live run
    writing the same directory rotates its old checkpoints away, and one this run reads stays until it ends.
    The ranks then read that step, not whatever `latest` names by the time they start."""
    if config.checkpoint.resume is None:
        return config
    for _ in range(3):  # resolved, then removed by the writer before the pin landed: resolve again
        step, _ = resolve_checkpoint(config.resume_path)
        held.enter_context(pinned(step))
        if checkpoint.structural_problem(step) is None:
            return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=str(step)))
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


def error_exit(command: str, message: str) -> int:
    """One line on stderr; under torchrun only local rank 0 prints it."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0:
        print(f"tessera {command}: error: {message}", file=sys.stderr)
    return 2
