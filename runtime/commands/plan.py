"""`tessera plan`: ranked layouts for a model on N GPUs, with the per-rank memory breakdown
(topology/estimators/planner.py).

The planner counts with a ModelShape (plain numbers, topology/shapes.py); `model_shape` is where a preset
name or a family's config becomes one (its spec's `shape`), here in the runtime, so topology/ never imports
tessera.models."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tessera.paths import calibration_path, read_calibration
from tessera.topology.estimators.comm_model import ep_over_tp_applies
from tessera.topology.errors import with_flags
from tessera.launching.host_memory import total_bytes
from tessera.topology.memory import GB, gigabytes
from tessera.topology.estimators.muon_memory import MUON_RECIPES, recipe_for
from tessera.topology.hardware import (
    load_profile,
    with_calibration,
)
from tessera.topology.estimators.planner import (
    Estimate,
    Hardware,
    PlanError,
    plan,
)
from tessera.topology.preset_shapes import preset_shape
from tessera.topology.estimators.scoring import estimate_record, score_one
from tessera.topology.estimators.step_time import Calibration, find_entry
from tessera.training.run_config import said
from tessera.commands.plan_layout import parse_named_layout, print_alone, score_layout, train_command


def model_shape(model):
    """The ModelShape of a preset name, a family's config or a ModelShape (models/spec.py's shape_of),
    imported when called: the planner's own modules load no torch."""
    if isinstance(model, str) and not model.startswith("hf:"):
        known = preset_shape(model)  # the presets' table: no torch to import
        if known is not None:
            return known
    from tessera.models.spec import shape_of  # lazy: tessera.models imports torch; `tessera plan` stays torch-free

    if isinstance(model, str) and model.startswith("hf:"):  # a Hugging Face config.json, read by its family
        from tessera.models.hf import read_hf_config  # lazy: as above

        return shape_of(read_hf_config(model[3:], flag="--model hf:"))
    return shape_of(model)


MAX_GPUS = 1 << 22  # 4,194,304: beyond any cluster; the layouts of more take the planner minutes to enumerate

MEMORY_COLUMNS = (
    ("states", ("parameters", "gradients", "optimizer")),
    ("gathered", ("gathered_params",)),
    ("acc.grads", ("unsharded_grads",)),
    ("activ.", ("activations",)),
    ("logits", ("logits",)),
    ("buffers", ("buffers",)),
    ("total", ("total",)),
)


def _row(rank: int, x: Estimate) -> str:
    mem = "".join(f"{gigabytes(sum(x.memory[k] for k in keys)):>10}" for _, keys in MEMORY_COLUMNS)
    mfu = "-" if x.mfu is None else f"{x.mfu:.1%}"  # no peak to measure it against (a calibration alone)
    return f"{rank:>3}  {x.candidate.describe():<76}{mem}{x.time['step']:>9.3f}{x.tokens_per_s:>12,.0f}{mfu:>7}"


