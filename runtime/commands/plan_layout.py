"""`tessera plan --layout NAME`: a layout the user names, scored beside the ranking or alone (`--top 0`), and
the `tessera train` command that runs a planned layout as planned."""

from __future__ import annotations

import argparse
import json
import shlex
import time

from tessera.topology import Layout
from tessera.topology.memory import GB
from tessera.topology.estimators.muon_memory import MUON_RECIPES
from tessera.topology.estimators.planner import (
    Candidate,
    Estimate,
    Hardware,
    PlanError,
    candidates_of_layout,
    estimate,
    gain_text,
    why_not_runnable,
)
from tessera.training.layout_names import parse_layout


def train_command(model: str, seq_len: int, global_batch: int, x: Estimate, hw: Hardware) -> str:
    """The `tessera train` command that runs a planned layout as planned: the model, sequence and batch, the
    layout's flags, and where the plan's precision or device is not train's default for it (a calibration's
    dtype, a CPU calibration's ranks), those too. Pasted as printed, it trains what the plan ranked."""
    words = ["tessera", "train", "--model", model, "--seq-len", str(seq_len), "--global-batch", str(global_batch)]
    words += x.candidate.flags().split()
    if hw.compile:
        words.append("--compile")
    if hw.recipe in MUON_RECIPES:  # the plan counted Muon's state: train with it
        words += ["--optimizer", "muon"]
    cal = hw.calibration
    if cal is not None:
        if cal.device_type == "cpu":
            words += ["--device", "cpu"]
        default = "bfloat16" if cal.device_type == "cuda" else "float32"  # train's default on that device
        if cal.dtype != default:
            words += ["--mixed-precision", {"bfloat16": "bf16", "float32": "fp32"}[cal.dtype]]
    return shlex.join(words)


def print_alone(args: argparse.Namespace, hw: Hardware, shape, record: dict, started: float) -> int:
    """`--layout L --top 0`: that layout's estimate alone, as JSON (`layout.estimate`) or a few lines."""
    request = {
        "model": args.model,
        "params": shape.num_params(),
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "hardware": None if hw.profile is None else hw.profile.name,
        "efficiency": hw.efficiency,
        "fp8": hw.fp8,
        "compile": hw.compile,
        "async_tp": hw.async_tp,
        "ep_overlap": hw.ep_overlap,
        "ep_over_tp": hw.ep_over_tp,
    }
    if args.json:
        print(
            json.dumps({"request": request, "layout": {"estimate": record}, "seconds": time.perf_counter() - started})
        )
        return 0
    mfu = "-" if record["mfu_bf16"] is None else f"{record['mfu_bf16']:.1%}"
    fp8 = (
        f" (FP8 peak: {record['mfu_fp8']:.1%}, blended: {record['mfu_fp8_blended']:.1%})" if "mfu_fp8" in record else ""
    )
    print(
        f"{args.model} --layout {args.layout} on {hw.describe()}: {record['tokens_per_s_per_gpu']:,.0f} tokens/s "
        f"per GPU, {record['step_time_s']:.3f} s/step, MFU {mfu}{fp8}, {record['peak_memory_gib']:.1f} GiB per GPU "
        f"({'fits' if record['fits'] else 'does not fit: ' + record['overflow']})"
    )
    print("step: " + ", ".join(f"{k} {v:.3f} s" for k, v in record["split_s"].items() if v))
    print("memory: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in record["memory_gib"].items() if v and k != "total"))
    print(f"settings: {record['flags'] or '(one process)'}")
    return 0


def parse_named_layout(text: str, gpus: int):
    """(Layout, fixed settings) of --layout's name (tessera bench's grammar); PlanError naming what is wrong."""
    try:
        flags = parse_layout(text)
    except ValueError as e:  # "layout 'xx': ..."
        raise PlanError(f"--{e}") from None
    dp, dpr = flags.pop("dp", 1), flags.pop("dp_replicate", 1)
    lay = Layout(
        pp=flags.pop("pp", 1),
        dp_replicate=dpr,
        dp_shard=dp // dpr,
        cp=flags.pop("cp", 1),
        tp=flags.pop("tp", 1),
        ep=flags.pop("ep", 1),
    )
    if lay.world_size != gpus:
        raise PlanError(
            f"--layout {text} is {lay.world_size} ranks and --gpus is {gpus}: name a layout of {gpus} ranks"
        )
    return lay, flags  # flags left: sequence_parallel, ac, fsdp, compile, async_tp


def score_layout(
    shape, hw: Hardware, seq_len: int, global_batch: int, result, lay, fixed: dict, model: str | None = None
) -> dict:
    """Where a layout the user names stands: its best settings' rank among every fitting layout and what the
    best gains over it (with the `tessera train` command that runs it: the whole command given the `model`'s
    name, else its layout flags); or why it does not fit (its least-memory settings' shortfall); or why
    tessera would not run it."""

    def keep(c) -> bool:
        return (
            c.sequence_parallel == fixed.get("sequence_parallel", c.sequence_parallel)
            and c.ac == fixed.get("ac", c.ac)
            and c.strategy == fixed.get("fsdp", c.strategy)
        )

    mine = [
        estimate(shape, c, hw, seq_len, global_batch)
        for c in candidates_of_layout(shape, lay, seq_len, global_batch)
        if keep(c)
    ]
    if not mine:
        probe = Candidate(
            lay,
            fixed.get("fsdp", "FULL_SHARD"),
            fixed.get("ac", "none"),
            "1f1b",
            max(1, lay.pp),
            1,
            fixed.get("sequence_parallel"),
        )
        why = (
            why_not_runnable(shape, probe, seq_len, global_batch)
            or "no schedule, microbatch count and setting of it runs"
        )
        return {"fits": False, "rank": None, "verdict": f"tessera would not run it: {why}"}
    fitting = sorted((x for x in mine if x.fits), key=lambda x: (round(x.time["step"], 6), x.memory["total"]))
    if not fitting:
        least = min(mine, key=lambda x: x.memory["total"])
        return {
            "fits": False,
            "rank": None,
            "closest": least.as_dict(),
            "verdict": (
                f"does not fit: its least-memory settings ({least.candidate.describe()}) need "
                f"{least.memory['total'] / GB:.1f} GB per rank against {hw.usable_bytes / GB:.1f} GB usable, short by "
                f"{(least.memory['total'] - hw.usable_bytes) / GB:.1f} GB"
            ),
        }
    ours = fitting[0]
    # its place in the ranking; a layout the ranking leaves out (tp beyond a node) is placed by its time
    place = next(
        (i for i, x in enumerate(result.ranked, 1) if x.candidate == ours.candidate),
        1 + sum(x.time["step"] < ours.time["step"] for x in result.ranked),
    )
    best = result.ranked[0]
    if place == 1:
        verdict = f"ranked 1 of {len(result.ranked)}: it is the best layout ({ours.candidate.describe()})"
    else:
        run = (
            train_command(model, seq_len, global_batch, ours, hw)
            if model is not None
            else f"tessera train {ours.candidate.flags()}"
        )
        if ours.time["step"] <= best.time["step"] * 1.001:  # why_best's tie: no gain worth naming
            gain = "ties with it within 0.1% on time; the layouts ranked above it hold less memory"
        else:
            gain = f"which wins by {gain_text(best, ours)}"
        verdict = (
            f"ranked {place} of {len(result.ranked)} at best ({ours.candidate.describe()}): "
            f"{ours.time['step']:.3f} s/step against {best.time['step']:.3f} s for the best, {gain}; run it with: {run}"
        )
    return {"fits": True, "rank": place, "estimate": ours.as_dict(), "verdict": verdict}
