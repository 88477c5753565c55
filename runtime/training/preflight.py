"""Every input check of a training run, done once in the launching process before any rank starts.

Each failure is a ValueError whose one line names the value and the fix. Paths are checked here too
(a metrics file or checkpoint directory that cannot be written, an --init-from file of another model's
shapes, a checkpoint that cannot be resumed faithfully), so no run fails after training has started.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlparse
from typing import Any

import torch
from tessera.metrics.profiling import check_profile, check_profile_summary, profile_window
from tessera.data.corpus import BOS, EOS
from tessera.models.hf import check_hf_weights
from tessera.data.hf_data import is_hf
from tessera.models.spec import spec_of
from tessera.data.tokens import TokenFileStream
from tessera.checkpointing import checkpoint
from tessera.parallel.fp8 import check_fp8
from tessera.parallel.fault_tolerance import FT_EXTRA, require_torchft
from tessera.launching.host_memory import available_bytes
from tessera.parallel.muon import ADJUST_LR
from tessera.parallel.tp_plan import find_modules
from tessera.paths import check_writable_dir  # noqa: F401  (re-exported: tests and callers import it from here)

from tessera.topology import Layout

from .data_sources import check_hf_data
from .estimate import fit_problem, local_ranks

from .sections import (
    CheckpointSection,
    DataSection,
    FaultToleranceSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    RuntimeSection,
)


def check_launched_world(layout: Layout, ft: FaultToleranceSection) -> None:
    """A job already launched (the quick start under torchrun): the wrong process count is the first error,
    in one line, before a mesh of the wrong shape fails deep inside torch on every rank."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if ft.fault_tolerant and not ft.ft_replica_groups:  # a fault-tolerant job: one replica group
        degrees = layout.as_dict()
        degrees.update(dp_replicate=1)
        layout = type(layout)(**degrees)
    layout.check_world_size(torch.distributed.get_world_size())


def check_data(data: DataSection, model: ModelSection, model_name: str, model_config, resume: str | None) -> None:
    """The streams a run reads: --eval-*, the hf: data sets (their flags, split, fields and tokenizer), packed
    documents, and the vocabulary of the built-in text or of the token files against the model's."""
    d = data
    if d.eval_every < 0 or d.eval_batches < 1:
        raise ValueError(f"--eval-every {d.eval_every} must be >= 0 and --eval-batches {d.eval_batches} >= 1")
    if d.eval_every and not d.eval_data:
        raise ValueError(f"--eval-every {d.eval_every} needs --eval-data PATH (held-out token files)")
    if d.eval_data and not d.eval_every:
        raise ValueError(f"--eval-data {d.eval_data} is read only with --eval-every N; add it (or drop --eval-data)")
    check_hf_data(d, model_config.vocab_size, resume)
    if d.eval_data and not is_hf(d.eval_data):
        held_out = TokenFileStream(d.eval_data, d.seq_len, d.global_batch, name="eval_data")
        if held_out.vocab_size > model_config.vocab_size:
            raise ValueError(
                f"--eval-data {d.eval_data}: its vocab_size {held_out.vocab_size} "
                f"exceeds the model's {model_config.vocab_size}"
            )
    if d.pack_documents:
        check_document_masking(model_config)
    if not d.path:  # the built-in text, byte-tokenized: ids up to EOS must be rows of the embedding
        _check_builtin_data_vocab(model, model_name, model_config)
    if d.path and not is_hf(d.path):  # the files open, sizes match, the vocabulary fits
        stream = TokenFileStream(d.path, d.seq_len, d.global_batch)
        if stream.vocab_size > model_config.vocab_size:
            raise ValueError(
                f"--data {d.path}: its vocab_size {stream.vocab_size} exceeds the {model.preset} "
                f"model's {model_config.vocab_size}; add --vocab-size {stream.vocab_size}"
            )


def check_drift_flag(runtime: RuntimeSection, checkpoint: CheckpointSection, data: DataSection) -> None:
    if not runtime.check_drift:
        return
    if checkpoint.resume is not None:
        raise ValueError(
            "--check-drift compares the run from step 0 with one process's: drop --resume (or check "
            "the records with tessera.testing.judge_drift)"
        )
    if data.global_batch % 2:
        raise ValueError(
            f"--check-drift runs one process at 1 and 2 microbatches: --global-batch {data.global_batch} "
            f"must be even; use --global-batch {data.global_batch + 1}"
        )


