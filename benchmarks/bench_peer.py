"""tessera side by side with torchtitan on one GPU in one call: the same model (torchtitan's llama3 at the 1b
preset's dimensions: benchmarks/peer_torchtitan.py), sequence, batch, activation checkpointing (none) and
compile, bf16 and FP8 rowwise, each through its own trainer; tokens/s of each and tessera / torchtitan.

    python benchmarks/bench_peer.py --out $OUT/peer      # one GPU: bf16 then FP8, tessera then torchtitan
    python benchmarks/bench_peer.py --check              # CPU: what can be checked without a GPU (below)
    python benchmarks/bench_peer.py --smoke --out /tmp/peer  # CPU: every row at the debug preset, eager (plumbing)

torchtitan 0.2.2 is the release that runs on the GPU machines' torch 2.11 (0.3.0 needs a newer torch). The GPU
machine reaches no package index: `bash benchmarks/peer_wheels.sh` downloads its wheels (and torchao's) for
Python 3.12 into build/wheels, which the device call carries and installs with --no-deps first.

Rows: tessera as the GPU suite trains it (gpu_suite_parts.train_row: `tessera train`'s rank, its median step
after the warmup), torchtitan as `python -m torchtitan.train` (one rank, its own log's tps, the median over the
same steps). Ratios: `tessera_over_torchtitan_bf16` and `tessera_over_torchtitan_fp8`, tokens/s over tokens/s.
What differs by each framework's own defaults is recorded, not changed: torchtitan on one GPU applies no FSDP2
(fp32 weights, bf16 autocast) where tessera keeps fp32 masters under FSDP2's bf16 policy; both call cuDNN's
attention first through SDPA's priority.

--check (no GPU): torchtitan imports on this torch; every row's command parses with torchtitan's own config
manager to the values asked; its model at the 1b preset has tessera's parameter shapes; and torchtitan's own
trainer trains the debug preset for a few steps on the CPU, eager, on the peer's synthetic tokens, in bf16 and
through its float8 converter (torchao's float8 emulated; in its tensorwise form, the one torchtitan emulates).
torchtitan takes its device type from the accelerator torch finds, and "cuda" where there is none
(tools/utils.py), so that run is told "cpu" before torchtitan is imported, and torch.cpu gets the few device
calls torchtitan's memory monitor and barrier make (no memory reported held): the plumbing checked, no figure.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import device_slug, write_results  # noqa: E402

PRECISIONS = {"bf16": None, "fp8": "rowwise"}  # torchtitan's float8 recipe for each row's precision
WARMUP = 3  # steps before the timed ones, for both frameworks (the first compiles)
CPU_STEPS = 3  # the checks' run of torchtitan's trainer on the CPU


def check(preset: str = "1b", batch: int = 16, seq_len: int = 2048, train_on_cpu: bool = True) -> dict[str, Any]:
    """What can be checked of the peer without a GPU (module doc); AssertionError naming what differs.
    `train_on_cpu` False: the commands and shapes only (the GPU run's record: seconds of a lease, not minutes)."""
    import importlib.metadata

    import peer_torchtitan as peer  # lazy: imports torchtitan
    import torch
    from torchtitan.config import ConfigManager

    from tessera.models import Llama, get_preset

    parsed = {}
    with tempfile.TemporaryDirectory() as dump:
        for precision in PRECISIONS:
            row = peer.PeerRow(preset, batch, seq_len, 8, compile=True, fp8=PRECISIONS[precision])
            cfg = ConfigManager().parse_args(peer.command_args(row, dump))
            got = dict(
                name=cfg.model.name,
                flavor=cfg.model.flavor,
                batch=cfg.training.local_batch_size,
                seq_len=cfg.training.seq_len,
                compile=cfg.compile.enable and "model" in cfg.compile.components,
                ac=cfg.activation_checkpoint.mode,
                float8=cfg.quantize.linear.float8.recipe_name if cfg.model.converters else None,
            )
            want = dict(
                name=peer.SPEC_NAME, flavor=preset, batch=batch, seq_len=seq_len, compile=True, ac="none",
                float8=row.fp8,
            )  # fmt: skip
            assert got == want, f"torchtitan read the {precision} row as {got}, not {want}"
            parsed[precision] = got
    with torch.device("meta"):
        ours = Llama(get_preset(preset))
    theirs = peer.build_model(preset)
    shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert shapes == sorted(tuple(p.shape) for p in theirs.parameters()), "torchtitan's model differs in shapes"
    trained: dict[str, list[float]] = {}
    for precision, fp8 in PRECISIONS.items() if train_on_cpu else ():
        row = peer.cpu_row("debug", 2, 32, CPU_STEPS, fp8)
        run = torchtitan_row(row, timeout=300.0, on_cpu=True)
        steps = run["steps"]
        assert run["returncode"] == 0 and [s["step"] for s in steps] == list(range(1, CPU_STEPS + 1)), (
            f"torchtitan's trainer on the CPU ({precision}) exited {run['returncode']} after {len(steps)} steps: "
            + run.get("log_tail", "")[-600:]
        )
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps), steps
        assert run["float8_linears"] == (row.fp8 is not None), f"{precision}: float8 linears {run['float8_linears']}"
        trained[precision] = [s["loss"] for s in steps]
    return dict(
        torchtitan=importlib.metadata.version("torchtitan"),
        torch=torch.__version__,
        commands=parsed,
        parameters=sum(p.numel() for p in theirs.parameters()),
        cpu_losses=trained,
    )


