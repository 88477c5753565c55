"""What a simulated world costs: `tessera check` (every rank of a layout in one process, torch's
LocalTensorMode) at growing world sizes, each in a fresh process, on this machine's CPU. Per layout: the
verdict, the simulated run's seconds split into building the Trainer (mesh, init, FSDP2 and tp) and training,
the one-process run's, the process's peak memory against the estimate it was admitted by, and the model
tessera sized for the layout.

    python benchmarks/bench_simulated_world.py --smoke   # 4 and 64 ranks, about a minute
    python benchmarks/bench_simulated_world.py           # 4, 64, 256 and 512 ranks
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

SMOKE = ["dp2xtp2+sp", "dp16xtp4+sp"]
FULL = [*SMOKE, "dp64", "dp32xtp8+sp", "dp64xtp8+sp"]


def check(layout: str, steps: int, timeout: float) -> dict:
    """`tessera check --layout L --json`'s record, with the command's wall-clock seconds."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "check", "--layout", layout, "--steps", str(steps), "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - started
    if out.returncode not in (0, 1):
        return {"layout": layout, "error": out.stderr.strip().splitlines()[-1:], "wall_seconds": round(wall, 1)}
    record = json.loads(out.stdout)
    record.pop("losses", None), record.pop("one_process_losses", None)
    return {**record, "wall_seconds": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="4 and 64 ranks only")
    parser.add_argument("--layouts", help="comma-separated layout names (default: the sweep)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per layout")
    parser.add_argument("--out", help="a JSON file or a directory (default benchmarks/results/)")
    args = parser.parse_args()
    layouts = args.layouts.split(",") if args.layouts else SMOKE if args.smoke else FULL
    rows = []
    for layout in layouts:
        row = check(layout, args.steps, args.timeout)
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("layout", "world", "simulated_seconds", "peak_rss_bytes")}))
    name = "simulated-world-smoke" if args.smoke else "simulated-world"
    path = write_results(name, {"layouts": layouts, "steps": args.steps}, rows, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