def check_document_masking(model_config, spec=None) -> None:
    """--pack-documents masks attention through the positions the model hands its attention slots
    (core(q, k, v, positions)): a model that calls them without positions would let packed documents see
    each other, silently. One forward on the meta device (no memory, no compute) stops at the first slot
    and checks what it was given."""
    spec = spec or spec_of(model_config)
    with torch.device("meta"):
        model = spec.build(model_config)
    slots = find_modules(model, spec.attention)
    if not slots:
        raise ValueError(
            f"--pack-documents: the {spec.name} spec's attention pattern {spec.attention!r} matches no module"
        )

    class Reached(Exception):
        pass

    def stop(module, args, kwargs):
        positions = kwargs.get("positions", args[3] if len(args) > 3 else None)
        raise Reached(positions is not None and positions.dim() == 2)

    handle = slots[0][1].register_forward_pre_hook(stop, with_kwargs=True)
    tokens = torch.zeros(1, 4, dtype=torch.long, device="meta")
    try:
        model(tokens, torch.zeros(1, 4, dtype=torch.long, device="meta"))
        given = False
    except Reached as e:
        given = e.args[0]
    finally:
        handle.remove()
    if not given:
        raise ValueError(
            f"--pack-documents: {type(model).__name__} calls its attention slots ({spec.attention}) without "
            f"the positions it was given, so packed documents would attend to each other; pass them on: "
            f"core(q, k, v, positions)"
        )


def builtin_data_vocab() -> int:
    """The vocabulary the built-in data needs: 256 byte values, then BOS and EOS (tessera.data.corpus)."""
    return max(BOS, EOS) + 1


def _check_builtin_data_vocab(section: ModelSection, model_name: str, model) -> None:
    """Without --data the run reads the shipped text byte-tokenized (ids 0..257). A smaller vocabulary
    would fail on one rank (an embedding index out of range) or, vocab-parallel over tp, silently zero
    the embedding of every id past it and train on nothing."""
    needed = builtin_data_vocab()
    if model.vocab_size >= needed:
        return
    if section.vocab_size is not None:
        given = f"--vocab-size {section.vocab_size}"
        fix = f"use --vocab-size {needed} or more"
    else:
        given = f"the {model_name} model's vocab_size {model.vocab_size}"
        fix = f"use a model with a vocabulary of {needed} or more"
    raise ValueError(
        f"{given} is below the token ids of the built-in data (byte-level: ids 0-{needed - 1}, "
        f"{needed} of them); {fix}, or train on token files of your vocabulary with --data PATH"
    )


MAX_STEPS = 10**10  # ten billion optimizer steps: beyond any training run (and what a step counter means)


