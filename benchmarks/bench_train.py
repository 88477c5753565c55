"""Training benchmark: the same model and global batch on several layouts, side by side in one run.

Each layout trains `--steps` steps through tessera's own training job (local ranks); the figures are the
median tokens/s over the steps after `--warmup`, the peak memory, and the final loss (which must agree
across layouts: the numerics contract). Writes JSON under benchmarks/results/.

    python benchmarks/bench_train.py --model small --seq-len 128 --global-batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.config import Config  # noqa: E402
from tessera.training.run import train  # noqa: E402

LAYOUTS = {
    "one": {},
    "tp2": dict(tp=2),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "dp2": dict(dp=2),
    "dp2-shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "dp2-ac_full": dict(dp=2, ac="full"),
    "dp4": dict(dp=4),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "dp2xtp2": dict(dp=2, tp=2),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--device", default="auto", help="cpu or cuda (auto: CUDA when there is a GPU for every rank)")
    p.add_argument("--kernels", default="auto", help="comma-separated: auto, torch, triton; each layout runs with each")
    p.add_argument("--out", default=None, help="a .json file or a directory")
    args = p.parse_args(argv)
    rows = []
    for name, kernels in [(n, k) for n in args.layouts.split(",") for k in args.kernels.split(",")]:
        config = Config.create(
            model=args.model,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            steps=args.steps,
            quiet=True,
            device=args.device,
            kernels=kernels,
            **LAYOUTS[name],
        )
        config.check()
        history = train(config)
        timed = history[args.warmup :] or history
        row = dict(
            layout=name,
            kernels=kernels,
            device=config.device_type(),
            mixed_precision=config.mixed_precision,
            ranks=config.layout.world_size,
            layout_degrees=config.layout.as_dict(),
            tokens_per_s=statistics.median(m["tokens_per_s"] for m in timed),
            step_time_s=statistics.median(m["step_time_s"] for m in timed),
            peak_memory_bytes_rank0=max(m["peak_memory_bytes"] for m in history),
            final_loss=history[-1]["loss"],
        )
        rows.append(row)
        print(
            f"{name:<18} {kernels:<7} {row['ranks']:>2} ranks  {row['tokens_per_s']:>9,.0f} tok/s  "
            f"step {row['step_time_s'] * 1e3:7.1f} ms  "
            f"loss {row['final_loss']:.6f}",
            flush=True,
        )
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["throughput_vs_first"] = r["tokens_per_s"] / base
    losses = [r["final_loss"] for r in rows]
    summary = {"max_relative_loss_spread": (max(losses) - min(losses)) / abs(min(losses))}
    path = write_results(
        f"train-{args.model}-{rows[0]['device']}", vars(args), {"layouts": rows, "summary": summary}, args.out
    )
    print(f"max relative spread of the final loss across layouts: {summary['max_relative_loss_spread']:.2e}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
