"""`tessera train`: the training job on any layout.

Outside torchrun it spawns pp*dp*cp*tp local ranks (gloo on CPU) with parallel.launch; under torchrun
it joins the job (NCCL on GPU). Every rank builds the one-process model from the seed, `parallelize`
cuts out its part, and the loop is the same on every layout: read this dp rank's slice of the global
batch, forward to a loss, backward, clip by the global grad norm across every axis, AdamW step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from models import build_model, get_preset
from models.data import TokenStream
from topology import Layout, submesh

from .clip import clip_grad_norm_
from .data import DataParallelConfig, layout_for_strategy
from .parallelize import ParallelConfig, parallelize


@dataclass
class TrainConfig:
    model: str = "debug"
    pp: int = 1
    dp: int = 1
    dp_replicate: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    seq_len: int = 64
    global_batch: int = 8
    steps: int = 50
    seed: int = 0
    lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    fsdp: str = "FULL_SHARD"
    ac: str = "none"
    mixed_precision: str | None = None  # default: bf16 on GPU, fp32 on CPU
    prefetch: int = 0
    metrics: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str | None = None  # a checkpoint (or a directory with `latest`); "" means --checkpoint-dir
    init_from: str | None = None  # a full safetensors state dict to start from
    timeout: float = 600.0  # seconds any collective may stall before the run fails
    quiet: bool = False

    @property
    def layout(self) -> Layout:
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"--dp-replicate {self.dp_replicate} must divide --dp {self.dp} (dp = dp_replicate x dp_shard); "
                f"use --dp {self.dp_replicate * max(1, self.dp // self.dp_replicate)}"
            )
        layout = Layout(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp // self.dp_replicate, cp=self.cp, tp=self.tp)
        return layout_for_strategy(layout, self.fsdp.upper())

    @property
    def parallel(self) -> ParallelConfig:
        precision = self.mixed_precision or ("bf16" if under_torchrun() and torch.cuda.is_available() else "fp32")
        data = DataParallelConfig(self.fsdp.upper(), precision, self.ac, self.prefetch)
        return ParallelConfig(layout=self.layout, sequence_parallel=self.sequence_parallel, data=data)

    def check(self) -> None:
        """All input errors, raised before any rank starts."""
        cfg = get_preset(self.model)
        for name in ("seq_len", "global_batch", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be positive")
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the {self.model} preset's max_seq_len={cfg.max_seq_len}")
        self.parallel.check(cfg, self.seq_len, self.global_batch)
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} must be >= 0 (0: never)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
        if self.resume is not None:
            from . import checkpoint

            path = checkpoint.resolve(self.resume_path)
            checkpoint.check_compatible(path, checkpoint.read_manifest(path), self.model, cfg.as_dict(), self.seq_len)
        if self.init_from is not None and not os.path.isfile(self.init_from):
            raise ValueError(f"--init-from {self.init_from}: no such file")

    @property
    def resume_path(self) -> str:
        path = self.resume or self.checkpoint_dir
        if not path:
            raise ValueError("--resume needs a checkpoint path, or --checkpoint-dir DIR to resume from its latest")
        return path


def lr_lambda(warmup: int, steps: int):
    """Linear warm-up, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on CPU