def check_numbers(
    data: DataSection, optimizer: OptimizerSection, runtime: RuntimeSection, checkpoint: CheckpointSection
) -> None:
    """The numbers and names of the flags, each in its range."""
    d, o, r, c = data, optimizer, runtime, checkpoint
    for flag, value in (
        ("--steps", r.steps),
        ("--seq-len", d.seq_len),
        ("--global-batch", d.global_batch),
        ("--microbatches", d.microbatches),
    ):
        if value is not None and value <= 0:  # microbatches: None only before Config fills it in
            raise ValueError(f"{flag} {value} must be positive")
    if r.steps > MAX_STEPS:  # 10^20 was accepted with an eta of 413,313,689,980,057 hours
        raise ValueError(
            f"--steps {r.steps:,} is more than any run takes (at most {MAX_STEPS:,}); give the steps this run trains"
        )
    if not o.lr > 0 or math.isinf(o.lr):
        raise ValueError(f"--lr {o.lr} must be a positive number (0 or less would make every step a no-op or ascend)")
    if o.warmup < 0:
        raise ValueError(f"--warmup {o.warmup} must be >= 0 (0: start at the peak learning rate)")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio {o.min_lr_ratio} must lie in [0, 1] (the floor as a fraction of --lr)")
    if not o.max_grad_norm > 0:
        raise ValueError(
            f"--max-grad-norm {o.max_grad_norm} must be positive (the global norm the gradients are clipped to): "
            f"give e.g. --max-grad-norm 1.0, or --max-grad-norm inf to turn clipping off"
        )
    for flag, beta in (("--beta1", o.beta1), ("--beta2", o.beta2)):
        if not 0 <= beta < 1:
            raise ValueError(f"{flag} {beta} must lie in [0, 1)")
    if not o.eps > 0:
        raise ValueError(f"--eps {o.eps} must be positive")
    if o.weight_decay < 0:
        raise ValueError(f"--weight-decay {o.weight_decay} must be >= 0")
    if not r.timeout > 0 or math.isinf(r.timeout):
        raise ValueError(f"--timeout {r.timeout} must be a positive number of seconds (a stalled collective must fail)")
    if r.max_restarts < 0:
        raise ValueError(f"--max-restarts {r.max_restarts} must be >= 0")
    if r.on_nonfinite not in ("stop", "skip"):
        raise ValueError(f"--on-nonfinite {r.on_nonfinite!r}; use stop or skip")
    if r.max_skipped_steps is not None:
        if r.on_nonfinite != "skip":
            raise ValueError(
                f"--max-skipped-steps {r.max_skipped_steps} applies to --on-nonfinite skip, and it is "
                f"{r.on_nonfinite}: add --on-nonfinite skip, or drop --max-skipped-steps"
            )
        if not isinstance(r.max_skipped_steps, int) or r.max_skipped_steps < 1:
            raise ValueError(
                f"--max-skipped-steps {r.max_skipped_steps} must be a positive number of steps (to stop "
                f"at the first non-finite step, use --on-nonfinite stop)"
            )
    if r.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {r.device!r}; use auto, cpu or cuda")
    if r.kernels not in ("auto", "torch", "triton"):
        raise ValueError(f"--kernels {r.kernels!r}; use auto, torch or triton")
    if c.every < 0:
        raise ValueError(f"--checkpoint-every {c.every} must be >= 0 (0: never)")
    if c.keep < 0:
        raise ValueError(f"--keep-checkpoints {c.keep} must be >= 0 (0: keep all)")
    if c.every and not c.dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    if c.dir and not c.every and c.resume is None:
        raise ValueError(
            f"--checkpoint-dir {c.dir} without --checkpoint-every N saves nothing; add --checkpoint-every N "
            f"(or drop --checkpoint-dir)"
        )
    if c.on_signal and not c.dir:
        raise ValueError("--checkpoint-on-signal needs --checkpoint-dir DIR (where the checkpoint goes)")
    if c.asynchronous and not (c.every or c.on_signal):
        raise ValueError(
            "--checkpoint-async changes how checkpoints are saved, and none would be: add "
            "--checkpoint-every N and --checkpoint-dir DIR (or drop --checkpoint-async)"
        )
    if c.resume is not None and c.init_from is not None:
        raise ValueError(
            "--init-from and --resume together: a resume restores the weights from the checkpoint, so --init-from "
            "would be ignored; use one of them"
        )


def check_pipeline_flags(p: ParallelSection) -> None:
    """Pipeline flags without a pipeline would do nothing: refused, not ignored; --schedule with
    --schedule-file would be two schedules."""
    if not isinstance(p.virtual, int) or p.virtual < 1:
        raise ValueError(f"--virtual {p.virtual} must be a positive integer (stages per pp rank)")
    if p.sequence_parallel and p.tp == 1:
        raise ValueError(
            "--sequence-parallel shards the norms and the residual stream over tensor parallel, and --tp "
            "is 1: add --tp 2 (or more), or drop --sequence-parallel"
        )
    if p.cp == 1 and p.cp_method is not None:
        raise ValueError(
            f"--cp-method {p.cp_method} applies to context parallel, and --cp is 1: add --cp 2 (or more), "
            f"or drop --cp-method"
        )
    if p.schedule is not None and p.schedule_file is not None:
        raise ValueError(
            f"--schedule {p.schedule} and --schedule-file {p.schedule_file} together: the file is the "
            f"schedule; drop one of them"
        )
    if p.pp > 1:
        # a --schedule-file is read by parallel_config() and proven against pp, virtual and the microbatches
        # by check_pipeline (ParallelConfig.check), each error naming the file and its first bad action
        return
    for flag, given in (
        ("--schedule", p.schedule is not None),
        ("--schedule-file", p.schedule_file is not None),
        ("--virtual", p.virtual != 1),
        ("--pp-layers", p.pp_layers is not None),
    ):
        if given:
            raise ValueError(
                f"{flag} applies to pipeline parallel, and --pp is 1: add --pp 2 (or more), or drop {flag}"
            )


