"""The planner against published multi-GPU runs: every row of benchmarks/published/runs.json (torchtitan's and
Megatron-Bridge's own tables, and the lent H200's rows of this repository; sources named in the file) predicted
from its hardware profile, model, layout, batch, sequence and techniques, and printed side by side with the
published figures and the error.

One software-efficiency constant per source (a framework's distance from the kernels' rates the profiles
state, topology/estimators/step_model.py) is fitted on that source's one named anchor row, so that the anchor is
predicted exactly; every other figure of the model is held fixed across rows. No row has a constant of its own.

    python benchmarks/bench_published.py                 # writes results/published.json and published.png
    python benchmarks/bench_published.py --out DIR       # another folder
    python benchmarks/bench_published.py --rows tt-t1-8b-fsdp8,at-8b-64-bf16   # some rows (their anchors too)

Each row of the JSON holds published_tokens_per_s_per_gpu, predicted_tokens_per_s_per_gpu, published_memory_gib,
predicted_memory_gib, anchor (true on the row its source's constant was fitted on), the error of each, the
estimate's split, and the assumptions the row makes where its source is silent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.commands.plan import model_shape  # noqa: E402
from tessera.commands.plan_layout import parse_named_layout  # noqa: E402
from tessera.topology.errors import PlanError  # noqa: E402
from tessera.topology.hardware import load_profile  # noqa: E402
from tessera.topology.estimators.planner import Hardware, gain_text, plan  # noqa: E402
from tessera.topology.estimators.scoring import estimate_record, score_one  # noqa: E402

RUNS = Path(__file__).resolve().parent / "published" / "runs.json"
NAME = "published"


def layout_of(row: dict):
    """The Layout and the sequence-parallel flag of a row's layout name, read as `tessera plan --layout` reads it."""
    lay, flags = parse_named_layout(row["layout"], row["gpus"])
    return lay, bool(flags.get("sequence_parallel", False))


def hardware_of(row: dict, source: dict, efficiency: float) -> Hardware:
    """The machine and techniques of a row at a source's software efficiency."""
    return Hardware.from_profile(
        load_profile(row["hardware"]),
        row["gpus"],
        efficiency=efficiency,
        fp8=row["fp8"],
        compile=row["compile"],
        async_tp=row["async_tp"],
        ep_overlap=row["ep_overlap"],
        ep_over_tp=row["ep_over_tp"],
        attention=source["attention"],
        cp_kv_heads=source["cp_kv_heads"],
        cp_overlap=source["cp_overlap"],
        cp_merge=source["cp_merge"],
        data_parallel=source["data_parallel"],
        grad_reduce_bytes={"fp32": 4, "bf16": 2}[source["grad_reduce"]],
        loss=row["loss"],
        ac_policy="torchtitan" if source["framework"] == "torchtitan" else "tessera",
        # torchtitan's float8 tp styles (torchao's Float8ColwiseParallel and Float8RowwiseParallel) gather in FP8
        fp8_tp_gather=source["framework"] == "torchtitan",
        headroom=0.0,  # the published peak is what ran: nothing is held back
    )


def authors_estimate(row: dict, source: dict, efficiency: float):
    """(the Estimate of the row's own configuration, its Hardware)."""
    shape = model_shape(row["model"])
    lay, sp = layout_of(row)
    hw = hardware_of(row, source, efficiency)
    x = score_one(
        shape,
        hw,
        row["seq_len"],
        row["global_batch"],
        lay,
        strategy=row["fsdp"],
        ac=row["ac"],
        sequence_parallel=sp,
        schedule=row["schedule"] if lay.pp > 1 else None,
        virtual=row["virtual"],
        microbatches=row["microbatches"],
    )
    return x, hw


def predict(row: dict, source: dict, efficiency: float) -> dict:
    """The row's estimate at a source's software efficiency (topology/estimators/scoring.py's record)."""
    x, hw = authors_estimate(row, source, efficiency)
    return estimate_record(x, hw, model_shape(row["model"]), row["seq_len"], row["global_batch"])


def rank_authors_layout(row: dict, source: dict, efficiency: float, plans: dict, ours, hw: Hardware) -> dict:
    """Where the authors' configuration (`ours`, its Estimate on `hw`) stands among every layout the planner would
    run for the same job (its GPUs, batch, sequence, memory and techniques): its place by predicted step time, and
    the planner's best with how much faster it is predicted and why (a claim for a GPU run to check)."""
    fields = (
        "model",
        "gpus",
        "seq_len",
        "global_batch",
        "hardware",
        "fp8",
        "compile",
        "async_tp",
        "ep_overlap",
        "ep_over_tp",
        "loss",
    )
    key = (*(row[f] for f in fields), source["attention"], efficiency)
    if key not in plans:
        plans[key] = plan(model_shape(row["model"]), hw, row["seq_len"], row["global_batch"]).ranked
    ranked = plans[key]
    place = 1 + sum(x.time["step"] < ours.time["step"] * (1 - 1e-9) for x in ranked)
    best = ranked[0]
    out = {
        "authors_rank": place,
        "layouts_ranked": len(ranked),
        "authors_fit": ours.fits,
        "planner_best": best.candidate.describe(),
        "planner_best_flags": best.candidate.flags(),
        "planner_best_tokens_per_s_per_gpu": best.tokens_per_s / row["gpus"],
    }
    if best.time["step"] < ours.time["step"] * (1 - 1e-9):
        out["planner_best_speedup"] = ours.time["step"] / best.time["step"]
        out["planner_best_why"] = gain_text(best, ours)
    return out


