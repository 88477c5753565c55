"""What a fault costs under --fault-tolerant (torchft on the replicate axis), against today's restart from the
last checkpoint, on CPU ranks: each fault kind planted with TESSERA_FT_DRILL on a run of two replica groups.

Per fault: `survivors_resume_s` (from the fault to the end of the survivors' next applied step), its
`replacement_trains_s` (from the fault to the end of the replacement's first applied step, once it has taken its
peer's state), `survivor_steps_lost` (steps a survivor never applied: goal 0), the state bytes the replacement
received against the predicted size of one rank's state (weights and AdamW's two moments, fp32: 12 B a local
parameter, and the step counts). Beside them, `restart_from_checkpoint`: the same run without fault tolerance
resumed from a checkpoint (what a fault costs today: every rank restarted, the state read from disk, the steps
since the save trained again), its seconds from launch to its first step. One timeline plot: each group's steps
over time, the fault and the rejoin marked.

    python benchmarks/bench_fault_tolerance.py --smoke      # one fault of each kind, debug model, ~2 minutes
    python benchmarks/bench_fault_tolerance.py              # the small preset, longer runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_results  # noqa: E402

FAULTS = {
    "kill_forward": "replica=1,step={k},at=forward",
    "kill_reduce": "replica=1,step={k},at=reduce",
    "stop_straggler": "replica=1,step={k},at=forward,signal=STOP",
    "kill_while_receiving": "replica=1,step={k},at=forward;replica=1,step=1,at=recover,launch=1",
}


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if r.get("type") != "header"]


def run_fault(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tmp = work / kind
    tmp.mkdir()
    log = tmp / "faults.log"
    drill = FAULTS[kind].format(k=args.fault_step) + f",pace={args.pace}"
    env = {**os.environ, "TESSERA_FT_DRILL": drill, "TESSERA_FT_DRILL_LOG": str(log)}
    replacements = "2" if kind == "kill_while_receiving" else "1"
    cmd = [sys.executable, "-m", "tessera", "train", "--model", args.model, "--dp", "2", "--dp-replicate", "2"]
    cmd += ["--fault-tolerant", "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--global-batch", "4"]
    cmd += ["--metrics", str(tmp / "run.jsonl"), "--ft-timeout", str(args.ft_timeout), "--quiet"]
    cmd += ["--ft-replacements", replacements]
    began = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{kind}: the run failed: {out.stderr[-2000:]}")
    fault = float(log.read_text().split()[0])
    survivor, other = records(tmp / "run.jsonl"), records(tmp / "run.replica1.jsonl")
    after = [r for r in survivor if r["replicas"]["ended_unix"] > fault]
    healed = [r for r in other if r["replicas"]["healed"]]
    back = healed[-1] if healed else None
    steps = [r["step"] for r in survivor]
    return {
        "drill": drill,
        "fault_step": args.fault_step,
        "survivors_resume_s": after[0]["replicas"]["ended_unix"] - fault if after else None,
        "replacement_trains_s": back["replicas"]["ended_unix"] - fault if back else None,
        "replacement_rejoined_at_step": back["step"] if back else None,
        "survivor_steps_lost": args.steps - len(set(steps)),
        "survivor_steps_taken_again": sum(r["replicas"]["retries"] for r in survivor),
        "state_bytes_received": back["replicas"]["recovered_bytes"] if back else None,
        "state_bytes_predicted": predicted_state_bytes(args.model),
        "run_s": time.time() - began,
        "timeline": {
            "0": [(r["replicas"]["ended_unix"] - began, r["step"]) for r in survivor],
            "1": [(r["replicas"]["ended_unix"] - began, r["step"]) for r in other],
            "fault_s": fault - began,
        },
    }


def predicted_state_bytes(model: str) -> int:
    """One rank's state as a peer sends it: fp32 weights and AdamW's two moments (12 B a parameter; a group of
    one rank holds them all), each parameter's step count (a 4-byte scalar) and the CPU generator's state."""
    import torch

    from tessera.models import get_preset
    from tessera.models.spec import spec_of

    cfg = get_preset(model)
    params = list(spec_of(cfg).build_model(cfg, device="meta").parameters())
    return sum(12 * p.numel() + 4 for p in params) + torch.get_rng_state().numel()


def restart_from_checkpoint(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Today's path: the same run without fault tolerance, checkpointed every step, restarted from the
    checkpoint of the fault's step: every rank started again and the state read from disk. Its launch to its
    end, less the steps it then trains (their median time each): what the restart itself costs."""
    tmp = work / "restart"
    tmp.mkdir()
    base = [sys.executable, "-m", "tessera", "train", "--model", args.model, "--dp", "2", "--dp-replicate", "2"]
    base += ["--seq-len", str(args.seq_len), "--global-batch", "4", "--quiet", "--steps", str(args.steps)]
    keep = ["--keep-checkpoints", str(args.steps + 1)]  # the fault step's checkpoint kept
    first = subprocess.run([*base, "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "1", *keep],
                           capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
    if first.returncode != 0:
        raise RuntimeError(first.stderr[-2000:])
    metrics = tmp / "resumed.jsonl"
    step_dir = tmp / "ckpt" / f"step_{args.fault_step:08d}"
    began = time.time()
    resumed = subprocess.run([*base, "--resume", str(step_dir), "--metrics", str(metrics)], capture_output=True,
                             text=True, timeout=args.timeout)  # fmt: skip
    if resumed.returncode != 0:
        raise RuntimeError(resumed.stderr[-2000:])
    took = time.time() - began
    steps = records(metrics)
    times = sorted(r["step_time_s"] for r in steps)
    median = times[len(times) // 2]
    return {
        "resumed_run_s": took,
        "steps_trained_after": len(steps),
        "median_step_s": median,
        "restart_overhead_s": took - len(steps) * median,  # every rank restarted and the checkpoint read
        "steps_lost_per_fault": "those since the last save (0 here: saved every step, a save's cost each step)",
    }


def plot(results: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = list(results["faults"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        t = results["faults"][kind]["timeline"]
        for group, style in (("0", "o-"), ("1", "s")):  # group 1: markers (its launches are apart)
            if t[group]:
                xs, ys = zip(*t[group])
                ax.plot(xs, ys, style, markersize=3, label=f"replica group {group}")
        ax.axvline(t["fault_s"], color="red", linewidth=1, label="fault")
        rejoin = results["faults"][kind]["replacement_trains_s"]
        if rejoin is not None:
            ax.axvline(t["fault_s"] + rejoin, color="green", linewidth=1, label="replacement trains")
        ax.set_title(kind.replace("_", " "))
        ax.set_xlabel("seconds since launch")
        ax.set_ylabel("step applied")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one fault of each kind on the debug model (minutes)")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--pace", type=float, default=None, help="seconds every step lasts at least (a real step's)")
    p.add_argument("--ft-timeout", type=float, default=6.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="a directory for the JSON and the plot (default benchmarks/results)")
    args = p.parse_args(argv)
    args.model = args.model or ("debug" if args.smoke else "small")
    args.steps = args.steps or (24 if args.smoke else 150)  # the run outlasts a replacement's start (~5 s)
    args.pace = args.pace if args.pace is not None else (0.4 if args.smoke else 0.0)
    name = f"fault-tolerance-{args.model}-cpu"
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        faults = {kind: run_fault(kind, args, work) for kind in FAULTS}
        baseline = restart_from_checkpoint(args, work)
    results = {"faults": faults, "restart_from_checkpoint": baseline}
    config = {k: getattr(args, k) for k in ("model", "steps", "seq_len", "fault_step", "pace", "ft_timeout")}
    config.update(layout="2 replica groups x dp 1 (dp 2, dp_replicate 2)", lighthouse_heartbeat_timeout_s=2.0)
    path = write_results(name, config, results, args.out)
    plot(results, Path(args.out or RESULTS) / f"{name}.png")
    for kind, r in faults.items():
        print(
            f"{kind}: survivors resume {r['survivors_resume_s']:.2f} s after the fault, the replacement trains "
            f"{r['replacement_trains_s'] or float('nan'):.2f} s after it, survivor steps lost "
            f"{r['survivor_steps_lost']}, state received {r['state_bytes_received']} B "
            f"(predicted {r['state_bytes_predicted']} B)"
        )
    print(f"restart from a checkpoint: {baseline['restart_overhead_s']:.2f} s of restart (every rank, the disk)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
