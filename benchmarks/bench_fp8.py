"""FP8 against bf16: does --fp8 train like bf16? The loss curves of one process on the shipped text, bf16 and
FP8 with each recipe (tensorwise, rowwise) over bf16, in one plot, and the largest gap between each FP8 curve
and bf16's.

On CPU torchao emulates FP8 (the operands are rounded to float8 with their scales, then multiplied in fp32):
the numerics are FP8's, the speed is not; tokens/s on a GPU is benchmarks/gpu_suite.py's FP8 part.

    python benchmarks/bench_fp8.py                                   # small preset, 300 steps
    python benchmarks/bench_fp8.py --model debug --steps 5 --out /tmp   # seconds
    python benchmarks/bench_fp8.py --device cuda                     # on a GPU: FP8 matmuls in torch._scaled_mm

Writes benchmarks/results/fp8-convergence-<model>-<device>.json and .png (cpu, or the GPU's short name). The gap
is reported raw (per step) and on the curves smoothed over --window steps (a moving mean),
as single steps' losses are noisy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, plot_loss_curves, write_results  # noqa: E402

from tessera.config import Config  # noqa: E402

RUNS = {"bf16": None, "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}


def smooth(values: list[float], window: int) -> list[float]:
    """The moving mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def gaps(curves: dict[str, list[float]], window: int) -> dict[str, dict[str, float]]:
    """Each FP8 curve's largest |loss - bf16 loss|, per step and smoothed, with the step where it is largest."""
    base, base_s = curves["bf16"], smooth(curves["bf16"], window)
    out = {}
    for name, losses in curves.items():
        if name == "bf16":
            continue
        raw = [abs(a - b) for a, b in zip(losses, base)]
        smoothed = [abs(a - b) for a, b in zip(smooth(losses, window), base_s)]
        out[name] = {
            "max_abs_gap": max(raw),
            "max_abs_gap_step": raw.index(max(raw)) + 1,
            "max_abs_gap_smoothed": max(smoothed),
            "max_abs_gap_smoothed_step": smoothed.index(max(smoothed)) + 1,
            "final_loss": losses[-1],
            "final_loss_bf16": base[-1],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=20, help="steps of the moving mean the smoothed gap reads")
    parser.add_argument("--out", default=None, help="a directory (default benchmarks/results/) or a .json path")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: real FP8 on one GPU")
    args = parser.parse_args(argv)
    import torch  # lazy: after the arguments (torch's import is slow)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible here; run on a GPU machine or use --device cpu")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    from tessera.training.run import train  # lazy: after the arguments (torch's import is slow)

    curves: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    dtypes: dict[str, str | None] = {}
    for name, recipe in RUNS.items():
        config = Config.create(
            model=args.model,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            steps=args.steps,
            mixed_precision="bf16",
            fp8=recipe,
            quiet=True,
            device=args.device,
        )
        started = time.perf_counter()
        history = train(config) or []
        seconds[name] = time.perf_counter() - started
        curves[name] = [m["loss"] for m in history]
        dtype = history[0].get("compute_dtype") if history else None
        dtypes[name] = dtype  # measured by the records' probe, not the recipe asked for
        print(
            f"{name}: loss {curves[name][0]:.3f} -> {curves[name][-1]:.3f} in {args.steps} steps "
            f"({seconds[name]:.0f} s; matmuls in {dtype})",
            flush=True,
        )
    found = gaps(curves, args.window)
    for name, g in found.items():
        print(
            f"{name} vs bf16: largest gap {g['max_abs_gap']:.4f} (step {g['max_abs_gap_step']}), "
            f"{g['max_abs_gap_smoothed']:.4f} smoothed over {args.window} steps (step {g['max_abs_gap_smoothed_step']})"
        )
    name = f"fp8-convergence-{args.model}-{device_slug(gpu) if gpu else 'cpu'}"
    how = f"torchao float8 on {gpu}" if gpu else "torchao float8, emulated on CPU"
    path = write_results(
        name,
        {**vars(args), "mixed_precision": "bf16", "fp8": how},
        {"losses": curves, "gaps": found, "seconds": seconds, "compute_dtypes": dtypes},
        args.out,
    )
    print(f"wrote {path}")
    plot(curves, found, args, path.with_suffix(".png"), gpu)
    return 0


def plot(curves: dict[str, list[float]], found: dict, args: argparse.Namespace, png: Path, gpu: str | None) -> None:
    """The three loss curves in one figure, titled with the largest gap to bf16."""
    worst = max(found.values(), key=lambda g: g["max_abs_gap"]) if found else None
    gap = f"; largest gap to bf16 {worst['max_abs_gap']:.3f}" if worst else ""
    how = f"FP8 on {device_slug(gpu).upper()}" if gpu else "FP8 (emulated)"
    plot_loss_curves(curves, f"{args.model}: {how} vs bf16{gap}", png)


if __name__ == "__main__":
    sys.exit(main())