def fit_efficiency(row: dict, source: dict) -> float:
    """The software efficiency at which the anchor row's tokens/s per GPU is predicted as published
    (bisection: the predicted rate rises with it), in (0, 1]."""
    target = row["published_tokens_per_s_per_gpu"]
    lo, hi = 0.05, 1.0
    if predict(row, source, hi)["tokens_per_s_per_gpu"] <= target:
        return hi  # the kernels' rates alone are not fast enough: no slack to fit
    for _ in range(40):
        mid = (lo + hi) / 2
        if predict(row, source, mid)["tokens_per_s_per_gpu"] < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def split_beside_profile(record: dict, profiled: dict) -> dict:
    """A row's predicted compute parts beside its measured profile's (seconds by kernel kind): matmul,
    attention, elementwise (with FP8's casts), loss, optimizer; the profile's idle time has no predicted part."""
    parts = record["compute_parts_s"]
    predicted = {
        "matmul": parts["matmul"],
        "attention": parts["attention"],
        "elementwise": parts["elementwise"] + parts["fp8_casts"],
        "loss": parts["loss"],
        "optimizer": parts["optimizer"],
    }
    return {k: {"profiled_s": profiled.get(k), "predicted_s": v} for k, v in predicted.items()} | {
        "idle": {"profiled_s": profiled.get("idle"), "predicted_s": None}
    }


def error(predicted: float | None, published: float | None) -> float | None:
    """(predicted - published) / published; None where either is missing."""
    if predicted is None or published is None:
        return None
    return (predicted - published) / published


def summary(rows: list[dict], key: str) -> dict:
    errs = [abs(r[key]) for r in rows if not r["anchor"] and r.get(key) is not None]
    if not errs:
        return {"rows": 0}
    return {
        "rows": len(errs),
        "median_abs_error": statistics.median(errs),
        "worst_abs_error": max(errs),
        "within_10_percent": sum(e <= 0.10 for e in errs),
        "within_25_percent": sum(e <= 0.25 for e in errs),
    }


