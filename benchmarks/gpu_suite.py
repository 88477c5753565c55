"""The whole GPU suite, one command: about 20 minutes on one H100 (every part has a time budget and says
where it is as it goes). Writes benchmarks/results/gpu_suite_<device>.json and three PNGs beside it
(gpu_suite_h100.json, gpu_suite_h100-attention.png, -train.png, -planner.png on an H100).

    python benchmarks/gpu_suite.py                # on a GPU machine
    python benchmarks/gpu_suite.py --smoke        # every part at tiny sizes on CPU: the plumbing (< 1 min)

Parts, in the order they run (budget on one H100):
  calibrate (1 min)    this GPU's rates at the 1b preset's shapes (tessera plan --calibrate's measurement):
                       the planner's step-time model uses them for every training row
  kernels   (4 min)    tessera's Triton attention forward and forward + backward, bf16, head dim 128, causal,
                       sequence 4096 / 8192 / 16384 (16,384 tokens a call), against SDPA's flash and cuDNN
                       backends, TFLOP/s and the ratios; RMSNorm GB/s as a share of the HBM peak, against
                       torch.compile and eager torch (benchmarks/bench_kernels.py's functions)
  moe       (1 min)    one MoE block's experts, forward and forward + backward, bf16, at Qwen3-30B-A3B's
                       shapes (128 experts, dim 2048, ffn 768, top-8 routing of 4096 tokens): torch._grouped_mm
                       against the per-expert loop (models/moe.py's two paths), TFLOP/s and grouped / loop
                       (benchmarks/bench_moe.py's grouped_vs_loop)
  eager     (5 min)    the 1b preset at seq 2048 through tessera's training job (one GPU, bf16), batch 1, 2,
  compiled  (10 min)   4, ... until the first out-of-memory (recorded, the sweep stops), eager then --compile:
                       tokens/s, per device, MFU (attention FLOPs included), the allocator's peak, the dtype
                       the matmuls ran in (from the step records), the planner's step time and memory beside
                       each with measured / predicted
  baseline  (3 min)    the plain-torch baseline (tessera.baseline: same weights and data, FSDP2 on one rank
                       with bf16 parameters and fp32 reduction, SDPA, torch.compile per block, fused AdamW)
                       at the largest batch eager tessera fit (halved until it fits), and tessera / baseline
                       step time for the eager and compiled rows at that batch
  planner   (-)        predicted vs measured for every training row, summarized (median and worst ratio)

Without a GPU it stops at once with one line. A part that runs past its budget stops its sweep and says
so in the JSON; an unexpected error in a training run is recorded and ends that sweep only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent

FULL = dict(
    model="1b",
    seq_len=2048,
    batches=[1, 2, 4, 8, 16, 32, 64],
    steps=5,
    warmup=2,
    calibrate_batch=4,
    kernels=dict(
        seq_lens=[4096, 8192, 16384],
        head_dims=[128],
        hidden=2048,
        tokens=16384,
        norm_shapes=[(16384, 4096), (32768, 8192)],
        warmup=25,
        reps=100,
        masks=(True,),
    ),
    moe=dict(n_experts=128, dim=2048, ffn=768, tokens=4096, top_k=8, warmup=5, reps=20),
    budgets=dict(calibrate=60, kernels=240, moe=60, eager=300, compiled=600, baseline=180),
)
SMOKE = dict(
    model="debug",
    seq_len=32,
    batches=[1, 2],
    steps=3,
    warmup=2,
    calibrate_batch=2,
    kernels=dict(
        seq_lens=[32], head_dims=[16], hidden=32, tokens=32, norm_shapes=[(8, 64)], warmup=1, reps=1, masks=(True,)
    ),
    moe=dict(n_experts=4, dim=16, ffn=16, tokens=16, top_k=2, warmup=1, reps=1),
    budgets=dict(calibrate=20, kernels=30, moe=10, eager=40, compiled=60, baseline=30),
)


class Clock:
    """Elapsed time since the suite started, and a progress line per event."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.started

    def say(self, part: str, text: str) -> None:
        m, s = divmod(int(self.now()), 60)
        print(f"[{m:02d}:{s:02d}] {part}: {text}", flush=True)


def is_oom(error: BaseException) -> bool:
    text = str(error)
    return "OutOfMemoryError" in text or "out of memory" in text.lower()


