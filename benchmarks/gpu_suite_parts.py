"""The GPU suite's parts (benchmarks/gpu_suite.py runs them in order): each takes the suite and the seconds it
may spend, and returns its JSON entry. The training rows run in a one-rank job whose deadline is the part's."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
STARTUP_S = 30  # Python, torch and CUDA start-up before the first part: inside the budget


class Suite:
    """The run's clock, its budget, and its results, rewritten atomically after every part."""

    def __init__(self, budget_s: float, path: Path, sizes: dict, smoke: bool):
        self.started = time.perf_counter()
        self.budget_s, self.path, self.sizes, self.smoke = budget_s, path, sizes, smoke
        self.results: dict[str, Any] = {"parts_done": [], "skipped": [], "budget_s": budget_s}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - STARTUP_S * (not self.smoke) - self.elapsed()

    def say(self, part: str, text: str) -> None:
        m, s = divmod(int(self.elapsed()), 60)
        print(f"[{m:02d}:{s:02d}] {part}: {text}", flush=True)

    def save(self, payload: dict[str, Any]) -> None:
        """Write the JSON whole to a temporary file, then rename it over the last: never a partial file."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1, allow_nan=False))
        os.replace(tmp, self.path)


def is_oom(error: BaseException) -> bool:
    text = str(error)
    return "OutOfMemoryError" in text or "out of memory" in text.lower()


def first_error_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return next((ln for ln in lines if "Error" in ln), lines[0] if lines else type(error).__name__)[:400]


def search_batch(
    run_one: Callable[[int], dict],
    start: int,
    grow: Callable[[dict, int], bool],
    time_left: Callable[[], float],
) -> tuple[dict | None, list[dict]]:
    """The largest batch that runs: `run_one(start)`, halved on out-of-memory; after a success, doubled
    while `grow(row, batch)` says the measured peak leaves room (never past a batch that ran out of memory).
    Stops before an attempt that would take longer than the time left (about 1.3x the last one).
    Returns (the largest batch's row or None, every attempt)."""
    attempts: list[dict] = []
    best, batch, last_s, failed = None, start, 0.0, False
    while batch >= 1:
        if attempts and time_left() < 1.3 * last_s:
            attempts.append({"batch": batch, "outcome": "skipped", "detail": f"{time_left():.0f} s left of the part"})
            break
        began = time.perf_counter()
        try:
            row = run_one(batch)
        except Exception as e:  # noqa: BLE001 - recorded in the results, the suite goes on
            last_s = time.perf_counter() - began
            oom = is_oom(e)
            outcome = "out of memory" if oom else "out of time" if type(e).__name__ == "RankTimeout" else "error"
            attempts.append({"batch": batch, "outcome": outcome, "detail": first_error_line(e)})
            if not oom or best is not None:  # after a doubling: the batch before it is the largest
                break
            failed, batch = True, batch // 2
            continue
        last_s = time.perf_counter() - began
        attempts.append({"batch": batch, "outcome": "ran", "seconds": last_s, "peak_bytes": row.get("peak_bytes")})
        best = row
        if failed or not grow(row, batch):
            break
        batch *= 2
    return best, attempts


def train_config(sizes: dict, batch: int, compile: bool, smoke: bool, fp8: str | None = None, kernels: str = "auto"):
    from tessera.config import Config

    config = Config.create(
        model=sizes["model"],
        seq_len=sizes["seq_len"],
        global_batch=batch,
        steps=sizes["steps"],
        quiet=True,
        device="cpu" if smoke else "cuda",
        compile=compile,
        fp8=fp8,
        kernels=kernels,
        profile_summary=sizes["steps"],  # the last step: its kernels, time by kind, and memory
        force=True,  # the suite sizes the batch itself: from the planner's estimate, then by what runs
    )
    config.check()
    return config


def planner_batch(sizes: dict, capacity: int | None) -> tuple[int, list[dict]]:
    """The largest power of two whose planner memory estimate fits `capacity` bytes (the GPU's memory), with
    the estimates tried; the smoke run (no device memory on CPU) starts at its fixed batch."""
    from tessera.training.estimate import planner_estimate

    if capacity is None:
        return sizes["smoke_batch"], []
    tried, batch = [], 1
    while batch <= sizes["max_batch"]:
        need = planner_estimate(train_config(sizes, batch, False, False)).memory["total"]
        tried.append({"batch": batch, "predicted_memory_bytes": need})
        if need > capacity:
            break
        batch *= 2
    fits = [t["batch"] for t in tried if t["predicted_memory_bytes"] <= capacity]
    return (max(fits) if fits else 1), tried


def train_row(
    sizes: dict,
    batch: int,
    compile: bool,
    smoke: bool,
    peak: float | None,
    timeout: float,
    fp8: str | None = None,
    kernels: str = "auto",
) -> dict:
    from tessera.commands.bench import _row
    from tessera.launching.launch import run_ranks
    from tessera.training.run import run_rank

    config = train_config(sizes, batch, compile, smoke, fp8, kernels)
    started = time.perf_counter()
    backend = "gloo" if smoke else "nccl"
    history = run_ranks(run_rank, 1, config, 0, timeout=max(1.0, timeout), backend=backend)[0]
    kind = f"{'compiled' if compile else 'eager'}{f' fp8 {fp8}' if fp8 else ''}"
    label = f"{kind} b{batch}" + (f" kernels {kernels}" if kernels != "auto" else "")
    row = _row(label, config, history, sizes["warmup"], peak, not smoke)
    row["run_seconds"] = time.perf_counter() - started
    row["peak_bytes"] = row["profile"]["memory"]["peak_bytes"] if smoke else row["peak_memory_bytes_rank0"]
    return row


def baseline_row(
    sizes: dict, batch: int, compile: bool, smoke: bool, peak: float | None, timeout: float, attention: str = "best"
) -> dict:
    from tessera.commands.bench import _baseline_row, baseline_rank
    from tessera.launching.launch import run_ranks

    config = train_config(sizes, batch, False, smoke)
    records = run_ranks(
        baseline_rank,
        1,
        config,
        compile,
        sizes["steps"],
        attention,
        timeout=max(1.0, timeout),
        backend="gloo" if smoke else "nccl",
    )[0]
    return _baseline_row(config, records, sizes["warmup"], peak, compile)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: against a float64 definition."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def part_triton(suite: Suite, cap: float) -> dict:
    """Every Triton kernel once, forward and backward, on this machine's triton, against float64."""
    from tessera.kernels import flash_attention, naive_attention, rms_norm

    device, dtype = ("cpu", torch.float32) if suite.smoke else ("cuda", torch.bfloat16)
    checks = []
    cases = [("attention", d, causal) for d in (64, 128) for causal in (True, False)] + [("rms_norm", 256, None)]
    for kind, d, causal in cases:
        began = time.perf_counter()
        entry: dict[str, Any] = {"kernel": kind, "head_dim" if kind == "attention" else "hidden": d}
        try:
            torch.manual_seed(0)
            if kind == "attention":
                entry["causal"] = causal
                inputs = [torch.randn(1, 2, 64, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
                got = flash_attention(*inputs, causal=bool(causal), backend="triton")
                exact = [t.detach().double().requires_grad_() for t in inputs]
                want = naive_attention(*exact, causal=bool(causal))[0]
            else:
                inputs = [
                    torch.randn(64, d, device=device, dtype=dtype, requires_grad=True),
                    torch.randn(d, device=device, dtype=dtype, requires_grad=True),
                ]
                got = rms_norm(*inputs, 1e-6, backend="triton")
                exact = [t.detach().double().requires_grad_() for t in inputs]
                x64, w64 = exact
                want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
            upstream = torch.randn_like(want)
            got.backward(upstream.to(got.dtype))
            want.backward(upstream)
            entry["forward_rel_error"] = relative_error(got, want.detach())
            entry["backward_rel_error"] = max(relative_error(t.grad, e.grad) for t, e in zip(inputs, exact))
            # bf16 keeps 8 bits of mantissa (a relative step of 2^-8); fp32 far more
            bound = 1e-5 if dtype == torch.float32 else 3e-2
            entry["ok"] = entry["forward_rel_error"] < bound and entry["backward_rel_error"] < bound
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here is the finding
            entry.update(ok=False, error=f"{type(e).__name__}: {first_error_line(e)}")
        entry["seconds"] = time.perf_counter() - began
        checks.append(entry)
    checks.append(fp8_cast_check(device))
    if not suite.smoke:  # the training parts run in other processes: hand this one's cached blocks back
        torch.cuda.empty_cache()
    import triton  # lazy: the kernels above imported it already

    return {"triton": triton.__version__, "checks": checks, "all_ok": all(c["ok"] for c in checks)}


def fp8_cast_check(device: str) -> dict:
    """The one-pass FP8 cast (kernels/triton_fp8_cast.py) against torch's own eager cast of the fp32 product,
    bit for bit, in both formats and with a scale per row, written in both memory orders (the column-major one
    a transposing tile): the GPU's rounding and its compiled strided stores, which the CPU interpreter's tests
    cannot show."""
    from tessera.kernels.triton_fp8_cast import FORMATS, scaled_cast_fp8

    began = time.perf_counter()
    rows, hidden = (512, 1024) if device != "cpu" else (64, 256)  # the smoke's interpreter: a smaller tile count
    entry: dict[str, Any] = {"kernel": "fp8_cast", "hidden": hidden}
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(rows, hidden, device=device, generator=gen) * 30).to(torch.bfloat16)
        mismatched = 0
        for dtype, (_, _, fmax) in FORMATS.items():
            for scale in (torch.tensor(3.7, device=device), torch.rand(rows, 1, device=device, generator=gen) * 9):
                want = (x.float() * scale.float()).clamp(-fmax, fmax).to(dtype)
                for layout in ("row", "col"):
                    got = scaled_cast_fp8(x, scale.float(), dtype, layout)
                    mismatched += int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
        entry.update(mismatched_bits=mismatched, ok=mismatched == 0)
    except Exception as e:  # noqa: BLE001 - as the other kernels': the finding
        entry.update(ok=False, error=f"{type(e).__name__}: {first_error_line(e)}")
    entry["seconds"] = time.perf_counter() - began
    return entry


def part_eager(suite: Suite, cap: float, peak: float | None, capacity: int | None) -> dict:
    """The largest batch that runs, from the planner's estimate for `capacity` bytes (None: the smoke's)."""
    sizes, smoke = suite.sizes, suite.smoke
    start, estimates = planner_batch(sizes, capacity)
    suite.say(
        "eager", f"the planner fits batch {start} in {'(smoke: fixed)' if smoke else f'{capacity / 2**30:.0f} GiB'}"
    )
    deadline = time.perf_counter() + cap

    def run_one(batch: int) -> dict:
        suite.say("eager", f"{sizes['model']} seq {sizes['seq_len']} batch {batch} ...")
        row = train_row(sizes, batch, False, smoke, peak, deadline - time.perf_counter())
        suite.say("eager", row_line(row))
        return row

    def grow(row: dict, batch: int) -> bool:
        return (
            sizes["grow"]
            and capacity is not None
            and 2 * batch <= sizes["max_batch"]
            and peak_at(row, 2 * batch) <= capacity  # capacity: USABLE_MEMORY of the GPU, the headroom kept
        )

    row, attempts = search_batch(run_one, start, grow, lambda: deadline - time.perf_counter())
    return {"row": row, "attempts": attempts, "planner_start": start, "planner_estimates": estimates}


def peak_at(row: dict, batch: int) -> float:
    """The peak a row's run would reach at `batch`: what its step starts holding (weights, optimizer state: the
    same at any batch, measured by its profile) plus its per-sequence bytes above that, times `batch`. A row
    without a profile (or its start) scales its whole peak. The rule before this one doubled the whole peak and
    kept a second 10% aside: the H200's 1b batch 16 (74.4 GB peak, 18.1 GB of it held at the step's start) never
    tried batch 32, which needs 18.1 + 2 x 56.4 = 130.8 GB of the 135 GB usable."""
    peak = float(row["peak_bytes"])
    start = ((row.get("profile") or {}).get("memory") or {}).get("step_start_bytes")
    if start is None or not 0 <= start <= peak:
        return peak * batch / row["global_batch"]
    return start + (peak - start) * batch / row["global_batch"]


def row_line(row: dict) -> str:
    mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
    if row.get("mfu_fp8_peak") is not None:  # an FP8 row: against the FP8 peak and the FLOP-blended one, named
        mfu = f", MFU {row['mfu_fp8_peak']:.1%} of the FP8 peak ({row['mfu_fp8_blended_peak']:.1%} of the blended)"
    return (
        f"batch {row['global_batch']}: {row['tokens_per_s']:,.0f} tok/s{mfu}, step {row['step_time_s'] * 1e3:.1f} ms, "
        f"peak {row['peak_bytes'] / 2**20:,.0f} MiB, {row['compute_dtype']}"
    )


def part_baseline(suite: Suite, cap: float, peak: float | None, compile: bool, batch: int) -> dict:
    """The plain-torch baseline at `batch` (halved on out-of-memory) on the attention backend tessera picks
    (`row`: cuDNN on Hopper, the strongest), then, in the time left, the same at that batch on SDPA's own
    priority (`sdpa_default`: FlashAttention-2 first on Hopper), a second named row."""
    deadline = time.perf_counter() + cap
    kind = "compiled per block" if compile else "eager"

    def run_one(b: int, attention: str = "best") -> dict:
        suite.say("baseline", f"plain torch ({kind}, attention {attention}) at batch {b} ...")
        return baseline_row(suite.sizes, b, compile, suite.smoke, peak, deadline - time.perf_counter(), attention)

    row, attempts = search_batch(run_one, batch, lambda r, b: False, lambda: deadline - time.perf_counter())
    out: dict[str, Any] = {"row": row, "attempts": attempts, "sdpa_default": None}
    if row is not None and deadline - time.perf_counter() > 0.25 * cap:
        try:
            out["sdpa_default"] = run_one(row["global_batch"], "sdpa-default")
        except Exception as e:  # noqa: BLE001 - the strongest row stands; the second is named as not run
            out["sdpa_default_error"] = first_error_line(e)
    return out


def ratio_to(row: dict | None, base: dict | None) -> float | None:
    """tessera / baseline step time, only at the same batch (> 1: slower than plain torch)."""
    if not row or not base or row["global_batch"] != base["global_batch"]:
        return None
    return row["step_time_s"] / base["step_time_s"]


def part_compiled(suite: Suite, cap: float, peak: float | None, batch: int) -> dict:
    """tessera --compile at `batch` (halved on out-of-memory) in 60% of the part's time, then the baseline
    compiled per block (on CPU eager: a cold compile there is minutes) at the batch that ran."""
    began = time.perf_counter()
    deadline = began + 0.6 * cap

    def run_one(b: int) -> dict:
        suite.say("compiled", f"{suite.sizes['model']} seq {suite.sizes['seq_len']} batch {b}, --compile ...")
        row = train_row(suite.sizes, b, True, suite.smoke, peak, deadline - time.perf_counter())
        suite.say("compiled", row_line(row))
        return row

    row, attempts = search_batch(run_one, batch, lambda r, b: False, lambda: deadline - time.perf_counter())
    out: dict[str, Any] = {"row": row, "attempts": attempts}
    if row is not None:
        left = cap - (time.perf_counter() - began)
        out["baseline"] = part_baseline(suite, left, peak, not suite.smoke, row["global_batch"])
        out["tessera_over_baseline"] = ratio_to(row, out["baseline"]["row"])
        out["tessera_over_sdpa_default_baseline"] = ratio_to(row, out["baseline"]["sdpa_default"])
    return out


def part_kernels(suite: Suite, cap: float) -> dict:
    sys.path.insert(0, str(HERE))
    import bench_kernels  # lazy: a sibling script, on the path above

    k = suite.sizes["kernels"]
    device, dtype = ("cpu", torch.float32) if suite.smoke else ("cuda", torch.bfloat16)
    deadline = time.perf_counter() + cap
    attention, norms, left_out = [], [], []
    for seq in k["seq_lens"]:  # one sequence at a time, so the budget is checked between them
        if time.perf_counter() > deadline:
            left_out.append(f"attention seq {seq}")
            continue
        attention += bench_kernels.bench_attention(argparse.Namespace(**{**k, "seq_lens": [seq]}), device, dtype)
    for shape in k["norm_shapes"]:
        if time.perf_counter() > deadline:
            left_out.append(f"rms_norm {shape[0]}x{shape[1]}")
            continue
        norms += bench_kernels.bench_rms_norm(argparse.Namespace(**{**k, "norm_shapes": [shape]}), device, dtype)
    swiglus: list[dict] = []
    for shape in k["norm_shapes"]:  # the MLP's activation at the same (tokens, width) shapes
        if time.perf_counter() > deadline:
            left_out.append(f"swiglu {shape[0]}x{shape[1]}")
            continue
        swiglus += bench_kernels.bench_swiglu(argparse.Namespace(**{**k, "norm_shapes": [shape]}), device, dtype)
    if not suite.smoke:
        torch.cuda.empty_cache()  # the next parts run in other processes
    return {
        "attention": attention,
        "rms_norm": norms,
        "swiglu": swiglus,
        "ratios": {**bench_kernels.ratios(attention, norms), "swiglu": bench_kernels.swiglu_ratios(swiglus)},
        "left_out_for_budget": left_out,
    }


def part_moe(suite: Suite, cap: float) -> dict:
    sys.path.insert(0, str(HERE))
    import bench_moe  # lazy: a sibling script, on the path above

    device, dtype = ("cpu", torch.float32) if suite.smoke else ("cuda", torch.bfloat16)
    result = bench_moe.grouped_vs_loop(**suite.sizes["moe"], device=device, dtype=dtype)
    if not suite.smoke:
        torch.cuda.empty_cache()
    return result


def part_planner(suite: Suite, cap: float) -> dict:
    """This device's rates at the model's shapes, then the planner (at those rates) against every training
    row measured: step time and memory, measured / predicted. The rates are measured at each row's own batch
    (its microbatch's tokens: a GEMM's and the attention's rate depend on them; on the H200 the calibration at 4
    rows had the 2048 -> 512 GEMMs at 194 TFLOP/s where the step's 16 rows ran them faster), at the suite's
    calibrate_batch where no row ran."""
    from tessera.commands.bench import calibrate_rank
    from tessera.training.estimate import planner_estimate
    from tessera.commands.calibrate import describe
    from tessera.launching.launch import run_ranks
    from tessera.topology.estimators.step_time import Calibration

    sizes = suite.sizes
    began = time.perf_counter()
    measured = [(mode, row) for mode in ("eager", "compiled") for row in training_rows(suite.results, mode)]
    by_batch: dict[int, dict] = {}
    for batch in sorted({row["global_batch"] for _, row in measured}) or [sizes["calibrate_batch"]]:
        config = train_config(sizes, batch, False, suite.smoke)
        left = cap - (time.perf_counter() - began)  # every batch's calibration within the part's cap
        by_batch[batch] = run_ranks(
            calibrate_rank, 1, config, suite.smoke, timeout=max(1.0, left), backend="gloo" if suite.smoke else "nccl"
        )[0]
        suite.say("planner", f"batch {batch}: {describe(by_batch[batch])}")
    rows = []
    for mode, row in measured:
        rates = Calibration.from_entry(by_batch[row["global_batch"]])
        estimate = planner_estimate(train_config(sizes, row["global_batch"], mode == "compiled", suite.smoke), rates)
        measured_memory = row["peak_bytes"]
        rows.append(
            {
                "row": row["layout"],
                "measured_step_s": row["step_time_s"],
                "predicted_step_s": estimate.time["step"],
                "step_ratio": row["step_time_s"] / estimate.time["step"],
                "predicted_parts_s": estimate.compute_parts,
                "measured_memory_bytes": measured_memory,
                "predicted_memory_bytes": estimate.memory["total"],
                "memory_ratio": measured_memory / estimate.memory["total"],
            }
        )
    ratios = [r["step_ratio"] for r in rows]
    return {
        "calibration": next(iter(by_batch.values())),  # the smallest batch's (where the rows share one: theirs)
        "calibrations_by_batch": {str(b): c for b, c in by_batch.items()},
        "rows": rows,
        "memory_measure": "live tensors at the profiled step's peak (CPU)" if suite.smoke else "CUDA allocator peak",
        "median_step_ratio": statistics.median(ratios) if ratios else None,
        "worst_step_error": max((abs(x - 1) for x in ratios), default=None),
        "within_10_percent": sum(abs(x - 1) <= 0.10 for x in ratios),
        "of": len(ratios),
    }


def training_rows(results: dict, mode: str) -> list[dict]:
    row = (results.get(mode) or {}).get("row")
    return [row] if row else []
