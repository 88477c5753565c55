"""`tessera bench`: the scaling sweep. Runs layouts through the real training
job (local ranks, or the ranks of a torchrun / Slurm job) and writes JSON and
PNG plots: throughput and efficiency against device count, memory per rank by
layout, and the planner's predictions against the measurements.

Layouts are named by their degrees joined with x, options after +:

    one  dp4  tp2  dp2xtp2  pp2xdp2xcp2xtp2+sp
    dpr2xdp2 (HSDP: dp_replicate 2 x dp_shard 2)
    dp4xep2 (expert parallel: ep borrows ranks of dp_shard x cp, MoE only)
    options: sp (sequence parallel), ac_op / ac_full / ac_selective,
    zero2 (SHARD_GRAD_OP), compile

Per layout: the median over the steps after --warmup of the step time;
tokens/s and tokens/s per device; MFU = model FLOPs per step (6 x matmul
parameters + 6 x layers x dim x seq per token: the second term is causal
attention's QK^T and PV, forward and backward, at half the dense count) /
(step time x devices x peak FLOP/s per device: the bf16 peak of a known GPU,
or on CPU one core's fp32 matmul rate measured here at the start); the dtype
the matmuls ran in (the records' compute_dtype, read from the tensors); the
step split into exposed communication (time inside tessera's tp, cp and pp
collectives, waiting on peers included; not measured, and said so, where
--compile puts tp or cp all-gather collectives inside the blocks' graphs) and
the rest (compute, FSDP2's collectives and the optimizer); the bytes each axis
moved in the first step, counted and predicted; rank 0's peak tensor memory
(live tensor storage at the peak of step 2, measured) and its process peak
(the CUDA allocator's torch.cuda.max_memory_allocated, or peak RSS on CPU);
beside them the planner's step time and memory, its step time at rates
calibrated on this device at the start (tessera plan --calibrate's
measurement, topology/estimators/step_time.py), with measured / predicted.

A mixture-of-experts model (e.g. --model qwen3-moe-debug) adds each layout's
expert load: "moe" in its row holds every measured step's record entry (tokens
routed to each expert per layer, each layer's max/mean imbalance, the
auxiliary loss) with per-layer medians, and <name>-moe_load.png shows the last
measured step's counts as a layers x experts heatmap, each layer's imbalance
beside it. A dense model has neither (the JSON's config.moe_load says so).

--baseline adds a plain-torch row (tessera.commands.baseline: the same
weights, data, sequence and batch on one device, FSDP2 on a one-rank mesh with
the same mixed precision, SDPA, torch.compile per block on CUDA, fused AdamW)
and each layout's step time over the baseline's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tessera.topology.estimators.step_estimate import model_flops_per_token
from tessera.topology.estimators.step_time import Calibration
from tessera.training.run_config import Config, said
from tessera.training.layout_names import AXIS_OF, OPTIONS, parse_layout  # noqa: F401  (the names bench and plan take)
from tessera.launching.rank_server import start_rank_server

from . import bench_plots
from .plan import model_shape

MFU_FORMULA = (
    "(6 x matmul parameters + 6 x n_layers x dim x seq_len) x tokens per step / (step time x devices x peak); "
    "the second term is causal attention (QK^T and PV, forward + backward, half the dense 12 x n_layers x "
    "dim x seq_len); peak per device: "
)


def series_layouts(kind: str, max_ranks: int, global_batch: int) -> list[tuple[str, int]]:
    """(layout, global batch) for a data-parallel scaling series over 1, 2, 4, ... max_ranks ranks: weak
    keeps the batch per rank (the global batch grows), strong keeps the global batch."""
    if max_ranks < 1 or max_ranks & (max_ranks - 1):
        raise ValueError(f"--max-ranks {max_ranks} must be a power of two (the series doubles the ranks)")
    counts = [2**i for i in range(max_ranks.bit_length())]
    if kind == "strong" and global_batch % max_ranks:
        raise ValueError(
            f"--series strong keeps --global-batch {global_batch} fixed; it must divide over "
            f"--max-ranks {max_ranks} (use a multiple of {max_ranks})"
        )
    return [("one" if n == 1 else f"dp{n}", global_batch * n if kind == "weak" else global_batch) for n in counts]


def cpu_core_peak_flops(size: int = 512, reps: int = 5) -> float:
    """One thread's fp32 matmul rate, measured: the CPU's stand-in for a GPU's datasheet peak."""
    import torch  # lazy: torch stays out of `tessera --help` (the CLI imports this module for its parser)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(reps))
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="the scaling sweep: runs layouts, writes results JSON and plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="debug", help="a model preset (default debug)")
    p.add_argument("--n-layers", type=int, default=None, help="override the preset's number of blocks")
    p.add_argument("--layouts", default=None, help="comma-separated layouts, e.g. one,dp2,tp2,dp2xtp2")
    p.add_argument(
        "--series", choices=("weak", "strong"), default=None, help="a data-parallel scaling series instead of --layouts"
    )
    p.add_argument("--max-ranks", type=int, default=4, help="the series' largest rank count (a power of two)")
    p.add_argument("--seq-len", type=int, default=64, metavar="N", help="tokens per sequence (default 64)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (--series weak: per rank)")
    p.add_argument("--microbatches", type=int, default=None, help="per step (default: 2 x pp with pp, else 1)")
    p.add_argument(
        "--steps",
        type=int,
        default=6,
        metavar="N",
        help="optimizer steps per layout, --warmup of them left out of the medians (default 6)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps left out of the medians, at least 2 (default 2; the first also counts bytes)",
    )
    p.add_argument("--device", default="auto", help="cpu or cuda (auto: CUDA when there is a GPU for every rank)")
    p.add_argument(
        "--mixed-precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--baseline",
        nargs="?",
        const="auto",
        choices=("auto", "eager", "compile"),
        default=None,
        help="also run the plain-torch baseline (tessera.commands.baseline) at the first layout's batch; compiled per "
        "block or not (auto: compiled on CUDA, eager on CPU)",
    )
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="skip measuring this device's rates at the start (the predicted step time then uses the "
        "planner's uncalibrated constants)",
    )
    p.add_argument("--out", required=True, help="directory for bench-<model>-<device>.json and the PNG plots")
    p.set_defaults(func=run_bench)


