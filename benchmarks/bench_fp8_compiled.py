"""FP8 against bf16 tokens/s, both compiled, side by side in one call: issue 35's goal (1.2x at the largest preset
that fits one GPU) without the rest of the GPU suite.

The GPU suite's rows (benchmarks/gpu_suite_parts.py's train_row: the 1b preset, seq 2048, 7 steps of which 3-6
are timed and 7 profiled, one process) at one batch: `--compile` in bf16, then `--compile --fp8 tensorwise`,
`--rounds` times alternating; the ratio is bf16's median step time over FP8's, each row's profile kept.

    python benchmarks/bench_fp8_compiled.py                          # one GPU, batch 16, one round
    python benchmarks/bench_fp8_compiled.py --smoke --out /tmp/x.json # the plumbing on CPU (debug model)
    python benchmarks/bench_fp8_compiled.py --kernels auto,triton     # also with every kernel in Triton
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import device_slug, write_results  # noqa: E402
from gpu_suite import FULL, SMOKE  # noqa: E402
from gpu_suite_parts import train_row  # noqa: E402

from tessera.metrics.results import BF16_PEAK  # noqa: E402


PRECISIONS = ("bf16", "fp8")


def row_name(precision: str, kernels: str) -> str:
    """ "bf16" and "fp8" for the default kernels' rows, "bf16 kernels triton" for another setting's."""
    return precision + ("" if kernels == "auto" else f" kernels {kernels}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="sequences a step (the suite's fit on an H200: 16)")
    p.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    p.add_argument("--rounds", type=int, default=1, help="bf16 then FP8, this many times")
    p.add_argument(
        "--kernels",
        default="auto",
        help="comma-separated --kernels settings, each a bf16 and an FP8 row (auto,triton: cuDNN against Triton "
        "attention)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a row may take")
    p.add_argument("--smoke", action="store_true", help="the debug model on CPU (checks the plumbing)")
    p.add_argument("--out", default=None, help="a .json file or a directory")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --smoke runs the plumbing on CPU")
    sizes = SMOKE if args.smoke else FULL
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    peak = None if args.smoke else next((v for k, v in BF16_PEAK.items() if k in device), None)
    batch = sizes["smoke_batch"] if args.smoke else args.batch
    settings = args.kernels.split(",")
    bad = [k for k in settings if k not in ("auto", "triton", "torch")]
    if bad or len(set(settings)) != len(settings):
        why = f"{', '.join(bad)} unknown" if bad else "a setting named twice"
        raise SystemExit(f"--kernels {args.kernels}: {why}; name each of auto, triton or torch at most once")
    # (row name, --fp8, --kernels)
    names = [(row_name(p, k), None if p == "bf16" else args.recipe, k) for k in settings for p in PRECISIONS]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in names}
    for _ in range(args.rounds):
        for name, fp8, kernels in names:
            row = train_row(sizes, batch, True, args.smoke, peak, args.timeout, fp8, kernels)
            rows[name].append(row)
            step_ms = row["step_time_s"] * 1e3
            print(
                f"{name}: {row['tokens_per_s']:,.0f} tok/s, step {step_ms:.1f} ms, {row['compute_dtype']}", flush=True
            )
    steps = {name: statistics.median(r["step_time_s"] for r in rs) for name, rs in rows.items()}
    fp8_over_bf16 = {}
    for k in settings:
        fp8_over_bf16[k] = steps[row_name("bf16", k)] / steps[row_name("fp8", k)]
        print(f"kernels {k}: fp8 {args.recipe} compiled / bf16 compiled: {fp8_over_bf16[k]:.3f}x ({device})")
    results = {
        "device": device,
        "rows": rows,
        "median_step_s": steps,
        # the default kernels' ratio where they ran (the key earlier results have), else the first setting's
        "fp8_over_bf16_compiled": fp8_over_bf16.get("auto", fp8_over_bf16[settings[0]]),
        "fp8_over_bf16_compiled_by_kernels": fp8_over_bf16,
        "compute_dtypes": {name: [r["compute_dtype"] for r in rs] for name, rs in rows.items()},
    }
    if "auto" in settings and "triton" in settings:  # the default (cuDNN attention) against Triton attention
        results["auto_over_triton_step"] = {p: steps[row_name(p, "triton")] / steps[p] for p in PRECISIONS}
        print(f"step time, Triton attention / auto: {results['auto_over_triton_step']}")
    config = {"sizes": {k: v for k, v in sizes.items() if not isinstance(v, dict)}, "batch": batch, **vars(args)}
    write_results(f"fp8-compiled-{device_slug(device)}", config, results, args.out)
    return results


if __name__ == "__main__":
    main()