def run_plan(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.calibrate:
        return _calibrate(args)
    try:
        if args.top < 0:
            raise PlanError(f"--top {args.top} must be at least 1 (or 0 with --layout: that layout alone)")
        missing = [f"--{n.replace('_', '-')}" for n in ("gpus", "seq_len", "global_batch") if getattr(args, n) is None]
        if missing:
            raise PlanError(f"{', '.join(missing)} required (or --calibrate to measure this device)")
        if args.gpus > MAX_GPUS:  # the planner walks the divisors of the GPU count: 10^12 of them would never end
            raise PlanError(
                f"--gpus {args.gpus:,} is more than the planner enumerates (at most {MAX_GPUS:,}); plan a smaller job"
            )
        calibration, dtype_bytes = _calibration(args)
        named = parse_named_layout(args.layout, args.gpus) if args.layout else None
        fixed = named[1] if named else {}
        if (args.microbatches, args.schedule, args.virtual) != (None, None, None) and named is None:
            raise PlanError("--microbatches, --schedule and --virtual fix a setting of --layout's layout; name one")
        if named is not None:
            lay = named[0]
            if args.virtual is not None and args.virtual < 1:
                raise PlanError(f"--virtual {args.virtual} must be at least 1 (stages per pp rank)")
            if lay.pp == 1 and (args.schedule is not None or args.virtual is not None):
                raise PlanError(
                    f"--schedule and --virtual set the pipeline, and --layout {args.layout} has none (pp 1); "
                    f"drop them or name a layout with pp"
                )
            if fixed.get("async_tp") and lay.tp == 1:
                raise PlanError(f"--layout {args.layout}: +async_tp overlaps tensor-parallel traffic, and tp is 1")
            if fixed.get("ep_overlap") and lay.ep == 1:
                raise PlanError(f"--layout {args.layout}: +ep_overlap overlaps expert all-to-alls, and ep is 1")
            if fixed.get("ep_over_tp") and not ep_over_tp_applies(lay, fixed.get("sequence_parallel", False)):
                raise PlanError(
                    f"--layout {args.layout}: +ep_over_tp folds tp into the expert group, which needs ep > 1, "
                    f"tp > 1 and +sp (each rank dispatches its sequence shard): ep={lay.ep}, tp={lay.tp}"
                )
        if args.top == 0 and named is None:
            raise PlanError("--top 0 scores --layout's layout alone; name one, or show at least one layout")
        profile = load_profile(args.hardware)
        if args.calibration_overlay is not None:
            if args.device_kind is not None:
                raise PlanError(
                    "--device-kind plans with a calibration's own step model and --calibration-overlay overlays one "
                    "on --hardware's profile: give one of them"
                )
            data = read_calibration(_calibration_file(args))
            profile = with_calibration(profile, find_entry(data, args.calibration_overlay, "bfloat16"))
        loose = dict(
            gpu_memory_gb=args.gpu_memory,
            gpus_per_node=args.gpus_per_node,
            peak_tflops=args.peak_tflops,
            efficiency=args.efficiency,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            hbm_gbps=args.hbm_gbps,
        )
        settings = {k: v for k, v in loose.items() if v is not None}
        if calibration is not None:  # a calibration measures rates, not a peak: MFU only against a given one
            settings["peak_tflops"] = args.peak_tflops
        host = total_bytes() if calibration is not None and calibration.device_type == "cpu" else None
        if host is not None and args.gpus >= 1 and args.gpu_memory is None:
            # CPU ranks hold what this host holds, shared by the ranks on it, not the GPU profile's HBM
            settings["gpu_memory_gb"] = host / GB / min(args.gpus, args.gpus_per_node or profile.gpus_per_node)
        hw = Hardware.from_profile(  # its ValueErrors name its parameters (efficiency=5): said() writes the flags
            profile,
            args.gpus,
            headroom=args.headroom,
            calibration=calibration,
            dtype_bytes=dtype_bytes,
            recipe=recipe_for(dtype_bytes, args.optimizer),
            fp8=args.fp8,
            compile=args.compile or bool(fixed.pop("compile", False)),
            async_tp=bool(fixed.pop("async_tp", False)),
            ep_overlap=bool(fixed.pop("ep_overlap", False)),
            ep_over_tp=bool(fixed.pop("ep_over_tp", False)),
            attention=args.attention,
            ac_policy=args.ac_policy,
            fault_tolerant=args.fault_tolerant,
            **settings,
        )
        shape = model_shape(args.model)
        if named is not None:
            scored_alone = score_one(
                shape,
                hw,
                args.seq_len,
                args.global_batch,
                named[0],
                strategy=fixed.get("fsdp"),
                ac=fixed.get("ac"),
                sequence_parallel=fixed.get("sequence_parallel"),
                schedule=args.schedule,
                virtual=args.virtual,
                microbatches=args.microbatches,
                offload=args.offload,
            )
            alone = estimate_record(scored_alone, hw, shape, args.seq_len, args.global_batch)
        if args.top == 0:
            return print_alone(args, hw, shape, alone, started)
        result = plan(shape, hw, args.seq_len, args.global_batch, top=None, name=args.model, offload=args.offload)
        scored = (
            score_layout(shape, hw, args.seq_len, args.global_batch, result, named[0], fixed, model=args.model)
            if named
            else None
        )
        if scored is not None:  # the planner's reasons name its parameters (seq_len=1023): say the flags
            scored["verdict"] = with_flags(scored["verdict"], getattr(args, "flags", {}))
            scored["estimate"] = alone  # the layout with the settings given, as `--top 0` scores it
        result.ranked = result.ranked[: args.top]
    except ValueError as e:  # PlanError and an unknown preset
        print(f"tessera plan: error: {said(e, args)}", file=sys.stderr)
        return 2
    best = result.ranked[0]
    dry = _dry_run(args.model, best) if args.dry_run else None

    def command(x: Estimate) -> str:
        fp8 = f" --fp8 {args.fp8}" if args.fp8 else ""
        return train_command(args.model, args.seq_len, args.global_batch, x, hw) + fp8

    if args.json:
        best_ep = (
            None
            if result.best_ep is None
            else {"rank": result.best_ep[0], **result.best_ep[1].as_dict(), "command": command(result.best_ep[1])}
        )
        print(
            json.dumps(
                {
                    "request": result.request,
                    "considered": result.considered,
                    "why": with_flags(result.why, getattr(args, "flags", {})),
                    "ranked": [{**x.as_dict(), "command": command(x)} for x in result.ranked],
                    "best_ep": best_ep,
                    "dry_run": dry,
                    **({"layout": scored} if scored is not None else {}),
                    "seconds": time.perf_counter() - started,
                }
            )
        )
        return 0
    print(
        f"{args.model} on {hw.describe()}, seq {args.seq_len}, "
        f"global batch {args.global_batch}: {len(result.ranked)} of {result.considered} layouts shown "
        f"(ranked by estimated step time; GB per rank)"
    )
    print(
        f"{'':>3}  {'layout':<76}"
        + "".join(f"{name:>10}" for name, _ in MEMORY_COLUMNS)
        + f"{'s/step':>9}{'tokens/s':>12}{'MFU':>7}"
    )
    for i, x in enumerate(result.ranked, 1):
        print(_row(i, x))
    if result.best_ep is not None and result.best_ep[0] > len(result.ranked):  # an MoE model's best with ep
        place, x = result.best_ep
        print(_row(place, x))
        print(f"best with expert parallel (ranked {place}): {command(x)}")
    print(f"best: {command(best)}")
    print(f"why: {with_flags(result.why, getattr(args, 'flags', {}))}")
    if scored is not None:
        print(f"--layout {args.layout}: {scored['verdict']}")
    if hw.calibration is None and hw.profile is not None:
        compute = (
            f"{hw.profile.name}'s datasheet ({hw.peak_tflops:g} TFLOP/s bf16 dense, MFU against it) at the kernels' "
            f"achieved shares (topology/hardware_profiles.json) and a software efficiency of {hw.efficiency:g}"
            + (", compiled blocks" if hw.compile else "")
            + (", async TP" if hw.async_tp else "")
        )
    elif hw.calibration is None:
        compute = f"{hw.efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s (MFU against that peak)"
    else:
        cal = hw.calibration
        at = f" at {cal.measured_rows} x {cal.measured_seq_len} tokens a microbatch" if cal.measured_rows else ""
        compute = f"the rates measured on {cal.device_kind} ({cal.dtype}){at}" + (
            " (no MFU: a calibration measures rates, not a peak; --peak-tflops gives one)"
            if hw.peak_tflops is None
            else f" (MFU against --peak-tflops {hw.peak_tflops:g})"
        )
    if hw.recipe in MUON_RECIPES:
        precision = (
            "bf16 compute, fp32 master weights, Muon's momentum on the matrices (12 B/parameter) and Adam's two "
            "moments on the rest (16 B), an owner's gathered matrix at the step"
            if hw.dtype_bytes == 2
            else "fp32 compute, Muon on the matrices and Adam on the rest"
        )
    else:
        precision = (
            "bf16 compute, fp32 master weights and Adam (16 B/parameter)"
            if hw.dtype_bytes == 2
            else "fp32 compute and Adam"
        )
    print(
        f"assumptions: {compute}, {hw.intra_node_gbps:g} GB/s in a node, "
        f"{hw.inter_node_gbps:g} GB/s across nodes, "
        f"{f'experts streamed at {hw.hbm_gbps:g} GB/s, ' if result.request['experts'] else ''}"
        f"{args.headroom:.0%} memory headroom, "
        f"{precision}, "
        + (
            f"FP8 ({args.fp8}) matmuls on the linear layers at the FP8 peak's share (rowwise at the profile's "
            f"rowwise speedup) with their casts' memory traffic, "
            if args.fp8
            else ""
        )
        + (
            "recompute as step_model.py reruns it (full: every forward; op: the elementwise forward)"
            if hw.profile is not None and hw.calibration is None
            else "--ac op's recompute at 3% of the step"
        )
    )
    if hw.async_tp:
        print(
            "note: +async_tp plans the tp collectives overlapped with the matmuls (torchtitan's, Megatron's); "
            "tessera train runs them synchronously, so the commands above run vanilla TP"
        )
    if dry is not None:
        for r in dry["ranks"]:
            print(
                f"dry run, rank {r['rank']} (pp stages {r['stages']}): {r['local_params']:,} parameters "
                f"({r['tp_local_params']:,} before FSDP), model states {r['model_state_bytes'] / GB:.2f} GB"
            )
        most = max(r["model_state_bytes"] for r in dry["ranks"])
        estimated = sum(best.memory[k] for k in ("parameters", "gradients", "optimizer"))
        print(
            f"model states of the rank holding the most: {most / GB:.3f} GB counted, {estimated / GB:.3f} GB estimated"
        )
        print(f"dry run took {dry['seconds']:.1f} s")
    return 0


def _calibration(args: argparse.Namespace):
    """(the Calibration of --device-kind from the calibration file, or None; the compute dtype's bytes)."""
    if args.device_kind is None:
        return None, 2

    precision = getattr(args, "mixed_precision", None)
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision] if precision else None
    path = _calibration_file(args)
    try:
        data = read_calibration(path)
    except OSError as e:
        raise PlanError(
            f"--calibration {path} cannot be read ({e.strerror}); name the file tessera plan --calibrate wrote"
        ) from None
    entry = find_entry(data, args.device_kind, dtype)
    calibration = Calibration.from_entry(entry)
    return calibration, 4 if calibration.dtype == "float32" else 2


