"""What every benchmark writes beside its figures: the device, the versions, the configuration."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from tessera.metrics.results import HBM_BANDWIDTH, cpu_name, device_info, versions  # noqa: F401 (re-exported)
from tessera.metrics.results import write_results as _write

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, config: dict[str, Any], results: Any, out: str | None = None) -> Path:
    """Write the JSON to OUT: a file path, or a directory that gets NAME.json (default benchmarks/results/)."""
    return _write(name, config, results, out or RESULTS)


def device_slug(name: str) -> str:
    """A short file-name part for a device: h100, h200, ... or the name's letters and digits."""
    for key in ("H200", "H100", "A100", "B200", "L40S"):
        if key in name:
            return key.lower()
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:40]


def timed(fn: Callable[[], Any], steps: int, warmup: int, device) -> list[float]:
    """Seconds of each of `steps` calls of `fn` after `warmup` untimed ones; under torch.distributed the ranks
    start together and a call ends with the slowest rank (CUDA work is waited for on either side)."""
    import torch
    import torch.distributed as dist

    out = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends with the slowest rank
        if i >= warmup:
            out.append(elapsed.item())
    return out


def plot_loss_curves(curves: dict[str, list[float]], title: str, png: Path) -> None:
    """Training-loss curves (name -> loss per step) in one figure, written to `png` (skipped without
    matplotlib, the bench extra)."""
    try:
        import matplotlib  # lazy: optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after choosing the backend
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (shipped text, one process)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")
