"""`tessera bench`'s figures: step time, tokens/s and MFU by layout (or by ranks for a series), and the MoE
expert load as a layers x experts heatmap; matplotlib (the bench extra), skipped without it."""

from __future__ import annotations

import sys
from pathlib import Path


def plots(rows: list[dict], out: Path, name: str, series: str | None, device: str) -> list[Path]:
    try:  # lazy: matplotlib is optional (the bench extra)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: (as above) after choosing the Agg backend
    except ImportError:
        print(
            "matplotlib is not installed (pip install -e '.[bench]' in the tessera clone): JSON only, no plots",
            file=sys.stderr,
        )
        return []
    paths = []
    # every layout its own colour and marker, named in one legend: labels written beside points overlap
    # wherever two layouts measure alike (the same rank count, close throughputs)
    styles = {r["layout"]: (f"C{i % 10}", "osD^vP*Xh<>"[i % 11]) for i, r in enumerate(rows)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ranks = [r["ranks"] for r in rows]
    if series:
        ax1.plot(ranks, [r["tokens_per_s"] for r in rows], "-", color="grey", lw=0.8, zorder=1)
        ax2.plot(ranks, [r["scaling_efficiency"] for r in rows], "-", color="grey", lw=0.8, zorder=1)
    same = {n: [r["layout"] for r in rows if r["ranks"] == n] for n in set(ranks)}
    for r in rows:
        color, marker = styles[r["layout"]]
        group = same[r["ranks"]]  # layouts of one rank count side by side, not on top of each other
        x = r["ranks"] * (1 + 0.07 * (group.index(r["layout"]) - (len(group) - 1) / 2))
        ax1.scatter(x, r["tokens_per_s"], color=color, marker=marker, label=r["layout"], zorder=2)
        ax2.scatter(x, r["scaling_efficiency"], color=color, marker=marker, zorder=2)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(sorted(set(ranks)))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set(xlabel="ranks", ylabel="tokens/s", title=f"throughput ({series or 'layouts'})")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="ranks", ylabel="scaling efficiency", title="efficiency vs the first layout")
    fig.legend(loc="center right", fontsize=8, title="layout", title_fontsize=8)
    fig.suptitle(f"tessera bench on {device}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    paths.append(out / f"{name}-throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, len(rows) * 0.9), 4.6))
    xs = range(len(rows))
    measured = [(r["peak_tensor_bytes_rank0"] or 0) / 2**20 for r in rows]
    predicted = [r["predicted"]["memory_bytes"]["total"] / 2**20 for r in rows]
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured: live tensors at the peak (rank 0, step 2)")
    ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="planner's estimate (the rank holding the most)")
    ax.set_xticks(list(xs), [r["layout"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="MiB per rank", title="peak tensor memory per rank")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1, frameon=False)  # below the bars
    fig.tight_layout()
    paths.append(out / f"{name}-memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    points = [
        (f"{r['layout']}: {axis}", r["predicted"]["comm_bytes"].get(axis), counted, styles[r["layout"]])
        for r in rows
        for axis, counted in r["comm_bytes_counted"].items()
        if r["predicted"]["comm_bytes"].get(axis)
    ]
    for i, (label, want, counted, (color, marker)) in enumerate(points):
        ax.scatter(want / 1e6, counted / 1e6, s=22, color=f"C{i % 10}", marker=marker, label=label, zorder=2)
    wide = False
    if points:
        values = [v / 1e6 for _, want, counted, _ in points for v in (want, counted)]
        wide = max(values) / min(values) > 30  # log axes only where the figures span decades
        lo, hi = (min(values) / 1.3, max(values) * 1.3) if wide else (0.0, max(values) * 1.1)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, zorder=1)
        ax.set(xlim=(lo, hi), ylim=(lo, hi))
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    ax.set(
        xscale="log" if wide else "linear",
        yscale="log" if wide else "linear",
        xlabel="predicted MB per step (comm_model)",
        ylabel="counted MB per step",
        title="communication per axis: predicted vs measured",
    )
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers; no minor labels (they collide on short log ranges)
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    paths.append(out / f"{name}-predicted.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if any("moe" in r for r in rows):
        paths.append(_moe_plot(plt, rows, out / f"{name}-moe_load.png", device))
    return paths


def _moe_plot(plt, rows: list[dict], path: Path, device: str, max_panels: int = 4) -> Path:
    """The last measured step's tokens per expert (layers x experts heatmap, counts in the cells while they
    fit), each layer's max/mean imbalance at its right. Layouts that routed alike share a panel (every
    layout trains the same model on the same batches, so usually there is one)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "moe" in r:
            last = r["moe"]["steps"][-1]
            groups.setdefault(repr(last["tokens_per_expert"]), []).append(r)
    shown = list(groups.values())[:max_panels]
    n_experts, n_layers = shown[0][0]["moe"]["n_experts"], shown[0][0]["moe"]["n_layers"]
    width = min(18.0, 3.0 + 0.45 * n_experts)
    fig, axes = plt.subplots(len(shown), 1, figsize=(width, len(shown) * (1.4 + 0.45 * n_layers)), squeeze=False)
    for ax, group in zip(axes[:, 0], shown):
        last = group[0]["moe"]["steps"][-1]
        counts = last["tokens_per_expert"]
        im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
        if n_experts <= 32:  # one label per cell while they stay readable
            top = max(max(layer) for layer in counts) or 1
            for li, layer in enumerate(counts):
                for e, c in enumerate(layer):
                    ax.text(
                        e, li, str(c), ha="center", va="center", fontsize=7, color="black" if c > 0.6 * top else "white"
                    )
        for li, imbalance in enumerate(last["imbalance"]):
            ax.annotate(
                f"max/mean {imbalance:.2f}",
                (1.01, 1 - (li + 0.5) / n_layers),
                xycoords="axes fraction",
                va="center",
                fontsize=8,
            )
        ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)], fontsize=7 if n_experts <= 32 else 5)
        ax.set_yticks(range(n_layers), [str(li) for li in range(n_layers)], fontsize=7)
        ax.set(
            xlabel="expert",
            ylabel="layer",
            title=f"{', '.join(r['layout'] for r in group)}: step {last['step']}, aux loss {last['aux_loss']:.4g}",
        )
        ax.title.set_fontsize(9)
        fig.colorbar(im, ax=ax, label="tokens routed", pad=0.16)
    more = len(groups) - len(shown)
    fig.suptitle(
        f"expert load, last measured step (tessera bench on {device})"
        + (f"; {more} more routing(s) in the JSON" if more else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
