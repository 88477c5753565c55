"""Naming a straggler: the rank the others keep waiting for.

At the end of every step each rank puts the wall time it took for the step into its slot of a
world-sized vector, and one all-reduce (sum) gives every rank every rank's time. Ranks leave that
all-reduce together, so the next step starts aligned and the times differ by the work each rank did
after its last collective with the others (the optimizer step, the bookkeeping): a rank slower than its
peers there (a throttled device, a noisy neighbour, a slow host) arrives late. A rank that is the
latest by more than `min_lag_s` and `min_ratio` of the median for `patience` steps in a row is named.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tessera.parallel.comm import collective


@dataclass
class Straggler:
    rank: int
    lag_s: float  # seconds behind the median rank, this step
    steps: int  # consecutive steps it has been the straggler

    def describe(self) -> str:
        return f"straggler rank {self.rank} (+{self.lag_s * 1e3:,.0f} ms/step, {self.steps} steps)"


class StragglerWatch:
    def __init__(self, device: torch.device, patience: int = 3, min_lag_s: float = 0.05, min_ratio: float = 0.2):
        self.device, self.patience, self.min_lag_s, self.min_ratio = device, patience, min_lag_s, min_ratio
        self.candidate: int | None = None
        self.count = 0

    def observe(self, step_time_s: float) -> Straggler | None:
        """Collective over the world: every rank calls it once per step with its own step time."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return None
        times = torch.zeros(world, dtype=torch.float64, device=self.device)
        times[rank] = step_time_s
        with collective("all_reduce (step times)", "world"):
            dist.all_reduce(times)
        seconds: list[float] = times.tolist()
        latest = max(range(world), key=seconds.__getitem__)
        median = statistics.median(seconds)
        lag = seconds[latest] - median
        if lag > self.min_lag_s and lag > self.min_ratio * median:
            self.count = self.count + 1 if latest == self.candidate else 1
            self.candidate = latest
        else:
            self.candidate, self.count = None, 0
        if self.candidate is not None and self.count >= self.patience:
            return Straggler(self.candidate, lag, self.count)
        return None
