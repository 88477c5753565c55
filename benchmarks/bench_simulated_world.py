"""What a simulated world costs and what it proves: `tessera check` (every rank of a layout in one process,
torch's LocalTensorMode) at growing world sizes, each in a fresh process, on this machine's CPU. Per layout:
the verdict, the simulated run's seconds split into building the Trainer (mesh, init, FSDP2 and tp) and
training, the process's peak memory against the estimate it was admitted by, and the model tessera sized for
the layout. `--published`: every distinct layout of benchmarks/published/runs.json (torchtitan's and
Megatron-Bridge's multi-GPU runs) with its pipeline schedule and virtual stages, each proved or refused with
the reason; a pipeline runs the fewest microbatches its schedule needs (the published runs' 8-512 would only
repeat the same messages).

    python benchmarks/bench_simulated_world.py --smoke      # 4 and 64 ranks, about a minute
    python benchmarks/bench_simulated_world.py              # 4 to 1,024 ranks
    python benchmarks/bench_simulated_world.py --published  # the published runs' layouts
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

SMOKE = ["dp2xtp2+sp", "dp16xtp4+sp"]
FULL = [*SMOKE, "dp64", "dp32xtp8+sp", "dp64xtp8+sp", "pp8xdp16xtp8"]


PUBLISHED = Path(__file__).resolve().parent / "published" / "runs.json"


def published_layouts() -> dict[str, list[str]]:
    """Each distinct multi-GPU layout of the published runs, with its pipeline as `tessera check` takes it
    ("pp8xdp8xtp8+sp --schedule interleaved-1f1b --virtual 2") -> the ids of the runs that used it."""
    out: dict[str, list[str]] = {}
    for row in json.loads(PUBLISHED.read_text())["rows"]:
        if row["gpus"] > 1:
            pipeline = f" --schedule {row['schedule']} --virtual {row['virtual']}" if "pp" in row["layout"] else ""
            out.setdefault(row["layout"] + pipeline, []).append(row["id"])
    return out


def cost(layout: str) -> tuple[int, int]:
    """The order a sweep runs layouts in, cheapest first: (world size, virtual stages)."""
    name, *options = layout.split()
    # ep divides the data axis's ranks (dp16xep16 is 16 ranks), so it is no factor of the world
    world = math.prod(
        int(d) for axis, d in re.findall(r"([a-z_]+?)(\d+)", name.split("+")[0].replace("x", " ")) if axis != "ep"
    )
    virtual = int(options[options.index("--virtual") + 1]) if "--virtual" in options else 1
    return world, virtual


def check(layout: str, steps: int, timeout: float) -> dict:
    """`tessera check --layout L --json`'s record, with the command's wall-clock seconds (`layout` may carry
    the pipeline's options after it)."""
    started = time.perf_counter()
    name, *options = layout.split()
    command = [sys.executable, "-m", "tessera", "check", "--layout", name, *options, "--steps", str(steps), "--json"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # stated, not dropped: the sweep goes on to the next layout
        return {"layout": layout, "timed_out": f"no verdict within {timeout:.0f} s", "wall_seconds": round(timeout, 1)}
    wall = time.perf_counter() - started
    if out.returncode not in (0, 1):  # refused (exit 2): its one line says why
        why = (out.stderr.strip().splitlines() or [""])[-1].removeprefix("tessera check: error: ")
        return {"layout": layout, "refused": why, "wall_seconds": round(wall, 1)}
    record = json.loads(out.stdout)
    record.pop("losses", None), record.pop("one_process_losses", None)
    return {**record, "wall_seconds": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="4 and 64 ranks only")
    parser.add_argument("--layouts", help="comma-separated layout names (default: the sweep)")
    parser.add_argument("--published", action="store_true", help="the published runs' layouts")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per layout")
    parser.add_argument("--out", help="a JSON file or a directory (default benchmarks/results/)")
    args = parser.parse_args()
    runs = published_layouts() if args.published else {}
    layouts = (
        args.layouts.split(",") if args.layouts else sorted(runs, key=cost) if runs else SMOKE if args.smoke else FULL
    )
    name = (
        "simulated-world-published" if args.published else "simulated-world-smoke" if args.smoke else "simulated-world"
    )
    rows = []
    for layout in layouts:
        row = {**check(layout, args.steps, args.timeout), "checked": layout}
        row.update({"runs": runs[layout]} if layout in runs else {})
        rows.append(row)
        keys = ("checked", "world", "simulated_seconds", "peak_rss_bytes", "refused", "timed_out")
        print(json.dumps({k: row[k] for k in keys if k in row}), flush=True)
        # written after every layout: a sweep of hours keeps what it proved if it is stopped
        path = write_results(name, {"layouts": layouts, "steps": args.steps, "timeout_s": args.timeout}, rows, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