def sweep(
    run_one: Callable[[int], dict], batches: list[int], budget_s: float, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[dict], dict | None]:
    """Run `run_one(batch)` for each batch in order until one runs out of memory (recorded, the sweep stops),
    raises anything else (recorded, stops), or the next would likely end past the budget (a run takes about
    1.6x the last one as the batch doubles). Returns (rows, why it stopped or None)."""
    start = clock()
    last = 0.0
    rows: list[dict] = []
    for batch in batches:
        spent = clock() - start
        if rows and spent + 1.6 * last > budget_s:
            return rows, {
                "batch": batch,
                "reason": "budget",
                "detail": f"{spent:.0f} s of {budget_s:.0f} s spent; the next run would take about {1.6 * last:.0f} s",
            }
        began = clock()
        try:
            rows.append(run_one(batch))
        except Exception as e:  # noqa: BLE001 - recorded in the results, the suite goes on
            first = next(
                (ln for ln in str(e).splitlines() if "Error" in ln),
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            return rows, {"batch": batch, "reason": "out of memory" if is_oom(e) else "error", "detail": first[:400]}
        last = clock() - began
    return rows, None


def device_slug(name: str) -> str:
    for key in ("H200", "H100", "A100", "B200", "L40S"):
        if key in name:
            return key.lower()
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:40]


def train_config(sizes: dict, batch: int, compile: bool, smoke: bool):
    from tessera.config import Config

    config = Config.create(
        model=sizes["model"],
        seq_len=sizes["seq_len"],
        global_batch=batch,
        steps=sizes["steps"],
        quiet=True,
        device="cpu" if smoke else "cuda",
        compile=compile,
        track_memory=smoke,
    )  # on a GPU the allocator's peak is the measure
    config.check()
    return config


def train_row(
    sizes: dict, batch: int, compile: bool, smoke: bool, peak: float | None, calibration: dict | None
) -> dict:
    from tessera.bench import _row
    from tessera.run import train

    config = train_config(sizes, batch, compile, smoke)
    started = time.perf_counter()
    history = train(config)
    row = _row(
        f"{'compiled' if compile else 'eager'} b{batch}", config, history, sizes["warmup"], peak, not smoke, calibration
    )
    row["run_seconds"] = time.perf_counter() - started
    return row


def planner_check(rows: list[dict]) -> dict:
    """Predicted against measured for every training row: the ratios (measured / predicted), as the rows
    hold them, recomputed here from the figures beside them."""
    out = []
    for r in rows:
        step, predicted = r["step_time_s"], r["predicted"]["step_time_s"]
        mem = r["measured_over_predicted"]["memory"]
        out.append(
            {
                "row": r["layout"],
                "measured_step_s": step,
                "predicted_step_s": predicted,
                "step_ratio": step / predicted,
                "predicted_parts_s": r["predicted"]["compute_parts_s"],
                "memory_ratio": mem,
                "predicted_memory_bytes": r["predicted"]["memory_bytes"]["total"],
            }
        )
    ratios = [x["step_ratio"] for x in out]
    return {
        "rows": out,
        "median_step_ratio": statistics.median(ratios) if ratios else None,
        "worst_step_error": max((abs(x - 1) for x in ratios), default=None),
        "within_10_percent": sum(abs(x - 1) <= 0.10 for x in ratios),
        "of": len(ratios),
    }


