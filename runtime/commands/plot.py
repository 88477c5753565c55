"""`tessera plot RUN.jsonl [RUN2.jsonl ...] --out FILE.png`: the loss and throughput curves of one or several
runs' metrics files (`tessera train --metrics`), each run labelled by the layout its header records, so that two
layouts (or two optimizers) compare in one figure. Torch-free: it reads JSON and draws with matplotlib (the
bench extra)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.topology import Layout


@dataclass
class Run:
    """One metrics file: its label and, by step, the last record written for that step."""

    path: Path
    label: str
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)


def _number(value: Any) -> float:
    """A record's number; null (a non-finite value, a skipped step's loss) as NaN: a gap in the curve."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def layout_label(header: dict[str, Any]) -> str:
    """The layout a header records, as the run's lines name it ('one process', 'pp2xdp_shard2', with sequence
    parallel and a non-default optimizer said)."""
    layout = Layout(**header["layout"])
    config = header.get("config") or {}
    text = "one process" if layout.world_size == 1 else str(layout)
    if (config.get("parallel") or {}).get("sequence_parallel") and layout.tp > 1:
        text += " + sequence parallel"
    optimizer = (config.get("optimizer") or {}).get("optimizer")
    return text + (f", {optimizer}" if optimizer and optimizer != "adamw" else "")


def starts_a_run(header: dict[str, Any]) -> bool:
    """Whether a header begins a run of its own: a new run (not a --resume, not a restart after a failure). A
    resume and a restart continue the run before them in the same file."""
    resume = ((header.get("config") or {}).get("checkpoint") or {}).get("resume")
    return resume is None and not header.get("restart")


def read_runs(path: Path) -> list[Run]:
    """Each run of a metrics file (`read_run` of each, split where a header `starts_a_run`): a file two new runs
    were written into (before tessera refused that) holds two curves, not one."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist (or is not a file); give a metrics file of tessera train --metrics")
    lines = path.read_text(errors="replace").splitlines()
    starts = [0]
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # read_run names it
        if number and isinstance(record, dict) and record.get("type") == "header" and starts_a_run(record):
            starts.append(number)
    if len(starts) == 1:
        return [read_run(path)]
    runs = []
    for i, (a, b) in enumerate(zip(starts, starts[1:] + [len(lines)]), 1):
        run = read_run(path, lines[a:b], first_line=a + 1)
        run.label = f"{run.label} (run {i} of {len(starts)} in {path.name})"
        runs.append(run)
    return runs


def read_run(path: Path, lines: list[str] | None = None, first_line: int = 1) -> Run:
    """A metrics file's curves (or those of its `lines`, numbered from `first_line`); ValueError in one line when
    it is missing or not a tessera metrics file."""
    if lines is None:
        if not path.is_file():
            raise ValueError(
                f"{path} does not exist (or is not a file); give a metrics file of tessera train --metrics"
            )
        lines = path.read_text(errors="replace").splitlines()
    headers: list[dict[str, Any]] = []
    by_step: dict[int, dict[str, Any]] = {}
    last = first_line + len(lines) - 1
    for number, line in enumerate(lines, first_line):
        try:
            record = json.loads(line)
        except ValueError:
            if number == last and headers:  # a last line cut short by a killed writer
                break
            raise ValueError(
                f"{path} line {number} is not JSON: not a tessera metrics file (tessera train --metrics writes one)"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} is not a JSON object: not a tessera metrics file")
        if record.get("type") == "header" and isinstance(record.get("layout"), dict):
            headers.append(record)
        elif isinstance(record.get("step"), int) and "loss" in record:
            by_step[record["step"]] = record  # a restart repeats steps: the last one written counts
        else:
            raise ValueError(f"{path} line {number} is neither a header nor a step record of tessera train --metrics")
    if not headers:
        raise ValueError(f"{path} has no header record: not a tessera metrics file (tessera train --metrics FILE)")
    if not by_step:
        raise ValueError(f"{path} has no step records (the run stopped before its first step)")
    try:
        labels = list(dict.fromkeys(layout_label(h) for h in headers))  # a resume on another layout: both
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its header's layout is not one tessera records ({e})") from None
    run = Run(path, " -> ".join(labels))
    for step in sorted(by_step):
        record = by_step[step]
        run.steps.append(step)
        run.loss.append(_number(record.get("loss")))
        run.tokens_per_s.append(_number(record.get("tokens_per_s")))
        if record.get("eval_loss") is not None:
            run.eval_loss.append((step, _number(record["eval_loss"])))
    return run


def plot(runs: list[Run], out: Path) -> Path:
    """Loss (and eval loss, dashed) and tokens/s by step, one colour per run; ImportError without matplotlib."""
    import matplotlib  # lazy: matplotlib is optional (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: (as above) after choosing the Agg backend

    labels = [r.label for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for i, run in enumerate(runs):
        # two runs of one layout are told apart by their files
        label = run.label if labels.count(run.label) == 1 else f"{run.label} ({run.path.name})"
        color = f"C{i % 10}"
        ax1.plot(run.steps, run.loss, color=color, label=label)
        if run.eval_loss:
            ax1.plot(*zip(*run.eval_loss), color=color, ls="--", marker="o", ms=3, label=f"{label}: eval")
        ax2.plot(run.steps, run.tokens_per_s, color=color, label=label)
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


FORMATS = (
    "png",
    "pdf",
    "svg",
    "jpg",
    "jpeg",
    "eps",
    "ps",
    "tif",
    "tiff",
    "webp",
)  # matplotlib's Agg and vector backends


def _plot(args: argparse.Namespace) -> int:
    def error(message: str) -> int:
        print(f"tessera plot: error: {message}", file=sys.stderr)
        return 2

    try:
        runs = [run for p in args.runs for run in read_runs(Path(p))]
    except ValueError as e:
        return error(str(e))
    out = Path(args.out) if args.out else Path(args.runs[0]).with_suffix(".png")
    if not out.suffix:  # matplotlib writes FILE.png for a FILE without a suffix: say the file it writes
        out = out.with_name(out.name + ".png")
    if out.suffix.lower().lstrip(".") not in FORMATS:
        return error(
            f"--out {out}: matplotlib writes no {out.suffix} figure; end it in {', '.join('.' + f for f in FORMATS)}"
        )
    try:
        plot(runs, out)
    except ImportError:
        return error(
            "tessera plot draws with matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[bench]' in the tessera clone)"
        )
    except OSError as e:
        return error(f"--out {out} cannot be written ({e.strerror or e}); choose a writable path")
    print(f"wrote {out}: loss and tokens/s of {len(runs)} run{'s' if len(runs) > 1 else ''} by step")
    return 0


def add_plot_parser(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="loss and throughput curves of one or several runs' metrics files (needs matplotlib)",
        description="Draw the loss and tokens/s of each run by step from the metrics files tessera train --metrics "
        "writes, one colour per run, each labelled by the layout its header records, so that layouts or optimizers "
        "compare in one figure.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="metrics files of tessera train --metrics")
    p.add_argument("--out", default=None, metavar="FILE.png", help="the figure (default: the first RUN with .png)")
    p.set_defaults(func=_plot)