def _predicted_text(row: dict, on_gpu: bool, calibration: Any) -> str:
    """The row's predicted step beside the measured one; on CPU ranks without a calibration (--no-calibrate)
    the planner's constants are a GPU's, so the figure is named as such, not offered as this device's."""
    text = (
        f"predicted step {row['predicted']['step_time_s'] * 1e3:.1f} ms "
        f"(measured / predicted {row['measured_over_predicted']['step_time']:.2f})"
    )
    if calibration is None and not on_gpu:
        return text.replace("predicted step", "predicted step at an H100's uncalibrated rates, not this CPU's,", 1)
    return text


def run_bench(args: argparse.Namespace) -> int:
    try:
        if (args.layouts is None) == (args.series is None):
            raise ValueError("give --layouts L1,L2,... or --series weak|strong (with --max-ranks N)")
        if args.warmup < 2:
            raise ValueError(
                f"--warmup {args.warmup} must be at least 2: step 1 counts the bytes per axis and step 2 "
                f"measures the peak tensor memory, both slower than a plain step"
            )
        if args.steps <= args.warmup:
            raise ValueError(f"--steps {args.steps} must exceed --warmup {args.warmup} (the timed steps come after it)")
        runs = (
            series_layouts(args.series, args.max_ranks, args.global_batch)
            if args.series
            else [(name, args.global_batch) for name in args.layouts.split(",")]
        )
        if any(not name.strip() for name, _ in runs):  # 'dp2,,tp2' or '': name the list as given
            raise ValueError(
                f"--layouts {args.layouts!r} has an empty layout name; give comma-separated layouts, e.g. "
                f"--layouts one,dp2,tp2"
            )
        layouts = [parse_layout(name) for name, _ in runs]
        for (name, _), kw in zip(runs, layouts):
            for option in ("async_tp", "ep_overlap", "ep_over_tp"):
                if kw.pop(option, False):
                    raise ValueError(
                        f"layout {name!r}: +{option} is a `tessera plan` option (it predicts other frameworks' "
                        f"overlapped collectives); tessera runs its collectives synchronously: drop it here"
                    )
        # the ranks' server imports torch and tessera beside this command's own imports (and inductor where a layout
        # compiles, or --baseline compile)
        start_rank_server(compiles=args.baseline == "compile" or any(kw.get("compile") for kw in layouts))
        configs = []
        for (name, batch), kw in zip(runs, layouts):
            mb = args.microbatches or (2 * kw.get("pp", 1) if kw.get("pp", 1) > 1 else 1)
            config = Config.create(
                model=args.model,
                n_layers=args.n_layers,
                seq_len=args.seq_len,
                global_batch=batch,
                steps=args.steps,
                microbatches=mb,
                quiet=True,
                device=args.device,
                mixed_precision=args.mixed_precision,
                comm_stats="first",
                track_memory=True,
                **kw,
            )
            config.check(flags={})  # a layout is a name here, not --tp/--pp flags
            configs.append((name, config))
        from .tokenize import check_out_dir  # lazy: it imports torch (tessera.data.tokens)

        out = check_out_dir("--out", args.out)  # ValueError naming --out and the fix, never a bare [Errno]
    except (ValueError, OSError) as e:
        print(f"tessera bench: error: {said(e, args)}", file=sys.stderr)
        return 2
    return _sweep(args, configs, out)


