"""What a run says: its header record, the start-up line, progress and done lines, and the one-line messages of
a stopped or failed run (naming where to resume)."""

from __future__ import annotations

import platform
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tessera import __version__
from tessera.parallel.pipeline import split_layers
from tessera.topology.schedules.simulator import simulate
from tessera.topology import Layout
from torch.distributed.tensor import DTensor

from .run_config import Config
from tessera.launching.rank_server import speaks_for_the_job, under_torchrun
from .straggler import Straggler


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
        **({"offload": trainer.offload_report()} if config.parallel.offload != "none" else {}),
        # this record and every step's are strict JSON: a NaN or infinite number (a skipped step's loss, the
        # config's --max-grad-norm inf) is written as null
        "nonfinite_as": "null",
        "versions": {"tessera": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def run_label(config: Config, layout: Layout | None = None) -> str:
    """The layout as a run's lines name it: its degrees ("one process" for a single rank), with sequence
    parallel when it is on (it changes what each rank holds and sends, so the label says it); a replica group
    of a fault-tolerant run says which group of how many it is."""
    layout = layout or config.layout
    text = layout_words(layout)
    text += " + sequence parallel" if config.parallel.sequence_parallel and layout.tp > 1 else ""
    if config.ft.ft_replica_groups:
        text = f"replica group {config.ft.ft_replica_id} of {config.ft.ft_replica_groups} (fault-tolerant): {text}"
    return text


def layout_words(layout: Layout) -> str:
    """A layout as the run's lines name it: 'one process' for a single rank (Layout's own str says 'single')."""
    return "one process" if layout.world_size == 1 else str(layout)


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
    where.insert(0, data_summary(config, trainer))
    if config.parallel.offload != "none":
        where.insert(0, offload_summary(config.parallel.offload, trainer.device.type))
    if config.optimizer.optimizer != "adamw":  # AdamW is the default: name another optimizer
        where.insert(0, "Muon on the hidden matrices, AdamW on the rest")
    return (
        f"tessera: {config.model_name} ({_human(total)} params, {trainer.model_config.n_layers} layers) on "
        f"{run_label(config, trainer.layout)} = {trainer.layout.world_size} {trainer.device.type.upper()} "
        f"rank{'s' if trainer.layout.world_size > 1 else ''}; "
        f"{_human(local)} params on rank 0; "
        f"{compute_dtype_summary(trainer.dtype_report)}; "
        f"{fp8_summary(config, trainer)}"
        f"{config.runtime.steps} steps of {config.data.global_batch} x {config.data.seq_len} tokens"
        f"{' (packed documents, each attending only to itself)' if config.data.pack_documents else ''}"
        f"{f' in {config.microbatches} microbatches' if config.microbatches > 1 else ''}"
        f"{' (the fewest the schedule runs; --microbatches M to choose)' if fewest else ''}; " + "; ".join(where)
    )


def offload_summary(mode: str, device_type: str) -> str:
    """What --offload moved, as the start-up line says it."""
    what = (
        "AdamW's moments and an fp32 copy of each shard in host memory, stepped there"
        if mode == "optimizer"
        else "parameter shards, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy)"
    )
    return f"offload {mode}: {what}" + (
        " (a CPU run: host buffers apart from the model's)" if device_type == "cpu" else ""
    )


def data_summary(config: Config, trainer: Any) -> str:
    """Where the tokens come from: the built-in corpus, token files, or hf: records (with SFT, which template
    renders them: the folder's chat template or the plain one)."""
    d = config.data
    if d.path is None:
        return "data: the built-in corpus"
    text = f"data: {d.path}"
    renderer = getattr(getattr(trainer, "data", None), "renderer", None)
    if d.sft and renderer is not None:
        text += f" (SFT with {renderer.source}: the loss on the assistant's tokens)"
    return text


def fp8_summary(config: Config, trainer: Any) -> str:
    """'FP8 tensorwise (torchao, emulated in fp32 on CPU): 12 linear layers in FP8; high precision: ...; ' of
    rank 0's part(s), as parallelize converted them ('' without --fp8)."""
    reports = [r for part in trainer.parts if (r := getattr(part, "fp8_report", None)) is not None]
    if not config.parallel.fp8 or not reports:
        return ""
    converted = sum(len(r.converted) for r in reports)
    gathered = sum(r.float8_all_gather for r in reports)
    kept = {name: why for r in reports for name, why in r.kept.items()}
    how = "emulated in fp32 on CPU" if trainer.device.type != "cuda" else "torch._scaled_mm"
    rest = "; high precision: " + ", ".join(f"{n} ({w})" for n, w in sorted(kept.items())) if kept else ""
    gather = f" (FSDP2 all-gathers {gathered} of their weights in FP8)" if gathered else ""
    # torchao's casts and scalings run as separate kernels without compile: on one H200 the 1b preset's eager
    # FP8 step took 1.8x the bf16 one (benchmarks/results/gpu_suite_h200-rerun.json); compile fuses them
    slow = (
        " (without --compile torchao's casts run as separate kernels: slower than bf16, 0.55x its tokens/s on an "
        "H200; add --compile)"
        if trainer.device.type == "cuda" and not config.parallel.compile
        else ""
    )
    return f"FP8 {config.parallel.fp8} (torchao, {how}){slow}: {converted} linear layers on rank 0{gather}{rest}; "


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


def error_exit(command: str, message: str) -> int:
    """One line on stderr; under torchrun only rank 0 prints it."""
    if speaks_for_the_job():
        print(f"tessera {command}: error: {message}", file=sys.stderr, flush=True)
    return 2


# how long a torchrun worker other than rank 0 waits, after a refusal every worker made, for torchrun to stop it
REFUSAL_WAIT_S = 10.0


def refusal_exit(command: str, message: str) -> int:
    """`error_exit` for a refusal before training, which every torchrun worker makes alike (the checks are the
    same on every rank): the workers other than rank 0 wait up to REFUSAL_WAIT_S before they return. One that
    left first would have torchrun stop rank 0 (SIGTERM) before it printed, and the job would end without its
    line (seen under load). Rank 0's exit has torchrun stop them instead, its code 2 the job's root cause."""
    code = error_exit(command, message)
    if under_torchrun() and not speaks_for_the_job():
        time.sleep(REFUSAL_WAIT_S)
    return code
