"""The GPU suite in one command, sized for one device lease: at most 7 minutes on one H100, Python start-up,
model builds and compiles included (--budget-s, default 420), results written after every part.

    python benchmarks/gpu_suite.py --out $OUT/gpu           # on a GPU machine (give the command 540 s)
    python benchmarks/gpu_suite.py --smoke --out /tmp/suite # every part at tiny sizes on CPU: the plumbing

Parts, in the order of what they tell a user (--parts a,b,... runs a subset, in this order):
  triton    (15 s)   every Triton kernel compiled on this machine's triton and checked against a float64
                     definition (the FP8 cast against torch's own cast, bit for bit), before anything else (a
                     version break shows here, not mid-run)
  eager     (75 s)   the 1b preset at seq 2048, eager, at the largest batch that fits: the first try is the
                     largest power of two the planner's memory estimate fits on this GPU, halved on
                     out-of-memory (doubled while the measured peak leaves room); every attempt recorded.
                     Tokens/s, MFU, the dtype the matmuls ran in, and the profile of its last step: the top
                     25 kernels, the step's time by kind and the GPU's idle time, the allocator's peak by
                     what held it (runtime/metrics/step_profile.py)
  baseline  (50 s)   the plain-torch baseline (tessera.commands.baseline: FSDP2 on one rank, SDPA, fused AdamW), eager,
                     at that batch (halved on out-of-memory), on the attention backend tessera picks (cuDNN on
                     Hopper: the strongest), then on SDPA's default priority as a second named row
                     (`sdpa_default`); each row records the backend that ran; tessera / baseline step time
  compiled  (130 s)  the same row with --compile (60% of the part), then the baseline compiled per block at
                     that batch; compiled / baseline
  fp8       (95 s)   --fp8 tensorwise (torchao's float8; one rank, no data axis: no float8 all-gather to
                     make) at that batch, eager, then compiled while time is left: tokens/s over the bf16
                     eager and compiled rows above, and the dtype the records say the matmuls ran in (the
                     smoke runs the eager row only, emulated: a CPU compile takes minutes)
  kernels   (35 s)   tessera's attention fwd+bwd, bf16, head dim 128, causal, seq 4096 and 16384, against
                     SDPA's flash and cuDNN backends; RMSNorm's bandwidth as a share of HBM
  moe       (15 s)   one MoE block's experts: torch._grouped_mm against the per-expert loop
  planner   (30 s)   this GPU's rates at the 1b shapes (tessera plan --calibrate's measurement), then the
                     planner's step time and memory against every training row measured

The seconds are each part's cap; with the 30 s of start-up they sum to 420. A part that would not finish
within what is left of the budget is skipped and named in the JSON
("skipped"). After every part the JSON is rewritten whole (a temporary file renamed over the last one), so
a run killed at any moment leaves a valid file holding every part finished so far. The output folder stays
flat: gpu_suite_<device>.json and at most three PNGs (-train, -attention, -planner) beside it.
Without a GPU it stops at once with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ("triton", "eager", "baseline", "compiled", "fp8", "kernels", "moe", "planner")
FULL = dict(
    model="1b",
    seq_len=2048,
    steps=7,  # steps 1-2 warm up, 3-6 are timed, 7 is profiled
    warmup=2,
    max_batch=256,
    grow=True,
    calibrate_batch=4,
    kernels=dict(
        seq_lens=[4096, 16384],
        head_dims=[128],
        hidden=2048,
        tokens=16384,
        norm_shapes=[(16384, 4096), (32768, 8192)],
        warmup=10,
        reps=40,
        masks=(True,),
    ),
    moe=dict(n_experts=128, dim=2048, ffn=768, tokens=4096, top_k=8, warmup=3, reps=10),
    # with gpu_suite_parts.STARTUP_S (30 s) these sum to 420 s, the --budget-s default. Set from the first H200
    # run (triton 50 s, eager 39, baseline 25, compiled 67, fp8's eager row 30 s and its compiled row cut off
    # at 31 s, kernels 24, moe 8, planner 4): fp8 gets the time its compile needs. The third H200 run's eager
    # baseline ran out of its 30 s (nothing ran) while fp8 used 77 of 115: 20 s moved from fp8 to the baseline
    budgets=dict(triton=45, eager=55, baseline=50, compiled=85, fp8=95, kernels=30, moe=10, planner=20),
)
SMOKE = dict(
    model="debug",
    seq_len=32,
    steps=4,
    warmup=2,
    max_batch=8,
    grow=False,
    calibrate_batch=2,
    smoke_batch=2,  # no device memory to size against on CPU: the search starts here
    kernels=dict(
        seq_lens=[32], head_dims=[16], hidden=32, tokens=32, norm_shapes=[(8, 64)], warmup=1, reps=1, masks=(True,)
    ),
    moe=dict(n_experts=4, dim=16, ffn=16, tokens=16, top_k=2, warmup=1, reps=1),
    # CPU time, not a lease: compiled's row (60% of the part's time) is a cold inductor compile of ~25 CPU-s, 24 s
    # of wall alone here; beside a CI neighbour's multi-rank compile it ran past 54 s and the row was cut off.
    # 240 gives it 144 s; the smoke asserts every row, never a time
    budgets=dict(triton=60, eager=60, baseline=40, compiled=240, fp8=40, kernels=30, moe=20, planner=40),
)
USABLE_MEMORY = 0.9
# the least time a part needs to finish: with less left, it is skipped (named in the JSON), never begun
NEEDS = dict(triton=5, eager=45, baseline=20, compiled=60, fp8=25, kernels=15, moe=8, planner=20)


def run(args: argparse.Namespace) -> int:
    import torch  # lazy: main checks the arguments before torch's import (a refusal in 0.1 s, not 4)
    from common import device_slug
    from gpu_suite_parts import (
        Suite,
        first_error_line,
        part_baseline,
        part_compiled,
        part_eager,
        part_kernels,
        part_moe,
        part_planner,
        part_triton,
        planner_batch,
        ratio_to,
    )
    from gpu_suite_plots import plots

    from tessera.commands.bench import MFU_FORMULA
    from tessera.metrics.results import BF16_PEAK, device_info, finite_or_null, versions

    sizes = SMOKE if args.smoke else FULL
    parts = [p for p in PARTS if p in args.parts]
    info = device_info()
    peak = None if args.smoke else next((v for k, v in BF16_PEAK.items() if k in info["device"]), None)
    out = Path(args.out) if args.out else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_suite_smoke_cpu" if args.smoke else f"gpu_suite_{device_slug(info['device'])}"
    suite = Suite(args.budget_s, out / f"{name}.json", sizes, args.smoke)
    # what the planner may fill: the CUDA context and the allocator's rounding take the rest
    capacity = None if args.smoke else int(USABLE_MEMORY * torch.cuda.get_device_properties(0).total_memory)
    r = suite.results
    r.update(
        sizes={k: v for k, v in sizes.items() if k not in ("kernels", "moe")},
        kernel_sizes=sizes["kernels"],
        moe_sizes=sizes["moe"],
        part_budgets_s=sizes["budgets"],
        parts_asked=parts,
        mfu_peak_flops_per_device=peak,
        mfu_formula=MFU_FORMULA + ("the GPU's dense bf16 datasheet figure" if peak else "none on CPU"),
    )
    payload = {
        "benchmark": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": info,
        "versions": versions(),
        "config": {"smoke": args.smoke, "budget_s": args.budget_s, "parts": parts},
        "results": r,
    }
    suite.say(
        "suite",
        f"{'smoke (CPU, tiny sizes)' if args.smoke else info['device']}: {', '.join(parts)}; "
        f"budget {args.budget_s:.0f} s -> {suite.path}",
    )
    suite.save(finite_or_null(payload))
    batch = None
    for part in parts:
        left = suite.left()
        if left < NEEDS[part]:
            r["skipped"].append(
                {"part": part, "why": f"{left:.0f} s of the budget left; it needs about {NEEDS[part]} s"}
            )
            suite.say(part, f"skipped: {r['skipped'][-1]['why']}")
            suite.save(finite_or_null(payload))
            continue
        cap, began = min(sizes["budgets"][part], left), time.perf_counter()
        suite.say(part, f"up to {cap:.0f} s ...")
        try:
            if part == "triton":
                result = part_triton(suite, cap)
            elif part == "eager":
                result = part_eager(suite, cap, peak, capacity)
            elif part in ("baseline", "compiled"):
                eager_row = (r.get("eager") or {}).get("row")
                batch = batch or (eager_row["global_batch"] if eager_row else planner_batch(sizes, capacity)[0])
                if part == "baseline":
                    result = part_baseline(suite, cap, peak, False, batch)
                    result["tessera_over_baseline"] = ratio_to(eager_row, result["row"])
                    result["tessera_over_sdpa_default_baseline"] = ratio_to(eager_row, result["sdpa_default"])
                else:
                    result = part_compiled(suite, cap, peak, batch)
            elif part == "fp8":
                eager_row = (r.get("eager") or {}).get("row")
                batch = batch or (eager_row["global_batch"] if eager_row else planner_batch(sizes, capacity)[0])
                result = part_fp8(suite, cap, peak, batch, eager_row, (r.get("compiled") or {}).get("row"))
            elif part == "kernels":
                result = part_kernels(suite, cap)
            elif part == "moe":
                result = part_moe(suite, cap)
            else:
                result = part_planner(suite, cap)
        except Exception as e:  # noqa: BLE001 - recorded, the suite goes on to the next part
            result = {"error": f"{type(e).__name__}: {first_error_line(e)}"}
        result["seconds"] = time.perf_counter() - began
        r[part] = result
        r["parts_done"].append(part)
        r["seconds"] = suite.elapsed()
        for png in plots(r, suite.path.with_suffix(""), part):
            r.setdefault("plots", [])
            if png.name not in r["plots"]:
                r["plots"].append(png.name)
        suite.save(finite_or_null(payload))
        suite.say(part, summary_line(part, result))
    compile_workers = sys.modules.get("torch._inductor.async_compile")
    if compile_workers is not None:  # a pool the kernels' torch.compile started here: shut it down, not leaked
        compile_workers.shutdown_compile_workers()
    suite.say(
        "suite",
        f"done in {suite.elapsed():.0f} s: {', '.join(r['parts_done'])}"
        + (f"; skipped {', '.join(s['part'] for s in r['skipped'])}" if r["skipped"] else ""),
    )
    return 0


def part_fp8(suite, cap: float, peak: float | None, batch: int, eager: dict | None, compiled: dict | None) -> dict:
    """--fp8 tensorwise at the bf16 rows' batch: eager, then compiled (GPU only) while time is left; tokens/s
    over the bf16 row of the same mode and batch (None where the batches differ)."""
    from gpu_suite_parts import first_error_line, row_line, train_row

    began = time.perf_counter()
    out: dict = {"recipe": "tensorwise", "batch": batch}
    for mode, base in (("eager", eager), ("compiled", compiled)):
        left = cap - (time.perf_counter() - began)
        if mode == "compiled" and (suite.smoke or left < 20):
            out["compiled_skipped"] = "smoke: a CPU compile takes minutes" if suite.smoke else f"{left:.0f} s left"
            break
        suite.say("fp8", f"{suite.sizes['model']} seq {suite.sizes['seq_len']} batch {batch}, {mode} ...")
        try:
            row = train_row(suite.sizes, batch, mode == "compiled", suite.smoke, peak, left, fp8="tensorwise")
        except Exception as e:  # noqa: BLE001 - recorded (an out-of-memory, a timeout); the part goes on
            out[f"{mode}_error"] = f"{type(e).__name__}: {first_error_line(e)}"
            continue
        suite.say("fp8", row_line(row))
        out[mode] = row
        same = base is not None and base["global_batch"] == row["global_batch"]
        out[f"fp8_over_bf16_{mode}"] = row["tokens_per_s"] / base["tokens_per_s"] if same else None
    return out


def summary_line(part: str, result: dict) -> str:
    if "error" in result:
        return f"error: {result['error'][:300]} ({result['seconds']:.0f} s)"
    if part == "triton":
        return (
            f"triton {result['triton']}: "
            + (
                "every kernel compiled and checked"
                if result["all_ok"]
                else "FAILED: "
                + "; ".join(
                    f"{c['kernel']} {c.get('error', (c.get('forward_rel_error'), c.get('backward_rel_error')))}"
                    for c in result["checks"]
                    if not c["ok"]
                )
            )
            + f" ({result['seconds']:.0f} s)"
        )
    if part in ("eager", "compiled", "baseline"):
        row = result.get("row")
        tried = ", ".join(f"{a['batch']} {a['outcome']}" for a in result["attempts"])
        ratio = result.get("tessera_over_baseline")
        text = f"tried {tried}" + (
            f"; {row['tokens_per_s']:,.0f} tok/s at batch {row['global_batch']}" if row else "; nothing ran"
        )
        return (
            text
            + (f"; tessera / baseline step time {ratio:.3f}" if ratio is not None else "")
            + (
                f" (against SDPA's default backend {other:.3f})"
                if (other := result.get("tessera_over_sdpa_default_baseline")) is not None
                else ""
            )
            + f" ({result['seconds']:.0f} s)"
        )
    if part == "fp8":
        ratios = ", ".join(
            f"{mode} {result[f'fp8_over_bf16_{mode}']:.3f}x bf16"
            for mode in ("eager", "compiled")
            if result.get(f"fp8_over_bf16_{mode}") is not None
        )
        dtypes = ", ".join(result[m]["compute_dtype"] or "?" for m in ("eager", "compiled") if result.get(m))
        return f"fp8 tensorwise: {ratios or 'no ratio'}; matmuls in {dtypes or '-'} ({result['seconds']:.0f} s)"
    if part == "kernels":
        return (
            f"{len(result['attention'])} attention rows, {len(result['rms_norm'])} RMSNorm rows; "
            f"ratios {json.dumps(result['ratios'])} ({result['seconds']:.0f} s)"
        )
    if part == "planner" and result["of"]:
        return (
            f"measured / predicted step time: median {result['median_step_ratio']:.3f}, worst error "
            f"{result['worst_step_error']:.1%}, {result['within_10_percent']} of {result['of']} within 10% "
            f"({result['seconds']:.0f} s)"
        )
    return f"done ({result['seconds']:.0f} s)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every part at tiny sizes on CPU (checks the plumbing)")
    p.add_argument("--out", default=None, help="directory for the JSON and PNGs (default benchmarks/results/)")
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds for the whole run, start-up included (default 420)"
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)} (run in that order)")
    args = p.parse_args(argv)
    asked = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in asked if x not in PARTS]
    if unknown or not asked:
        print(
            f"gpu_suite: --parts {args.parts!r}: unknown part(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(PARTS)}",
            file=sys.stderr,
        )
        return 2
    args.parts = asked
    if args.budget_s <= 0:
        print(
            f"gpu_suite: --budget-s {args.budget_s:g} must be a positive number of seconds, e.g. 420", file=sys.stderr
        )
        return 2
    import torch  # lazy: the arguments are checked first, without torch's import (2.4 s) before their one line

    if not args.smoke and not torch.cuda.is_available():
        print(
            f"gpu_suite: needs a CUDA GPU: torch {torch.__version__} sees none on this machine; run it on the GPU "
            f"machine, or pass --smoke to check its plumbing on CPU",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU, before tessera.kernels loads them
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
