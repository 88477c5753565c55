"""Write the figures of docs/layouts.md's "Predicting a run before you rent it" from
benchmarks/results/published.json (what benchmarks/bench_published.py wrote): the constants, the summary and
the table between the page's `<!-- published: ... -->` markers. `python docs/gen_published.py` after a run;
tests/test_published.py checks the page holds what the committed JSON says."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "layouts.md"
RESULTS = ROOT / "benchmarks" / "results" / "published.json"


def figures(results: dict) -> dict[str, str]:
    """The page's generated parts, by marker name."""
    t, m, rk = results["tokens"], results["memory"], results["ranking"]
    constants = ["| source | anchor | software efficiency |", "|---|---|---|"] + [
        f"| {name} | {c['anchor']} | {c['software_efficiency']:.3f} |" for name, c in results["constants"].items()
    ]
    summary = (
        f"Tokens/s per GPU over the {t['rows']} non-anchor rows: median |error| **{t['median_abs_error']:.1%}**, "
        f"worst {t['worst_abs_error']:.1%}; {t['within_10_percent']} within 10% and {t['within_25_percent']} within "
        f"25%. Peak memory per GPU over the {m['rows']} rows that publish it: median |error| "
        f"**{m['median_abs_error']:.1%}**, worst {m['worst_abs_error']:.1%}; {m['within_10_percent']} within 10% and "
        f"{m['within_25_percent']} within 25%. The authors' configuration is in the planner's top 5 for "
        f"{rk['authors_in_top_5']} of {rk['jobs']} jobs and within 10% of its best for "
        f"{rk['authors_within_10_percent_of_best']}."
    )
    table = [
        "| row | model, GPUs | layout: techniques | published tok/s/GPU | predicted | error | memory GiB published "
        "/ predicted | authors' place: the planner's best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        mem = (
            "-"
            if r["published_memory_gib"] is None
            else f"{r['published_memory_gib']:.1f} / {r['predicted_memory_gib']:.1f}"
        )
        place = (
            f"1 of {r['layouts_ranked']}"
            if "planner_best_speedup" not in r
            else f"{r['authors_rank']} of {r['layouts_ranked']}: {r['planner_best']}, {r['planner_best_speedup']:.2f}x"
        )
        name = r["id"] + (" (anchor)" if r["anchor"] else "")
        table.append(
            f"| {name} | {r['model']}, {r['gpus']} | {r['layout']}: "
            f"{r['techniques']} | {r['published_tokens_per_s_per_gpu']:,.0f} | "
            f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['tokens_error']:+.0%} | {mem} | {place} |"
        )
    kinds = ("matmul", "attention", "elementwise", "loss", "optimizer")
    split = ["| row | step measured / predicted s | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for r in results["rows"]:
        if "profile_split" in r:
            tokens = r["global_batch"] * r["seq_len"] / r["gpus"]  # a GPU's tokens in a step
            step = tokens / r["published_tokens_per_s_per_gpu"]
            cells = [
                f"{r['profile_split'][k]['profiled_s']:.3f} / {r['profile_split'][k]['predicted_s']:.3f}" for k in kinds
            ]
            split.append(f"| {r['id']} | {step:.3f} / {r['step_time_s']:.3f} | " + " | ".join(cells) + " |")
    return {
        "constants": "\n".join(constants),
        "summary": summary,
        "table": "\n".join(table),
        "split": "\n".join(split),
    }


def render(page: str, parts: dict[str, str]) -> str:
    """The page with each `<!-- published: NAME -->` ... `<!-- /published -->` span holding parts[NAME]."""
    for name, text in parts.items():
        pattern = re.compile(rf"(<!-- published: {name} -->\n)(.*?)(<!-- /published -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE}: no <!-- published: {name} --> span")
        page = pattern.sub(lambda m: m.group(1) + text + "\n" + m.group(3), page)
    return page


def main() -> int:
    results = json.loads(RESULTS.read_text())["results"]
    PAGE.write_text(render(PAGE.read_text(), figures(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
