"""The GPU suite's PNGs, each drawn after the part that feeds it and renamed into place whole:
<stem>-train.png (eager, baseline, compiled), <stem>-attention.png (kernels), <stem>-planner.png (planner)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

FEEDS = {"eager": "train", "baseline": "train", "compiled": "train", "kernels": "attention", "planner": "planner"}


def plots(results: dict[str, Any], stem: Path, part: str) -> list[Path]:
    """Redraw the PNG `part` feeds (none for the others); returns the paths written."""
    kind = FEEDS.get(part)
    if kind is None:
        return []
    try:
        import matplotlib  # lazy: optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend
    except ImportError:
        print(
            "matplotlib is not installed (pip install -e '.[bench]' in the tessera clone): JSON only, no plots",
            file=sys.stderr,
        )
        return []
    fig = {"train": _train, "attention": _attention, "planner": _planner}[kind](plt, results)
    if fig is None:
        return []
    path = stem.with_name(f"{stem.name}-{kind}.png")
    tmp = path.with_name(f".{path.name}.tmp")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return [path]


def _train(plt, results: dict[str, Any]):
    rows = []
    for mode, label in (("eager", "tessera eager"), ("compiled", "tessera --compile")):
        part = results.get(mode) or {}
        if part.get("row"):
            rows.append((label, part["row"]))
        base = part.get("baseline", {}).get("row") if mode == "compiled" else None
        if base:
            rows.append(("plain torch, compiled", base))
    base = (results.get("baseline") or {}).get("row")
    if base:
        rows.insert(1 if rows else 0, ("plain torch, eager", base))
    if not rows:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{label}, batch {r['global_batch']}" for label, r in rows]  # one line each, on the y axis
    a1.barh(range(len(rows)), [r["tokens_per_s"] for _, r in rows], color="tab:blue")
    a1.set_yticks(range(len(rows)), labels, fontsize=8)
    a1.invert_yaxis()
    a1.set(xlabel="tokens/s", title=f"{results['sizes']['model']} at seq {results['sizes']['seq_len']}")
    eager = (results.get("eager") or {}).get("row")
    profile = (eager or {}).get("profile")
    if profile:  # where the eager step's time went: what to fix next
        shares = sorted(profile["time_s"].items(), key=lambda kv: -kv[1])
        a2.barh([k.replace("_", " ") for k, _ in shares], [v * 1e3 for _, v in shares], color="tab:orange")
        a2.invert_yaxis()
        a2.set(xlabel="ms of the profiled step", title=f"eager step {profile['step']}: time by kind")
    else:
        a2.set_axis_off()
    return fig


def _attention(plt, results: dict[str, Any]):
    attention = (results.get("kernels") or {}).get("attention") or []
    if not attention:
        return None
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
    seqs = sorted({r["seq_len"] for r in attention})
    ax.set_xticks(seqs, [str(x) for x in seqs])  # the sequences measured, as numbers: not 10^1, 10^2
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return fig


def _planner(plt, results: dict[str, Any]):
    check = (results.get("planner") or {}).get("rows") or []
    if not check:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [c["predicted_step_s"] for c in check]
    ys = [c["measured_step_s"] for c in check]
    for i, c in enumerate(check):  # a legend, not labels beside the points: rows that measure alike overlap
        a1.scatter(c["predicted_step_s"], c["measured_step_s"], color=f"C{i}", marker="osD^v"[i % 5], label=c["row"])
    a1.legend(fontsize=8)
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    a1.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    a1.set(xlabel="predicted step (s)", ylabel="measured step (s)", title="planner: step time")
    a2.bar(range(len(check)), [c["memory_ratio"] or 0 for c in check], color=[f"C{i}" for i in range(len(check))])
    a2.set_xticks(range(len(check)), [c["row"] for c in check], fontsize=8)
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set(ylabel="measured / predicted", title="planner: peak memory")
    return fig
