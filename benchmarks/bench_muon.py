"""Muon against AdamW: the optimizer step's time and the bytes it moves, on one process, dp2 x tp2 and dp4
(CPU ranks over gloo), and how evenly the ranks share Newton-Schulz's FLOPs (max / mean).

The optimizer step is timed alone: each rank waits at a barrier after its backward and clipping, then times
its optimizer step(s) (Muon on the spec's matrices beside AdamW on the rest, or AdamW on everything); a
step's time is the slowest rank's. Bytes are what --comm-stats counts during step 1 under 'muon' (Muon's
gathers and scatters; AdamW's step moves none: its collectives are FSDP's and clipping's, outside the step),
beside topology/estimators/comm_model.py's prediction. The whole training step's median is kept for scale.

    python benchmarks/bench_muon.py                    # small preset: benchmarks/results/muon-small-cpu.json and .png
    python benchmarks/bench_muon.py --model debug --steps 2 --warmup 1 --out /tmp   # seconds

--convergence instead trains the model on the shipped text for --steps steps (200 by default there) with
each optimizer at its documented learning rates (--lr 3e-3 for AdamW, and for Muon's matrices --muon-lr
0.02 with AdamW's 3e-3 on the rest) on one process, and plots both loss curves in one figure: what the plot
shows, no claim beyond it. `muon-convergence-<model>-cpu.json` and `.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, plot_loss_curves, write_results  # noqa: E402

from tessera.config import Config  # noqa: E402
from tessera.launching.launch import run_ranks  # noqa: E402
from tessera.trainer import Trainer  # noqa: E402

LAYOUTS = {"one": dict(), "dp2xtp2": dict(dp=2, tp=2), "dp4": dict(dp=4)}
OPTIMIZERS = ("adamw", "muon")


def rank_run(kw: dict[str, Any], threads: int) -> dict[str, Any] | None:
    """One layout and optimizer on this rank: per-step optimizer and whole-step seconds (the slowest rank's),
    step 1's counted and predicted 'muon' bytes per rank, each rank's Newton-Schulz FLOPs; rank 0 returns them."""
    torch.set_num_threads(threads)
    warmup = kw.pop("warmup")
    trainer = Trainer(Config.create(**kw, comm_stats="first", quiet=True, device="cpu"), torch.device("cpu"))
    optimizer = trainer.optimizer
    inner = optimizer.step
    seconds: list[float] = []

    def timed_step(**kwargs) -> None:
        dist.barrier()  # every rank's backward and clipping are done: time the step alone
        started = time.perf_counter()
        inner(**kwargs)
        seconds.append(time.perf_counter() - started)

    optimizer.step = timed_step  # type: ignore[method-assign]
    records = [trainer.train_step() for _ in range(trainer.config.runtime.steps)]
    world = dist.get_world_size()
    slowest = torch.tensor(seconds, dtype=torch.float64)
    step_s = torch.tensor([r.record()["step_time_s"] for r in records], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    comm = records[0].comm or {}
    mine = [
        comm.get("bytes_by_axis", {}).get("muon", 0.0),
        comm.get("analytic_bytes_by_axis", {}).get("muon", 0.0),
        sum(o.owned_flops() for o in optimizer.muon()),
    ]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if trainer.rank != 0:
        return None
    flops = [float(f) for _, _, f in everyone]
    mean = sum(flops) / world
    return {
        "optimizer_step_s": statistics.median(slowest.tolist()[warmup:]),
        "optimizer_step_times_s": slowest.tolist()[warmup:],
        "train_step_s": statistics.median(step_s.tolist()[warmup:]),
        "muon_bytes_counted_per_rank": [b for b, _, _ in everyone],
        "muon_bytes_predicted_mean_per_rank": everyone[0][1],
        "ns_flops_per_rank": flops,
        "ns_flops_max_over_mean": max(flops) / mean if mean else None,
        "final_loss": records[-1].record()["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="timed steps after --warmup (8); --convergence: 200")
    p.add_argument("--convergence", action="store_true", help="loss curves of both optimizers instead")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (default 1)")
    p.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    if args.convergence:
        args.steps = args.steps or 200
        return convergence(args)
    args.steps = args.steps or 8
    rows = []
    for name in args.layouts.split(","):
        for optimizer in OPTIMIZERS:
            kw = dict(
                model=args.model,
                seq_len=args.seq_len,
                global_batch=args.global_batch,
                steps=args.warmup + args.steps,
                optimizer=optimizer,
                mixed_precision="fp32",
                **LAYOUTS[name],
            )
            world = Config.create(**kw, quiet=True).layout.world_size
            r = run_ranks(rank_run, world, dict(kw, warmup=args.warmup), args.threads, timeout=600)[0]
            r["muon_bytes_counted_mean_per_rank"] = sum(r["muon_bytes_counted_per_rank"]) / world
            rows.append({"layout": name, "ranks": world, "optimizer": optimizer, **r})
            balance = r["ns_flops_max_over_mean"]
            print(
                f"{name:>8} {optimizer:>5}: optimizer step {r['optimizer_step_s'] * 1e3:7.2f} ms, train step "
                f"{r['train_step_s'] * 1e3:7.1f} ms, muon bytes/rank {r['muon_bytes_counted_mean_per_rank']:,.0f}"
                + (f", NS FLOPs max/mean {balance:.3f}" if balance else ""),
                flush=True,
            )
    timing = (
        f"median over {args.steps} steps after {args.warmup} warm-up; a step's time is the slowest rank's; "
        f"{args.threads} thread(s) per rank on {torch.get_num_threads()} visible cores (ranks beyond the cores "
        "share them: compare optimizers within a layout)"
    )
    path = write_results(f"muon-{args.model}-cpu", vars(args), {"rows": rows, "timing": timing}, args.out)
    print(f"wrote {path}")
    if args.out is None:
        plot(rows, RESULTS / f"muon-{args.model}-cpu.png")
    return 0


def convergence(args: argparse.Namespace) -> int:
    """Both optimizers for args.steps steps on one process, their losses in one JSON and one plot."""
    from tessera.training.run import train  # lazy: the timing mode spawns its own ranks

    curves = {}
    for optimizer in OPTIMIZERS:
        config = Config.create(
            model=args.model,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            steps=args.steps,
            optimizer=optimizer,
            mixed_precision="fp32",
            quiet=True,
            device="cpu",
        )
        started = time.perf_counter()
        history = train(config) or []
        curves[optimizer] = [m["loss"] for m in history]
        print(
            f"{optimizer}: loss {curves[optimizer][0]:.3f} -> {curves[optimizer][-1]:.3f} in {args.steps} steps "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    o = config.optimizer
    rates = {"adamw_lr": o.lr, "muon_lr": o.muon_lr, "lr_warmup": o.warmup, "schedule": "linear warm-up, cosine"}
    name = f"muon-convergence-{args.model}-cpu"
    path = write_results(name, {**vars(args), **rates}, {"losses": curves}, args.out)
    print(f"wrote {path}")
    plot_loss_curves(curves, f"{args.model}: Muon (lr {o.muon_lr:g}) vs AdamW (lr {o.lr:g})", path.with_suffix(".png"))
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Optimizer-step time by layout, AdamW beside Muon (skipped without matplotlib)."""
    try:
        import matplotlib  # lazy: optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after choosing the backend
    except ImportError:
        return
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, optimizer in enumerate(OPTIMIZERS):
        ms = [
            next(r["optimizer_step_s"] for r in rows if r["layout"] == lay and r["optimizer"] == optimizer) * 1e3
            for lay in layouts
        ]
        ax.bar([x + 0.4 * i for x in range(len(layouts))], ms, width=0.4, label=optimizer)
    ax.set_xticks([x + 0.2 for x in range(len(layouts))], layouts)
    ax.set_ylabel("optimizer step (ms, slowest rank)")
    ax.set_title("Muon vs AdamW optimizer step, CPU ranks over gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