def check_optimizer(o: OptimizerSection, model) -> None:
    """--optimizer and Muon's options: a known update scale, 1-99 Newton-Schulz steps, three coefficients, and
    a model whose spec marks the matrices Muon takes (its `matrices` rule, matching a parameter)."""
    if o.optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer={o.optimizer!r} is not one of adamw, muon")
    if o.optimizer != "muon":
        # Muon's options under AdamW would do nothing: refused, not ignored (--muon-lr 0.5 trained as if unsaid)
        defaults = {f.name: f.default for f in dataclasses.fields(o) if f.name.startswith("muon_")}
        given = [f"{name}={getattr(o, name)!r}" for name, default in defaults.items() if getattr(o, name) != default]
        if given:
            raise ValueError(
                f"{given[0]} applies to optimizer=muon, and this run's optimizer is {o.optimizer}: add "
                f"optimizer=muon, or drop it"
            )
        return
    if o.muon_update_scale not in ADJUST_LR:
        raise ValueError(
            f"muon_update_scale={o.muon_update_scale!r} is not one of {', '.join(ADJUST_LR)} (torch.optim.Muon's "
            "adjust_lr_fn names); use muon_update_scale=original"
        )
    if not 1 <= o.muon_ns_steps <= 99:
        raise ValueError(f"muon_ns_steps={o.muon_ns_steps} must be within 1-99; use muon_ns_steps=5 (the usual)")
    o.ns_coefficients()  # three numbers, or a ValueError naming the flag
    if o.muon_lr < 0 or o.muon_momentum < 0 or o.muon_weight_decay < 0:
        raise ValueError(
            f"muon_lr={o.muon_lr}, muon_momentum={o.muon_momentum} and muon_weight_decay={o.muon_weight_decay} "
            "must be >= 0"
        )
    spec = spec_of(model)
    with torch.device("meta"):
        built = spec.build(model)
    if not any(spec.is_matrix(name, p.ndim) for name, p in built.named_parameters()):
        raise ValueError(
            f"optimizer=muon: the {spec.name!r} model's spec marks no matrix (its `matrices` rule "
            f"{spec.matrices} matches no 2-D or 3-D parameter); set ModelSpec.matrices, or use optimizer=adamw"
        )


def check_model_flags(model: ModelSection) -> None:
    """--n-layers and --vocab-size, before the model's config is read with them."""
    if model.n_layers is not None and model.n_layers < 1:
        raise ValueError(f"--n-layers {model.n_layers} must be at least 1")
    if model.vocab_size is not None and model.vocab_size < 2:
        raise ValueError(f"--vocab-size {model.vocab_size} must be at least 2")


def check_seq_len(data: DataSection, preset: str, model) -> None:
    if data.seq_len > model.max_seq_len:
        raise ValueError(
            f"--seq-len {data.seq_len} exceeds the {preset} preset's "
            f"max_seq_len={model.max_seq_len}; "
            f"use --seq-len {model.max_seq_len} or less"
        )


def check_device(runtime: RuntimeSection, parallel: ParallelSection, device_type: str, world: int) -> None:
    if runtime.kernels == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--kernels triton on CPU ranks: the Triton kernels need CUDA tensors; use --kernels auto or torch "
            "(or set TRITON_INTERPRET=1 to run them through Triton's slow interpreter)"
        )
    if parallel.compile and device_type == "cpu":
        if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            raise ValueError(
                "--compile on CPU ranks: torch.compile's CPU backend needs a C++ compiler (c++, g++ or "
                "clang++) on PATH; install one, or drop --compile"
            )
    if runtime.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() is False); use --device cpu"
            )
        local = local_ranks(world)
        if torch.cuda.device_count() < local:
            raise ValueError(
                f"--device cuda with {local} local ranks needs {local} GPUs (one per rank); this machine has "
                f"{torch.cuda.device_count()}: use --device cpu, a smaller layout, or torchrun across nodes"
            )


def check_precision(parallel: ParallelSection, model, tp: int, device_type: str) -> None:
    """--fp8: torchao installed, a device it runs on, and linears of the model the recipe can take at this tp."""
    check_fp8(parallel.fp8, model, spec_of(model), tp, device_type)


def check_offload(parallel: ParallelSection, optimizer: OptimizerSection) -> None:
    """--offload's combinations that tessera does not run, each refused in one line (the mode itself:
    DataParallelConfig's check)."""
    offload = parallel.offload
    if offload == "none":
        return
    if optimizer.optimizer == "muon":
        raise ValueError(
            f"--offload {offload} with --optimizer muon: offload steps AdamW on the host shard by shard, and Muon "
            f"orthogonalizes whole matrices gathered on the device; use --optimizer adamw, or drop --offload"
        )
    if offload == "optimizer" and parallel.fp8 == "tensorwise":
        raise ValueError(
            "--offload optimizer with --fp8 tensorwise: FSDP2's float8 all-gather wraps each weight shard in "
            "torchao's subclass, which the host step cannot copy; use --fp8 rowwise or --offload params"
        )