def torchtitan_on_cpu(args: list[str]) -> None:
    """torchtitan's trainer on the CPU with `args` (the checks' run: module doc). Its device calls of torch.cpu
    that torch lacks report one device holding nothing."""
    import types

    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan reads it at its import
    for name, fn in dict(
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 34),
        current_device=lambda: 0,  # torch.cpu's is the string "cpu", which a barrier's device_ids refuse
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda *a: None,
        memory_stats=lambda *a: {
            "active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0
        },
    ).items():  # fmt: skip
        setattr(torch.cpu, name, fn)
    # torchtitan's ConfigManager.parse_args reads sys.argv as its default, bound when torchtitan is imported
    sys.argv = ["torchtitan.train", *args]
    import torchtitan.train  # lazy: after the device type and the arguments are set

    torchtitan.train.main(torchtitan.train.Trainer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchtitan_row(row: Any, timeout: float, on_cpu: bool = False) -> dict[str, Any]:
    """One torchtitan run on one rank: its log's steps, the median tps after the warmup, its reserved peak
    (`on_cpu`: through torchtitan_on_cpu, for the checks)."""
    import peer_torchtitan as peer  # lazy: imports torchtitan

    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        entry = [str(HERE / "bench_peer.py"), "--torchtitan-on-cpu"] if on_cpu else ["-m", "torchtitan.train"]
        cmd = [sys.executable, *entry, *peer.command_args(row, dump)]
        began = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            log, returncode = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:  # recorded with what it logged; the next rows still run
            out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
            log, returncode = "".join(out) + f"\n(killed after {timeout:.0f} s)", None
    steps = peer.parse_steps(log)
    # the steps after the warmup, of a run that ended well (a crashed or killed run's figures are not a row's)
    # (steps WARMUP+1 .. the last but one: the ones tessera's row times, its last being profiled)
    timed = [s["tps"] for s in steps if WARMUP < s["step"] < row.steps] if returncode == 0 else []
    out: dict[str, Any] = {
        "command": "python -m torchtitan.train " + " ".join(cmd[1 + len(entry) :]),
        "returncode": returncode,
        "run_seconds": time.perf_counter() - began,
        "steps": steps,
        "tokens_per_s": statistics.median(timed) if timed else None,
        "peak_reserved_gib": max((s["memory_gib"] for s in steps), default=None),
        "float8_linears": "Swapped to Float8Linear layers" in log,  # torchtitan's converter's own log line
    }
    if returncode != 0 or not timed:
        out["log_tail"] = log[-3000:]
    return out


def run_rows(args: argparse.Namespace, precisions: list[str]) -> None:
    """Each precision's tessera row then torchtitan's, the JSON rewritten after each (a killed run keeps the
    rest). `args.smoke`: the debug preset on CPU, eager, torchtitan's FP8 in the tensorwise form it emulates."""
    from gpu_suite import FULL, SMOKE
    from gpu_suite_parts import train_row

    from tessera.metrics.results import BF16_PEAK, device_info

    info = device_info()
    smoke = args.smoke
    peak = None if smoke else next((v for k, v in BF16_PEAK.items() if k in info["device"]), None)
    preset, batch, seq_len = ("debug", 2, 32) if smoke else (args.preset, args.batch, args.seq_len)
    sizes = dict(SMOKE if smoke else FULL, model=preset, seq_len=seq_len, steps=args.steps, warmup=WARMUP)
    results: dict[str, Any] = {"rows": {}}
    config = vars(args) | {"warmup": WARMUP, "preset": preset, "batch": batch, "seq_len": seq_len}
    if not smoke:  # the commands and shapes, recorded; a difference is the record's, not the run's end
        try:
            config["check"] = check(preset, batch, seq_len, train_on_cpu=False)
        except AssertionError as e:
            config["check"] = {"failed": str(e)[:500]}
    name = "peer-torchtitan-smoke-cpu" if smoke else f"peer-torchtitan-{device_slug(info['device'])}"
    for precision in precisions:
        fp8 = PRECISIONS[precision]
        try:
            ours = train_row(sizes, batch, not smoke, smoke, peak, args.timeout, fp8=fp8)
            kept = ("tokens_per_s", "step_time_s", "mfu", "mfu_fp8_peak", "mfu_fp8_blended_peak", "compute_dtype")
            tessera = {k: ours.get(k) for k in (*kept, "final_loss")}
            tessera |= {
                "fp8": fp8,
                "peak_allocated_bytes": ours.get("peak_bytes"),
                "run_seconds": ours.get("run_seconds"),
            }
        except Exception as e:  # noqa: BLE001 - recorded; torchtitan's row still runs
            tessera = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        import peer_torchtitan as peer  # lazy: imports torchtitan

        if smoke:
            row = peer.cpu_row(preset, batch, seq_len, args.steps, fp8)
        else:
            row = peer.PeerRow(preset, batch, seq_len, args.steps, compile=True, fp8=fp8)
        titan = torchtitan_row(row, args.timeout, on_cpu=smoke) | {"fp8": row.fp8}
        ratio = (
            tessera["tokens_per_s"] / titan["tokens_per_s"]
            if tessera.get("tokens_per_s") and titan.get("tokens_per_s")
            else None
        )
        results["rows"][precision] = {"tessera": tessera, "torchtitan": titan}
        results[f"tessera_over_torchtitan_{precision}"] = ratio
        path = write_results(name, config, results, args.out)
        print(
            f"{precision}: tessera {tessera.get('tokens_per_s') or tessera.get('error')}, torchtitan "
            f"{titan['tokens_per_s'] or 'exit ' + str(titan['returncode'])} tokens/s; ratio {ratio} -> {path}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--torchtitan-on-cpu"]:  # the checks' subprocess (torchtitan_row with on_cpu)
        torchtitan_on_cpu(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default="1b", choices=("1b", "debug"), help="tessera's llama preset both train (default 1b)"
    )
    p.add_argument("--batch", type=int, default=16, help="sequences a step (the GPU suite's fit on an H200: 16)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help=f"steps a row; the first {WARMUP} are not timed")
    p.add_argument("--precisions", default="bf16,fp8", help="bf16, fp8 (rowwise) or both, in that order")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a row may take")
    p.add_argument("--check", action="store_true", help="the CPU checks (module doc); no measured rows")
    p.add_argument(
        "--smoke", action="store_true", help="every row at the debug preset on CPU, eager: the plumbing, no figure"
    )
    p.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    precisions = args.precisions.split(",")
    unknown = [x for x in precisions if x not in PRECISIONS]
    if unknown or args.steps <= WARMUP + 1:
        raise SystemExit(
            f"bench_peer: precision {unknown[0]!r} is not one of {', '.join(PRECISIONS)}"
            if unknown
            else f"bench_peer: --steps {args.steps} leaves no timed step after the {WARMUP} warmup steps and "
            f"tessera's profiled last one: use --steps {WARMUP + 2} or more"
        )
    if args.check:
        record = check(args.preset, args.batch, args.seq_len)
        print(
            f"torchtitan {record['torchtitan']} on torch {record['torch']}: both rows' commands read as asked, "
            f"{record['parameters']:,} parameters in tessera's {args.preset} shapes; its trainer on the CPU, "
            + ", ".join(f"{k}: losses {' '.join(f'{x:.3f}' for x in v)}" for k, v in record["cpu_losses"].items())
        )
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_peer: no CUDA device here (torchtitan's trainer runs on CUDA); --check runs on CPU")
    run_rows(args, precisions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