def plots(results: dict, stem: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: JSON only, no plots", file=sys.stderr)
        return []
    paths = []
    attention = results["kernels"].get("attention", [])
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in attention}):
        pts = sorted((r["seq_len"], r["fwd_bwd_tflops"]) for r in attention if r["impl"] == impl and "error" not in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set(
        xscale="log",
        xlabel="sequence",
        ylabel="TFLOP/s (fwd+bwd, causal)",
        title="attention, head dim " + ",".join(str(d) for d in sorted({r["head_dim"] for r in attention})),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-attention.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("eager", "compiled"):
        pts = [(r["global_batch"], r["tokens_per_s"]) for r in results["train"][mode]["rows"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"tessera {mode}")
        stop = results["train"][mode]["stopped"]
        if stop and stop["reason"] == "out of memory" and pts:
            ax.annotate("OOM", (stop["batch"], pts[-1][1]), fontsize=8, color="red")
    base = results.get("baseline", {}).get("row")
    if base:
        ax.scatter(
            [base["global_batch"]],
            [base["tokens_per_s"]],
            marker="s",
            color="black",
            label="plain torch baseline",
            zorder=3,
        )
    batches = sorted({r["global_batch"] for mode in ("eager", "compiled") for r in results["train"][mode]["rows"]})
    ax.set_xscale("log", base=2)
    if batches:
        ax.set_xticks(batches, [str(b) for b in batches])
    ax.set(
        xlabel="global batch (sequences)",
        ylabel="tokens/s",
        title=f"{results['sizes']['model']} at seq {results['sizes']['seq_len']}: eager, compiled, baseline",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-train.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    check = results["planner"]["rows"]
    if check:
        xs = [c["predicted_step_s"] for c in check]
        ys = [c["measured_step_s"] for c in check]
        a1.scatter(xs, ys)
        for c in check:
            a1.annotate(c["row"], (c["predicted_step_s"], c["measured_step_s"]), fontsize=7)
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
        a1.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        a2.bar(range(len(check)), [c["memory_ratio"] or 0 for c in check])
        a2.set_xticks(range(len(check)), [c["row"] for c in check], rotation=30, ha="right", fontsize=7)
    a1.set(xlabel="predicted step (s)", ylabel="measured step (s)", title="planner: step time")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set(ylabel="measured / predicted", title="planner: peak memory")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-planner.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def run(args: argparse.Namespace) -> int:
    sizes = SMOKE if args.smoke else FULL
    clock = Clock()
    budgets = dict(sizes["budgets"])
    on_gpu = not args.smoke
    sys.path.insert(0, str(HERE))
    import bench_kernels
    from common import write_results

    from tessera.bench import MFU_FORMULA, _baseline_row, _one_rank, baseline_rank, calibrate_rank
    from tessera.calibrate import describe
    from tessera.results import BF16_PEAK, device_info

    info = device_info()
    peak = next((v for k, v in BF16_PEAK.items() if k in info["device"]), None) if on_gpu else None
    results: dict[str, Any] = {
        "sizes": {k: v for k, v in sizes.items() if k != "kernels"},
        "kernel_sizes": sizes["kernels"],
        "budgets_s": budgets,
        "mfu_peak_flops_per_device": peak,
        "mfu_formula": MFU_FORMULA + ("the GPU's dense bf16 datasheet figure" if on_gpu else "none on CPU"),
    }
    clock.say(
        "suite",
        f"{'smoke (CPU, tiny sizes)' if args.smoke else info['device']}: calibrate, kernels, moe, eager and "
        f"compiled {sizes['model']} sweeps, baseline, planner check; budget {sum(budgets.values()) / 60:.0f} min",
    )

    # 1. calibration: the planner's rates for this device at the model's shapes
    clock.say("calibrate", f"{sizes['model']} shapes, batch {sizes['calibrate_batch']} x {sizes['seq_len']} ...")
    t0 = clock.now()
    calibration = _one_rank(
        calibrate_rank, train_config(sizes, sizes["calibrate_batch"], False, args.smoke), args.smoke
    )
    results["calibration"] = calibration
    clock.say("calibrate", f"{describe(calibration)} ({clock.now() - t0:.0f} s)")

    # 2. kernels
    clock.say("kernels", "attention " + ", ".join(map(str, sizes["kernels"]["seq_lens"])) + " and RMSNorm ...")
    t0 = clock.now()
    kargs = argparse.Namespace(**sizes["kernels"])
    kdevice, kdtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    attention = bench_kernels.bench_attention(kargs, kdevice, kdtype)
    norms = bench_kernels.bench_rms_norm(kargs, kdevice, kdtype)
    results["kernels"] = {
        "attention": attention,
        "rms_norm": norms,
        "ratios": bench_kernels.ratios(attention, norms),
        "seconds": clock.now() - t0,
    }
    if on_gpu:  # the training runs below are other processes: hand this one's cached blocks back
        torch.cuda.empty_cache()
    clock.say("kernels", f"done ({clock.now() - t0:.0f} s)")

    # 2b. MoE experts: torch._grouped_mm against the per-expert loop, forward and forward + backward
    m = sizes["moe"]
    clock.say(
        "moe",
        f"{m['n_experts']} experts, dim {m['dim']}, ffn {m['ffn']}, top-{m['top_k']} of {m['tokens']} tokens, "
        f"{str(kdtype).replace('torch.', '')}: grouped GEMM vs the per-expert loop ...",
    )
    t0 = clock.now()
    import bench_moe

    try:
        moe = bench_moe.grouped_vs_loop(**m, device=kdevice, dtype=kdtype)
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        moe = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"}
    moe["seconds"] = clock.now() - t0
    results["moe"] = moe
    if on_gpu:
        torch.cuda.empty_cache()
    moe_rows = moe.get("rows", {})
    clock.say(
        "moe",
        moe["error"]
        if "error" in moe
        else "; ".join(
            f"{impl}: {r['error'][:160]}"
            if "error" in r
            else f"{impl} {r['forward_backward_s'] * 1e3:.2f} ms fwd+bwd ({r['forward_backward_tflops']:.3g} TFLOP/s)"
            + (f", {r['forward_backward_vs_loop']:.2f}x the loop" if "forward_backward_vs_loop" in r else "")
            for impl, r in moe_rows.items()
        )
        + f" ({moe['seconds']:.0f} s)",
    )

    # 3. training sweeps, eager then compiled
    results["train"] = {}
    for mode, compile in (("eager", False), ("compiled", True)):
        t0 = clock.now()

        def one(batch: int, compile=compile, mode=mode) -> dict:
            clock.say(mode, f"{sizes['model']} seq {sizes['seq_len']} batch {batch} ...")
            row = train_row(sizes, batch, compile, args.smoke, peak, calibration)
            clock.say(
                mode,
                f"batch {batch}: {row['tokens_per_s']:,.0f} tok/s, MFU {row['mfu']:.1%}"
                if row["mfu"] is not None
                else f"batch {batch}: {row['tokens_per_s']:,.0f} tok/s",
            )
            clock.say(
                mode,
                f"batch {batch}: step {row['step_time_s'] * 1e3:.1f} ms, predicted "
                f"{row['predicted']['step_time_s'] * 1e3:.1f} ms ({row['measured_over_predicted']['step_time']:.2f}x), "
                f"peak {row['peak_memory_bytes_rank0'] / 2**30:.2f} GiB, {row['compute_dtype']}",
            )
            return row

        rows, stopped = sweep(one, sizes["batches"], budgets[mode])
        results["train"][mode] = {
            "rows": rows,
            "stopped": stopped,
            "largest_batch": max((r["global_batch"] for r in rows), default=None),
            "seconds": clock.now() - t0,
        }
        clock.say(
            mode,
            f"largest batch {results['train'][mode]['largest_batch']}"
            + (
                f"; stopped at batch {stopped['batch']}: {stopped['reason']} ({stopped['detail'][:160]})"
                if stopped
                else ""
            ),
        )

    # 4. the plain-torch baseline at the largest batch eager tessera fit (halved until it fits)
    t0 = clock.now()
    batch = results["train"]["eager"]["largest_batch"]
    base: dict[str, Any] = {"row": None, "attempts": []}
    while batch:
        clock.say("baseline", f"plain torch{'' if args.smoke else ' (compiled blocks)'} at batch {batch} ...")
        config = train_config(sizes, batch, False, args.smoke)
        try:
            records = _one_rank(baseline_rank, config, on_gpu, sizes["steps"])
        except Exception as e:  # noqa: BLE001
            base["attempts"].append(
                {"batch": batch, "error": str(e).splitlines()[-1][:300] if str(e) else type(e).__name__}
            )
            if not is_oom(e) or clock.now() - t0 > budgets["baseline"]:
                break
            batch //= 2
            continue
        base["row"] = _baseline_row(config, records, sizes["warmup"], peak, on_gpu)
        for mode in ("eager", "compiled"):
            same = next((r for r in results["train"][mode]["rows"] if r["global_batch"] == batch), None)
            if same is not None:
                same["step_time_vs_baseline"] = same["step_time_s"] / base["row"]["step_time_s"]
                base[f"tessera_{mode}_over_baseline"] = same["step_time_vs_baseline"]
        break
    base["seconds"] = clock.now() - t0
    results["baseline"] = base
    if base["row"]:
        clock.say(
            "baseline",
            f"{base['row']['tokens_per_s']:,.0f} tok/s; tessera / baseline step time: eager "
            f"{base.get('tessera_eager_over_baseline', float('nan')):.3f}, compiled "
            f"{base.get('tessera_compiled_over_baseline', float('nan')):.3f}",
        )

    # 5. the planner's predictions against the measurements
    results["planner"] = planner_check(results["train"]["eager"]["rows"] + results["train"]["compiled"]["rows"])
    p = results["planner"]
    if p["of"]:
        clock.say(
            "planner",
            f"measured / predicted step time: median {p['median_step_ratio']:.3f}, worst error "
            f"{p['worst_step_error']:.1%}, {p['within_10_percent']} of {p['of']} within 10%",
        )
    results["seconds"] = clock.now()
    name = "gpu_suite_smoke_cpu" if args.smoke else f"gpu_suite_{device_slug(info['device'])}"
    out = Path(args.out) if args.out else HERE / "results"
    path = write_results(name, {"smoke": args.smoke}, results, str(out))
    pngs = plots(results, path.with_suffix(""))
    clock.say("suite", f"wrote {path}" + "".join(f", {p.name}" for p in pngs))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke", action="store_true", help="every part at tiny sizes on CPU (checks the plumbing, < 1 min)"
    )
    p.add_argument("--out", default=None, help="directory for the JSON and PNGs (default benchmarks/results/)")
    args = p.parse_args(argv)
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
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
