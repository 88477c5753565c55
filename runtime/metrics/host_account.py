"""What the host did during one training step besides launching its work, measured for every step (a few
counters, no profiler): Python's garbage collections (how many of each generation, and their seconds), the CUDA
caching allocator's calls into the driver (cudaMalloc and cudaFree of segments, and the retries that free the
cache to satisfy an allocation: each blocks the host and can stall the device), and, set by the trainer, the
seconds spent getting the step's batch (its checksum's all-reduce included) and the seconds until the host first
waited for the device (`launch_s`: the forward, backward and clip launched, before the non-finite check reads the
loss; a device-bound step's launch stays put while its time moves, a host-bound one's moves with it). A step
time that alternates between steps (the H200 suite's compiled rows: 458, 487, 460, 481 ms) is explained, or ruled
out host-side, by these figures beside it.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

# the allocator's counters (torch.cuda.memory_stats): segments reserved from and returned to the driver, and the
# allocations that had to empty the cache and try again
ALLOCATOR_COUNTERS = {
    "device_mallocs": "segment.all.allocated",
    "device_frees": "segment.all.freed",
    "alloc_retries": "num_alloc_retries",
}


class HostAccount:
    """`with HostAccount(device) as host: ...` counts the block's garbage collections and allocator calls;
    `host.figures()` after it (module doc). The collections are the process's: every thread's, as a collection
    stops them all."""

    def __init__(self, device: torch.device):
        self.device = device
        self.collections = [0, 0, 0]
        self.gc_s = 0.0
        self._gc_started: float | None = None
        self._allocator_before: dict[str, int] = {}
        self.allocator: dict[str, int] | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_s += time.perf_counter() - self._gc_started
            generation = int(info.get("generation", 0))
            self.collections[min(generation, 2)] += 1
            self._gc_started = None

    def _allocator_counts(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()}

    def __enter__(self) -> HostAccount:
        gc.callbacks.append(self._on_gc)
        if self.device.type == "cuda":
            self._allocator_before = self._allocator_counts()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.device.type == "cuda":
            after = self._allocator_counts()
            self.allocator = {name: after[name] - self._allocator_before.get(name, 0) for name in after}

    def figures(self) -> dict[str, Any]:
        """The step's collections by generation, their seconds, and on CUDA the allocator's driver calls."""
        out: dict[str, Any] = {
            "gc_collections": {f"gen{g}": n for g, n in enumerate(self.collections)},
            "gc_s": self.gc_s,
        }
        if self.allocator is not None:
            out.update(self.allocator)
        return out


def alternation(step_times: list[float], hosts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Whether timed steps alternate fast and slow, and what of the host's side alternates with them: the mean of
    the odd-numbered steps less the even-numbered ones' for the step time and for each host figure the records
    hold (launch_s, data_s, gc_s, the allocator's calls). None for fewer than 4 steps. `host_side` names the host
    figure whose difference covers at least half the step's, same sign (None: the host does not explain it;
    seconds figures only)."""
    if len(step_times) < 4:
        return None

    def difference(values: list[float]) -> float:
        odd, even = values[0::2], values[1::2]
        return sum(odd) / len(odd) - sum(even) / len(even)

    step = difference(step_times)
    out: dict[str, Any] = {"step_time_difference_s": step, "of_median": step / sorted(step_times)[len(step_times) // 2]}
    known = [h for h in hosts if h is not None]
    if len(known) == len(step_times):
        for name in ("launch_s", "data_s", "gc_s", "device_mallocs", "device_frees", "alloc_retries"):
            if all(name in h for h in known):
                out[f"{name}_difference"] = difference([float(h[name]) for h in known])
    seconds = [n for n in ("data_s", "gc_s", "launch_s") if f"{n}_difference" in out]
    out["host_side"] = next(
        (n for n in seconds if step and out[f"{n}_difference"] / step >= 0.5),
        None,
    )
    return out