def calibrate_rank(config, quick: bool = True) -> dict:
    """On a one-rank job (the threads and device of a rank): this device's rates at the config's shapes, a
    dp rank's microbatch (tessera.commands.calibrate.measure)."""
    # lazy: torch, and these modules that import it, stay out of `tessera --help`
    import torch
    from tessera.training.training_loop import current_device

    from .calibrate import measure

    rows = max(1, config.data.global_batch // config.layout.dp // config.data.microbatches)
    device = current_device() if config.device_type() == "cuda" else torch.device("cpu")
    return measure(
        config.model_config, config.data.seq_len // config.layout.cp, rows, device, config.mixed_precision, quick=quick
    )


UNTIMED_IN_COMPILED_BLOCKS = (
    "not measured: the compiled blocks' tp collectives and cp all-gathers run inside their graphs, untimed"
)


def _exposed(row: dict) -> str:
    if row["exposed_comm_s"] is None:
        return f"exposed communication {row['exposed_comm_note']}"
    return f"{row['exposed_comm_s'] * 1e3:.1f} ms exposed communication"


def baseline_rank(config, compile: bool, steps: int, attention: str = "best") -> list[dict]:
    """On a one-rank job: the plain-torch baseline (tessera.commands.baseline) at the config's model, seed, data,
    sequence, global batch, mixed precision and optimizer; its step records."""
    # lazy: torch, and these modules that import it, stay out of `tessera --help`
    import torch
    from tessera.training.training_loop import current_device

    from . import baseline

    device = current_device() if config.device_type() == "cuda" else torch.device("cpu")
    cfg, o = config.model_config, config.optimizer
    options = baseline.Options(
        mixed_precision=config.mixed_precision,
        compile=compile,
        lr=o.lr,
        warmup=o.warmup,
        min_lr_ratio=o.min_lr_ratio,
        total_steps=config.runtime.steps,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        attention=attention,
    )
    batches = baseline.tessera_batches(cfg, config.data.seq_len, config.data.global_batch)
    return baseline.train(
        cfg, batches, steps, device, lambda: baseline.tessera_state(cfg, config.runtime.seed), options
    )


def _one_rank(fn, config, *args):
    from tessera.launching.launch import run_ranks  # lazy: tessera.parallel imports torch

    backend = "nccl" if config.device_type() == "cuda" else "gloo"
    return run_ranks(fn, 1, config, *args, timeout=None, backend=backend)[0]


def _sweep(args: argparse.Namespace, configs: list, out: Path) -> int:
    # lazy: these import torch, which stays out of `tessera --help`
    from tessera.metrics.results import BF16_PEAK, device_info, write_results
    from tessera.training.run import train

    info = device_info()
    on_gpu = configs[0][1].device_type() == "cuda"
    per_device_peak = (
        next((v for k, v in BF16_PEAK.items() if k in info["device"]), None) if on_gpu else cpu_core_peak_flops()
    )
    calibration = None
    if args.calibrate:
        print(f"bench: calibrating this device at {configs[0][0]}'s shapes ...", flush=True)
        calibration = _one_rank(calibrate_rank, configs[0][1])
        from .calibrate import describe  # lazy: tessera.commands.calibrate imports torch

        print(f"bench: {describe(calibration)} ({calibration['seconds']:.1f} s)", flush=True)
    rows = []
    for i, (name, config) in enumerate(configs, 1):
        print(
            f"bench [{i}/{len(configs)}] {name}: {config.layout.world_size} rank(s), {config.runtime.steps} steps ...",
            flush=True,
        )
        history = train(config)
        assert history is not None, "the bench spawns its ranks itself: train returns rank 0's records"
        rows.append(_row(name, config, history, args.warmup, per_device_peak, on_gpu, calibration))
        r = rows[-1]
        experts = (
            (
                f"; experts: max/mean imbalance {r['moe']['max_imbalance']:.2f} (worst layer, step), aux loss "
                f"{r['moe']['aux_loss_median']:.4g}"
            )
            if "moe" in r
            else ""
        )
        print(
            f"bench [{i}/{len(configs)}] {name}: {r['tokens_per_s']:,.0f} tok/s "
            f"({r['tokens_per_s_per_device']:,.0f} per device), "
            f"step {r['step_time_s'] * 1e3:.1f} ms ({_exposed(r)}), "
            f"MFU {r['mfu']:.1%}, loss {r['final_loss']:.4f}, {r['compute_dtype']}; "
            + _predicted_text(r, on_gpu, calibration)
            + experts,
            flush=True,
        )
    _efficiency(rows)
    baseline = None
    if args.baseline:
        base_config = configs[0][1]
        compile = args.baseline == "compile" or (args.baseline == "auto" and on_gpu)
        print(
            f"bench [baseline] plain torch{' (compiled blocks)' if compile else ''}: 1 rank, {args.steps} steps ...",
            flush=True,
        )
        records = _one_rank(baseline_rank, base_config, compile, args.steps)
        baseline = _baseline_row(base_config, records, args.warmup, per_device_peak, compile)
        for r in rows:
            r["baseline_step_time_s"] = baseline["step_time_s"]
            # tessera / baseline at the same global batch: > 1 is slower than plain torch
            r["step_time_vs_baseline"] = (
                r["step_time_s"] / baseline["step_time_s"] if r["global_batch"] == baseline["global_batch"] else None
            )
        print(
            f"bench [baseline]: {baseline['tokens_per_s']:,.0f} tok/s, "
            f"step {baseline['step_time_s'] * 1e3:.1f} ms, MFU "
            f"{baseline['mfu']:.1%}, {baseline['compute_dtype']}; tessera / baseline step time: "
            + ", ".join(
                f"{r['layout']} {r['step_time_vs_baseline']:.3f}" for r in rows if r.get("step_time_vs_baseline")
            ),
            flush=True,
        )
    device = "cuda" if on_gpu else "cpu"
    name = f"bench-{args.model}-{args.series or 'layouts'}-{device}"
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["mfu_formula"] = MFU_FORMULA + (
        "the GPU's dense bf16 datasheet figure"
        if on_gpu
        else "one CPU core's fp32 matmul rate measured at the start; devices on CPU: min(ranks, cores)"
    )
    config["attention_flops_included"] = True
    config["peak_flops_per_device"] = per_device_peak
    config["predicted_step_time"] = (
        "the planner's estimate (topology/estimators/planner.py) at rates measured on this device at the start "
        "(topology/estimators/step_time.py: matmuls, attention, elementwise traffic, loss, optimizer, "
        "host dispatch); ratios are measured / predicted"
        if calibration
        else "the planner's uncalibrated estimate (FLOPs at its efficiency of the H100 bf16 peak)"
    )
    config["calibration"] = calibration
    has_moe = any("moe" in r for r in rows)
    config["moe_load"] = (
        f"each layout row's 'moe': its measured steps' expert load; {name}-moe_load.png (with matplotlib): the last "
        f"measured step's tokens per expert and layer"
        if has_moe
        else f"absent: {args.model} is a dense model (no experts), so its rows have no 'moe' entry and "
        f"there is no moe_load plot"
    )
    results: dict[str, Any] = {"layouts": rows}
    if baseline is not None:
        results["baseline"] = baseline
    path = write_results(name, config, results, out)
    plots = bench_plots.plots(rows, out, name, args.series, info["device"])
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    return 0


def _first(records: list[dict], key: str) -> Any:
    """The first record's `key` that has one (the dtype probe's figures are in one step's record only)."""
    return next((m[key] for m in records if m.get(key)), None)


def _baseline_row(config, records: list[dict], warmup: int, peak: float | None, compile: bool) -> dict:
    from tessera.metrics.results import mfu_by_dtype  # lazy: results imports torch, after the rank server

    timed = records[warmup:]
    step = statistics.median(m["step_time_s"] for m in timed)
    tokens = config.data.global_batch * config.data.seq_len
    flops = model_flops_per_token(model_shape(config.model_config), config.data.seq_len) * tokens
    devices = 1
    return {
        "layout": "baseline",
        "implementation": "tessera.commands.baseline (plain torch: FSDP2 on one rank, SDPA, fused/foreach AdamW)",
        "compile": compile,
        "mixed_precision": config.mixed_precision,
        "ranks": 1,
        "devices": devices,
        "global_batch": config.data.global_batch,
        "seq_len": config.data.seq_len,
        "step_time_s": step,
        "step_times_s": [m["step_time_s"] for m in timed],
        # each timed step's host side (collections, allocator calls, batch and launch seconds) beside its time
        "host_by_step": [m.get("host") for m in timed],
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / devices,
        **mfu_by_dtype(flops, step, devices, peak, _first(records, "matmul_flops_by_dtype")),
        "compute_dtype": _first(records, "compute_dtype"),
        # which SDPA backend ran (the dispatcher's pick under the baseline's priority), and which mode chose it
        "attention_backend": records[0].get("attention_backend"),
        "attention_mode": records[0].get("attention_mode"),
        "peak_memory_bytes": max(m["peak_memory_bytes"] for m in records),
        "final_loss": records[-1]["loss"],
        "losses": [m["loss"] for m in records],
    }


def _row(
    name: str,
    config,
    history: list[dict],
    warmup: int,
    peak: float | None,
    on_gpu: bool,
    calibration: dict | None = None,
) -> dict:
    # a step profiled with --profile-summary ran under torch.profiler: its figures go in "profile", not the times
    timed = [m for m in history[warmup:] if "profile" not in m]
    profiled = next((m for m in history if "profile" in m), None)
    step = statistics.median(m["step_time_s"] for m in timed)
    waits = {
        axis: statistics.median(m["collective_wait_s"].get(axis, 0.0) for m in timed)
        for axis in {a for m in timed for a in m["collective_wait_s"]}
    }
    exposed = min(step, sum(waits.values()))
    lay, ranks, p = config.layout, config.layout.world_size, config.parallel_config()
    # a compiled block's tp collectives and cp's all-gathers are ops of its graph, which nothing times: the exposed
    # communication of such a row is not measured, and is not reported as the eager ones' sum (the ring's
    # sends and receives break the graph and run eagerly, timed)
    untimed = p.compile and (lay.tp > 1 or (lay.cp > 1 and p.cp_method == "allgather"))
    tokens = config.data.global_batch * config.data.seq_len
    flops = model_flops_per_token(model_shape(config.model_config), config.data.seq_len) * tokens
    devices = ranks if on_gpu else min(ranks, os.cpu_count() or 1)

    from tessera.metrics.host_account import alternation  # lazy: as below
    from tessera.metrics.results import mfu_by_dtype  # lazy: as below
    from tessera.training.estimate import planner_estimate  # lazy: it imports torch, after the rank server

    predicted = planner_estimate(config, Calibration.from_entry(calibration) if calibration else None)
    comm = history[0].get("comm", {})
    peak_process = max(m["peak_memory_bytes"] for m in history)
    # measured memory against the planner's: the allocator's peak on a GPU, the live tensors' on CPU
    measured_memory = peak_process if on_gpu else history[1].get("peak_tensor_bytes")
    moe = moe_load(timed)
    return {
        "layout": name,
        "degrees": lay.as_dict(),
        "ranks": ranks,
        "devices": devices,
        "global_batch": config.data.global_batch,
        "microbatches": config.data.microbatches,
        "options": {
            "sequence_parallel": p.sequence_parallel,
            "ac": p.data.activation_checkpointing,
            "fsdp": p.data.strategy,
            "compile": p.compile,
        },
        "step_time_s": step,
        "step_times_s": [m["step_time_s"] for m in timed],
        # each timed step's host side (collections, allocator calls, batch and launch seconds) beside its time
        "host_by_step": [m.get("host") for m in timed],
        # steps alternating fast and slow, and the host figure that alternates with them, if one does
        "alternation": alternation([m["step_time_s"] for m in timed], [m.get("host") for m in timed]),
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / devices,
        # the probe's breakdown is in the first step's record only, a warmup step: timed[0] has none, and an FP8
        # row read that way was stated against the bf16 peak (66.8% on the H200 suite of 2026-12-04)
        **mfu_by_dtype(flops, step, devices, peak, _first(history, "matmul_flops_by_dtype")),
        "exposed_comm_s": None if untimed else exposed,
        "compute_and_fsdp_s": None if untimed else step - exposed,
        **({"exposed_comm_note": UNTIMED_IN_COMPILED_BLOCKS} if untimed else {}),
        "collective_wait_s_by_axis": waits,
        "peak_memory_bytes_rank0": peak_process,
        "peak_memory_kind": "CUDA allocator peak"
        if on_gpu
        else "process peak RSS (the Python and torch runtime included)",
        "peak_tensor_bytes_rank0": history[1].get("peak_tensor_bytes"),
        "comm_bytes_counted": comm.get("bytes_by_axis", {}),
        "comm_bytes_by_collective": comm.get("bytes_by_collective", {}),
        "compute_dtype": _first(history, "compute_dtype"),
        "allocator_peak_bytes_rank0": peak_process if on_gpu else None,
        "predicted": {
            "comm_bytes": comm.get("analytic_bytes_by_axis", {}),
            "memory_bytes": predicted.memory,
            "planner_comm_bytes": predicted.comm_bytes,
            "step_time_s": predicted.time["step"],
            "time_s": predicted.time,
            "compute_parts_s": predicted.compute_parts,
            "calibrated": calibration is not None,
        },
        "measured_over_predicted": {
            "step_time": step / predicted.time["step"],
            "memory": measured_memory / predicted.memory["total"] if measured_memory else None,
            "memory_measure": "CUDA allocator peak (rank 0)" if on_gpu else "live tensors at step 2's peak (rank 0)",
        },
        "final_loss": history[-1]["loss"],
        "losses": [m["loss"] for m in history],
        # a dense model's rows have no "moe" key at all (not zeros): there is no expert load to report
        **({"moe": moe} if moe is not None else {}),
        **({"profile": {"step": profiled["step"], **profiled["profile"]}} if profiled is not None else {}),
    }


def moe_load(records: list[dict]) -> dict | None:
    """The expert load of the measured steps' records (their "moe" entries, parallel/expert.py's load_report):
    each step's entry with its step number, each layer's median max/mean imbalance over the steps, the worst
    imbalance and the median auxiliary loss. None when the records have none (a dense model)."""
    steps = [{"step": m["step"], **m["moe"]} for m in records if m.get("moe") is not None]
    if not steps:
        return None
    per_layer = list(zip(*(s["imbalance"] for s in steps)))
    return {
        "steps": steps,
        "n_layers": len(per_layer),
        "n_experts": len(steps[0]["tokens_per_expert"][0]),
        "imbalance_median_per_layer": [statistics.median(layer) for layer in per_layer],
        "max_imbalance": max(s["max_imbalance"] for s in steps),
        "aux_loss_median": statistics.median(s["aux_loss"] for s in steps),
        "imbalance_definition": "max / mean of the tokens routed to each expert in a layer, over the whole step "
        "(every rank's tokens); 1.0 is perfectly balanced",
    }


def _efficiency(rows: list[dict]) -> None:
    base = next((r for r in rows if r["ranks"] == 1), rows[0])
    for r in rows:
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        r["speedup_vs_first"] = speedup
        # weak: per-device throughput kept; strong: speedup over the device ratio
        r["scaling_efficiency"] = speedup / (r["devices"] / base["devices"])