class Job:
    """The per-rank state of a run: mesh, model, optimizer, scheduler, data stream."""

    def __init__(self, config: TrainConfig, device: torch.device):
        self.config, self.device = config, device
        self.layout = config.layout
        self.mesh = self.layout.build_mesh(device.type)
        self.rank = dist.get_rank()
        self.dp_rank = self.layout.index("dp", self.rank)
        model = build_model(config.model, device=device, seed=config.seed)
        self.model = parallelize(model, self.mesh, config.parallel)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay, eps=1e-8
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config.warmup, config.steps))
        self.data = TokenStream(config.seq_len, config.global_batch)
        self.step = 0
        self.loss_group = submesh(self.mesh, "dp_cp").get_group()

    def train_step(self, on_grads: Callable[[nn.Module], None] | None = None) -> dict[str, Any]:
        """One optimizer step; `on_grads(model)` runs after backward, before clipping (tests read grads there)."""
        c = self.config
        start = time.perf_counter()
        inputs, targets = self.data.next_batch(self.dp_rank, self.layout.dp)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        loss = self.model.loss(inputs, targets)
        loss.backward()
        if on_grads is not None:
            on_grads(self.model)
        grad_norm = clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the reported loss is the mean over the global batch: average over the ranks reading different tokens
        reported = loss.detach().float().clone()
        dist.all_reduce(reported, group=self.loss_group)
        reported /= dist.get_world_size(self.loss_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        return {
            "step": self.step,
            "loss": reported.item(),
            "grad_norm": grad_norm.item(),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": c.global_batch * c.seq_len / elapsed,
            "step_time_s": elapsed,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "layout": self.layout.as_dict(),
        }


def run_job(config: TrainConfig) -> list[dict[str, Any]] | None:
    """The loop on this rank (process group already initialized); rank 0 returns the metrics."""
    device = _device()
    from . import checkpoint

    torch.manual_seed(config.seed)
    job = Job(config, device)
    if config.init_from:
        checkpoint.load_full_state_dict(job.model, config.init_from)
    if config.resume is not None:
        manifest = checkpoint.load(job, config.resume_path)
        if job.rank == 0 and not config.quiet:
            print(f"resumed from step {manifest['step']} ({manifest['consumed_tokens']:,} tokens) saved on "
                  f"{Layout(**manifest['layout'])}", flush=True)
    history = []
    out = open(config.metrics, "a") if (config.metrics and job.rank == 0) else None
    try:
        while job.step < config.steps:
            m = job.train_step()
            history.append(m)
            if config.checkpoint_every and job.step % config.checkpoint_every == 0:
                checkpoint.save(job, config.checkpoint_dir, keep=config.keep_checkpoints)
            if job.rank == 0:
                if out:
                    out.write(json.dumps(m) + "\n")
                    out.flush()
                if not config.quiet:
                    print(_progress(m, config), flush=True)
    finally:
        if out:
            out.close()
    return history if job.rank == 0 else None


def _progress(m: dict[str, Any], c: TrainConfig) -> str:
    return (
        f"step {m['step']:>4}/{c.steps} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f} | "
        f"lr {m['lr']:.2e} | {m['tokens_per_s']:,.0f} tok/s | peak {m['peak_memory_bytes'] / 2**20:,.0f} MiB | "
        f"{Layout(**m['layout'])}"
    )


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ)


def train(config: TrainConfig) -> list[dict[str, Any]] | None:
    """Validate, then run: join the torchrun job, or spawn the layout's ranks locally."""
    config.check()
    world = config.layout.world_size
    if under_torchrun():
        from datetime import timedelta

        config.layout.check_world_size(int(os.environ["WORLD_SIZE"]))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout))
        try:
            return run_job(config)
        finally:
            dist.destroy_process_group()
    from .launch import run_ranks

    return run_ranks(run_job, world, config, timeout=None, collective_timeout=config.timeout)[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="preset: debug, small, 1b, 8b, 70b, 405b")
    for axis, help_ in [
        ("pp", "pipeline stages (must be 1 until the pipeline axis lands)"),
        ("dp", "data-parallel degree (dp_replicate x dp_shard), sharded with FSDP2"),
        ("dp-replicate", "replicas of the FSDP shard group (HSDP)"),
        ("cp", "context-parallel degree (must be 1 until the context axis lands)"),
        ("tp", "tensor-parallel degree"),
    ]:
        p.add_argument(f"--{axis}", type=int, default=getattr(d, axis.replace("-", "_")), help=help_)
    p.add_argument("--sequence-parallel", action="store_true", help="shard norms and residual stream over tp")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--fsdp", default=d.fsdp, help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
    p.add_argument("--ac", default=d.ac, help="activation checkpointing: none, full or selective")
    p.add_argument("--mixed-precision", default=None, help="bf16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--prefetch", type=int, default=d.prefetch, help="explicit FSDP prefetch of N blocks (0: implicit)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (step_N/ and a latest pointer)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="keep the newest K")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="resume from a checkpoint (default: the latest in --checkpoint-dir), on any layout")
    p.add_argument("--init-from", default=None, metavar="FILE", help="start from a full safetensors state dict")
    p.add_argument("--metrics", default=None, metavar="FILE", help="append one JSON line per step")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds a collective may stall")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cli)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _cli(args: argparse.Namespace) -> int:
    from .launch import RankFailure

    try:
        config = config_from_args(args)
        config.check()
    except ValueError as e:
        print(f"tessera train: error: {e}", file=sys.stderr)
        return 2
    try:
        history = train(config)
    except RankFailure as e:
        if "CheckpointError: " not in str(e):
            raise
        print(f"tessera train: error: {str(e).rsplit('CheckpointError: ', 1)[1].strip()}", file=sys.stderr)
        return 2
    if history and not config.quiet:
        first, last = history[0], history[-1]
        print(f"done: loss {first['loss']:.4f} -> {last['loss']:.4f} over {last['step']} steps on {config.layout}")
    return 0