def _calibration_file(args: argparse.Namespace):
    """--calibration's path (default $TESSERA_CALIBRATION or ~/.cache/tessera/calibration.json); PlanError naming
    it when it is a directory (found by the fuzz: an IsADirectoryError escaped from reading it)."""
    path = Path(args.calibration) if args.calibration else calibration_path()
    if path.is_dir():
        raise PlanError(
            f"--calibration {path} is a directory; name the calibration file (e.g. {path}/calibration.json)"
        )
    return path


def _calibrate(args: argparse.Namespace) -> int:
    """Measure this device at the model's shapes and store the figures (tessera/calibrate.py)."""
    started = time.perf_counter()
    try:
        from tessera.models import get_preset  # lazy: torch (tessera.models), only when --calibrate measures

        cfg = get_preset(args.model)
        seq_len = args.seq_len or min(1024, cfg.max_seq_len)
        rows = args.global_batch or 1
        if seq_len < 1 or rows < 1 or args.threads < 1:
            raise PlanError(f"--seq-len {seq_len}, --global-batch {rows} and --threads {args.threads} must be positive")
        if args.threads > 1 << 16:  # torch.set_num_threads would fail with "Overflow when unpacking long"
            raise PlanError(f"--threads {args.threads:,} is more threads than torch takes; use this machine's cores")
        import torch  # lazy: --calibrate alone needs torch; the rest of `tessera plan` is torch-free

        path = _calibration_file(args)  # before minutes of measuring
        if args.device == "cuda" and not torch.cuda.is_available():
            raise PlanError(
                "--device cuda: torch sees no CUDA GPU here; calibrate on the GPU machine or use --device cpu"
            )
        device = torch.device(
            "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
        )
        dtype = args.mixed_precision or ("bf16" if device.type == "cuda" else "fp32")
        if device.type == "cpu":
            torch.set_num_threads(args.threads)
        from tessera.commands.calibrate import describe, measure, save  # lazy: tessera.commands.calibrate imports torch

        entry = measure(cfg, seq_len, rows, device, dtype, quick=args.quick)
        try:
            path = save(entry, path)
        except OSError as e:
            raise PlanError(f"--calibration {path} cannot be written ({e.strerror}); name a writable file") from None
    except (ValueError, OSError) as e:
        print(f"tessera plan: error: {said(e, args)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": str(path), "entry": entry, "seconds": time.perf_counter() - started}))
        return 0
    print(
        f"calibrated {describe(entry)}; measured at {args.model}'s shapes, {rows} x {seq_len} tokens, in "
        f"{entry['seconds']:.1f} s"
    )
    print(f"wrote {path}: plan with it by tessera plan ... --device-kind {entry['device_kind'].split(',')[0]!r}")
    return 0


def _dry_run(model: str, best: Estimate) -> dict:
    """Build the top layout on the fake backend for pp rank 0 and the last pp rank (they hold the
    embedding and the head) and count their parameters exactly."""
    # lazy: tessera.parallel imports torch; only --dry-run builds the layout
    from tessera.parallel.parallelize import dry_run_model_states
    from tessera.parallel.pipeline import PipelineConfig

    started = time.perf_counter()
    c = best.candidate
    lay = c.layout
    ranks = sorted({0, lay.rank_of({"pp": lay.pp - 1})})
    out = []
    for rank in ranks:
        m = dry_run_model_states(
            model,
            lay,
            "mixed_adam",
            c.strategy,
            c.sequence_parallel,
            rank=rank,
            pipeline=PipelineConfig(schedule=c.schedule, microbatches=c.microbatches, virtual=c.virtual),
        )
        out.append(
            {
                "rank": rank,
                "stages": m["stages"],
                "local_params": int(m["local_params"]),
                "tp_local_params": int(m["tp_local_params"]),
                "model_state_bytes": m["total"],
            }
        )
    return {"ranks": out, "seconds": time.perf_counter() - started}