def check_fault_tolerance(f: FaultToleranceSection, p: ParallelSection, optimizer: OptimizerSection) -> None:
    """--fault-tolerant: torchft installed, a replicate axis to make fault-tolerant, a group id in range, a
    lighthouse that answers; and what is not proven under it yet, refused."""
    given = [
        flag for flag, on in (("--ft-replica-id", f.ft_replica_id is not None), ("--lighthouse", f.lighthouse)) if on
    ]
    if not f.fault_tolerant:
        if given:
            raise ValueError(f"{given[0]} applies to --fault-tolerant runs; add --fault-tolerant, or drop it")
        return
    try:
        require_torchft()
    except ValueError:
        raise ValueError(f"--fault-tolerant needs torchft, which is not installed: {FT_EXTRA}") from None
    if p.dp_replicate < 2:
        raise ValueError(
            f"--fault-tolerant makes the replicate axis fault-tolerant, and --dp-replicate is {p.dp_replicate}: "
            f"use --dp-replicate R (R >= 2 replica groups, R dividing --dp {p.dp})"
        )
    if f.ft_replica_id is not None and not 0 <= f.ft_replica_id < p.dp_replicate:
        raise ValueError(
            f"--ft-replica-id {f.ft_replica_id} is not a replica group of --dp-replicate {p.dp_replicate}: "
            f"use 0..{p.dp_replicate - 1}"
        )
    if not 1 <= f.ft_min_replicas <= p.dp_replicate:
        raise ValueError(f"--ft-min-replicas {f.ft_min_replicas} must be within 1..{p.dp_replicate}")
    if f.ft_timeout <= 0 or f.ft_replacements < 0:
        raise ValueError(f"--ft-timeout {f.ft_timeout} must be > 0 and --ft-replacements {f.ft_replacements} >= 0")
    for flag, on in (
        ("--optimizer muon", optimizer.optimizer == "muon"),
        ("--offload", p.offload != "none"),
        ("--fsdp HYBRID_SHARD or NO_SHARD", p.fsdp.upper() in ("HYBRID_SHARD", "NO_SHARD")),
    ):
        if on:
            raise ValueError(
                f"--fault-tolerant with {flag}: not proven under fault tolerance yet; the replica groups' "
                f"replicate axis is torchft's: use FULL_SHARD or SHARD_GRAD_OP inside each group and AdamW"
            )
    if f.lighthouse is not None:
        check_reachable(f.lighthouse, f.ft_timeout)


def check_reachable(address: str, timeout: float) -> None:
    """One line when nothing answers at the lighthouse's address within `timeout` seconds."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        raise ValueError(f"--lighthouse {address!r} is not http://HOST:PORT (tessera lighthouse prints it)")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout).close()
    except OSError as e:
        raise ValueError(
            f"--lighthouse {address}: nothing answers there within --ft-timeout {timeout:g} s ({e.strerror or e}); "
            f"start one with tessera lighthouse, or give its address"
        ) from None


def check_fits(config: Any, world: int) -> None:
    """The run fits this machine's memory by the planner's estimate (--force skips it): a run that would
    grow until the kernel kills it, or fork more ranks than the host can hold, is refused before it starts.
    `config` is the whole Config: the planner's estimate reads it all (estimate.planner_estimate)."""
    if config.runtime.force:
        return
    local = local_ranks(world)
    per_device = None
    if config.device_type() == "cuda":
        per_device = min(
            torch.cuda.get_device_properties(i).total_memory for i in range(min(local, torch.cuda.device_count()))
        )
    problem = fit_problem(config, None if per_device else available_bytes(), local, per_device)
    if problem is not None:
        raise ValueError(problem)