def plot(rows: list[dict], png: Path) -> Path | None:
    """Predicted against published tokens/s per GPU, both axes log, y = x drawn, each point labelled."""
    try:
        import matplotlib  # lazy: optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after choosing the backend
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tessera[bench]')")
        return None
    fig, ax = plt.subplots(figsize=(11, 9))
    sources = sorted({r["source"] for r in rows})
    colors = dict(zip(sources, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for r in rows:
        x, y = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        ax.scatter(
            [x], [y], color=colors[r["source"]], marker="*" if r["anchor"] else "o", s=120 if r["anchor"] else 30
        )
        ax.annotate(r["id"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    values = [v for r in rows for v in (r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="y = x")
    for f in (0.75, 1.25):
        ax.plot([lo, hi], [lo * f, hi * f], color="grey", linewidth=0.5, linestyle="--")
    for s in sources:
        ax.scatter([], [], color=colors[s], label=s)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published tokens/s per GPU")
    ax.set_ylabel("predicted tokens/s per GPU (tessera plan)")
    ax.set_title("tessera plan against published runs (stars: each source's anchor; dashed: +-25%)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(RUNS), help="the published rows (default benchmarks/published/runs.json)")
    p.add_argument("--out", default=None, help="the folder for published.json and published.png")
    p.add_argument("--rows", default=None, help="comma-separated row ids (their sources' anchors are added)")
    p.add_argument(
        "--no-ranking",
        action="store_true",
        help="skip ranking each job's layouts (where the authors' configuration stands among the planner's)",
    )
    args = p.parse_args(argv)
    started = time.perf_counter()
    data = json.loads(Path(args.runs).read_text())
    sources, rows = data["sources"], data["rows"]
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r["id"] for r in rows}
        if unknown:
            print(f"bench_published: error: unknown rows {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        wanted |= {sources[r["source"]]["anchor"] for r in rows if r["id"] in wanted}
        rows = [r for r in rows if r["id"] in wanted]
    by_id = {r["id"]: r for r in data["rows"]}
    constants = {}
    for name in dict.fromkeys(r["source"] for r in rows):
        anchor = by_id[sources[name]["anchor"]]
        constants[name] = {"anchor": anchor["id"], "software_efficiency": fit_efficiency(anchor, sources[name])}
    out_rows = []
    plans: dict = {}
    for row in rows:
        source = sources[row["source"]]
        eff = constants[row["source"]]["software_efficiency"]
        try:
            ours, hw = authors_estimate(row, source, eff)
            rec = estimate_record(ours, hw, model_shape(row["model"]), row["seq_len"], row["global_batch"])
        except (PlanError, ValueError) as e:
            print(f"bench_published: row {row['id']} cannot be predicted: {e}", file=sys.stderr)
            return 2
        predicted_mem = rec["peak_memory_gib"]
        out_rows.append(
            {
                "id": row["id"],
                "source": row["source"],
                "anchor": row["id"] == source["anchor"],
                "hardware": row["hardware"],
                "model": row["model"],
                "gpus": row["gpus"],
                "seq_len": row["seq_len"],
                "global_batch": row["global_batch"],
                "layout": row["layout"],
                "techniques": row["techniques"],
                "software_efficiency": eff,
                "published_tokens_per_s_per_gpu": row["published_tokens_per_s_per_gpu"],
                "predicted_tokens_per_s_per_gpu": rec["tokens_per_s_per_gpu"],
                "tokens_error": error(rec["tokens_per_s_per_gpu"], row["published_tokens_per_s_per_gpu"]),
                "published_memory_gib": row["published_memory_gib"],
                "predicted_memory_gib": predicted_mem,
                "memory_error": error(predicted_mem, row["published_memory_gib"]),
                "mfu_bf16": rec["mfu_bf16"],
                "mfu_fp8": rec.get("mfu_fp8"),
                "step_time_s": rec["step_time_s"],
                "split_s": rec["split_s"],
                "settings": rec["flags"],
                "assumptions": row["assumptions"],
                **({} if args.no_ranking else rank_authors_layout(row, source, eff, plans, ours, hw)),
                **(
                    {"profile_split": split_beside_profile(rec, row["profile_split_s"])}
                    if "profile_split_s" in row
                    else {}
                ),
            }
        )
    ranked = [r for r in out_rows if "authors_rank" in r]
    ranking = {
        "jobs": len(ranked),
        "authors_in_top_5": sum(r["authors_rank"] <= 5 for r in ranked),
        # near-ties: the planner's best predicted at most 10% faster than what the authors ran
        "authors_within_10_percent_of_best": sum(r.get("planner_best_speedup", 1.0) <= 1.10 for r in ranked),
        "planner_faster_elsewhere": [
            {"id": r["id"], "speedup": r["planner_best_speedup"], "best": r["planner_best"]}
            for r in ranked
            if r["authors_rank"] > 5
        ],
    }
    results = {
        "constants": constants,
        "ranking": ranking,
        "tokens": summary(out_rows, "tokens_error"),
        "memory": summary(out_rows, "memory_error"),
        "memory_note": "torchtitan's published memory is the CUDA allocator's max reserved (its metrics log "
        "max_reserved_gib); the prediction is the allocated peak, so reserved-but-free memory reads as an "
        "under-prediction",
        "rows": out_rows,
        "seconds": time.perf_counter() - started,
    }
    config = {"runs": str(args.runs), "rows": [r["id"] for r in rows]}
    path = write_results(NAME, config, results, args.out)
    png = plot(out_rows, path.with_suffix(".png"))
    print(f"{'row':<34}{'published':>10}{'predicted':>10}{'error':>8}{'mem GiB':>9}{'pred':>7}{'error':>8}")
    for r in out_rows:
        mark = " (anchor)" if r["anchor"] else ""
        mem_err = "" if r["memory_error"] is None else f"{r['memory_error']:+.0%}"
        mem = "" if r["published_memory_gib"] is None else f"{r['published_memory_gib']:.1f}"
        print(
            f"{r['id']:<34}{r['published_tokens_per_s_per_gpu']:>10,.0f}{r['predicted_tokens_per_s_per_gpu']:>10,.0f}"
            f"{r['tokens_error']:>+8.0%}{mem:>9}{r['predicted_memory_gib']:>7.1f}{mem_err:>8}{mark}"
        )
    for r in out_rows:
        if "profile_split" in r:
            parts = ", ".join(
                f"{k} {v['predicted_s']:.3f}/{v['profiled_s']:.3f}"
                for k, v in r["profile_split"].items()
                if v["predicted_s"] is not None
            )
            print(f"{r['id']} predicted/profiled s: {parts}")
    for name, c in constants.items():
        print(f"{name}: software efficiency {c['software_efficiency']:.3f}, fitted on {c['anchor']}")
    for what in ("tokens", "memory"):
        s = results[what]
        if s["rows"]:
            print(
                f"{what}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} over "
                f"{s['rows']} non-anchor rows ({s['within_10_percent']} within 10%, "
                f"{s['within_25_percent']} within 25%)"
            )
    if ranked:
        print(
            f"the authors' layout is in the planner's top 5 for {ranking['authors_in_top_5']} of {len(ranked)} jobs "
            f"and within 10% of its best for {ranking['authors_within_10_percent_of_best']}; for the others the "
            "planner's best is predicted faster (a claim for a GPU run to check):"
        )
        for r in ranked:
            if r["authors_rank"] > 5:
                print(
                    f"  {r['id']}: ranked {r['authors_rank']} of {r['layouts_ranked']}; the best, {r['planner_best']}, "
                    f"{r['planner_best_speedup']:.2f}x faster by {r['planner_best_why']}"
                )
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