def _check_writable_file(flag: str, path: str) -> None:
    """The file opens for appending, as the run will open it: permission bits alone pass paths such as
    /proc/run.jsonl that no one can create. A file not there yet is probed through a sibling, created and
    removed in the same directory: creating and removing the file itself made it appear and vanish again
    under anyone watching for it (a `tail -F`, a test waiting for the first step)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    if p.exists() and not p.is_file():  # a FIFO: opening it for appending would wait for a reader, forever
        raise ValueError(f"{flag} {path} is not a regular file (a pipe or a device); give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if (p.exists() and not os.access(p, os.W_OK)) or not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable; choose a path you can write")
    existed = p.exists()
    try:
        if existed:
            with open(p, "a"):
                pass
        else:  # a short fixed name: one derived from the file's would fail where the file's own name fits
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".tessera-probe-")
            os.close(fd)
            try:
                os.unlink(probe)
            except OSError:
                pass  # a directory that lets files be created but not removed still takes the run's file
    except OSError as e:
        how = "opening it for appending" if existed else "creating it"
        raise ValueError(
            f"{flag} {path} cannot be written ({how} fails: {e.strerror}); choose a path you can write"
        ) from None


def resolve_checkpoint(path: str) -> tuple[Path, list[str]]:
    """checkpoint.resolve(path), and the warnings it gave (a damaged latest checkpoint, the intact one used
    instead) as their one-line messages, not emitted: the launcher prints them once (run.train); the
    pre-run checks and every rank resolve the same path again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = checkpoint.resolve(path)
    return resolved, [str(w.message) for w in caught]


def _check_metrics_is_new(path: str, resuming: bool) -> None:
    """A new run (not a --resume) refuses a metrics file that already holds a run's records: appended, its
    header and steps 1, 2, ... followed the other run's, and one curve joined the two."""
    file = Path(path)
    # under torchrun: a restart (it continues the file) and the ranks that do not write it are not asked
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if resuming or restart or os.environ.get("RANK", "0") != "0" or not file.is_file() or file.stat().st_size == 0:
        return
    with open(file, "rb") as f:
        first = f.readline(1 << 20)
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    what = "a run's records" if isinstance(record, dict) and record.get("type") == "header" else "data"
    raise ValueError(
        f"--metrics {path} already holds {what}; a new run writes a file of its own: give another path, or "
        f"remove it (--resume continues the run it holds)"
    )


def check_paths(
    r: RuntimeSection,
    c: CheckpointSection,
    resume: str | None,
    model_name: str,
    model,
    data: DataSection,
    optimizer: OptimizerSection,
) -> None:
    """What the run writes and reads: --metrics, --checkpoint-dir, a --resume checkpoint that fits this run
    (`resume`: its path, None when not resuming), --init-from and --init-from-hf files of this model."""
    if r.metrics:
        _check_writable_file("--metrics", r.metrics)
        _check_metrics_is_new(r.metrics, c.resume is not None)
    if resume is not None:
        path, _ = resolve_checkpoint(resume)  # a fallback is announced once, by run.train
        problem = checkpoint.structural_problem(path)  # missing or truncated files, before any rank starts
        if problem is not None:
            raise checkpoint.CheckpointError(problem)
        manifest = checkpoint.read_manifest(path)
        checkpoint.check_compatible(
            path,
            manifest,
            model_name,
            model.as_dict(),
            data.seq_len,
            data.global_batch,
            r.steps,
            dataclasses.asdict(optimizer),
        )
        checkpoint.check_optimizer(path, manifest, optimizer.optimizer)
    if c.init_from is not None:
        checkpoint.check_full_state_dict_file(c.init_from, model)
    if c.init_from_hf is not None:
        if c.init_from is not None or c.resume is not None:
            raise ValueError(
                "--init-from-hf starts a run from Hugging Face weights: drop --init-from / --resume (resume "
                f"a run begun from them with --model hf:{c.init_from_hf} --resume)"
            )
        check_hf_weights(c.init_from_hf, model)
    if c.dir:  # last: it creates the directory, which a run refused by the checks above must not leave behind
        check_writable_dir("--checkpoint-dir", c.dir)


def check_measuring_flags(r: RuntimeSection, resume: str | None) -> None:
    """What the run measures: --profile DIR is writable and --profile-steps A:B are steps this run takes (a
    resumed run starts after its checkpoint's step; `resume`: its path, None when not resuming), and
    --comm-stats names when it counts."""
    if r.profile_shapes and r.profile is None:
        raise ValueError("--profile-shapes applies to --profile DIR; add --profile DIR (or drop --profile-shapes)")
    done = 0
    if (r.profile is not None or r.profile_summary is not None) and resume is not None:
        done = int(checkpoint.read_manifest(resolve_checkpoint(resume)[0])["step"])
    check_profile(r.profile, r.profile_steps, r.steps, done)
    check_profile_summary(
        r.profile_summary, r.steps, done, profile_window(r.profile_steps, r.steps, done) if r.profile else None
    )
    if r.comm_stats not in (None, "every", "first"):
        raise ValueError(f"--comm-stats {r.comm_stats!r}: use every (each step) or first (the first step only)")
