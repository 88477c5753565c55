"""`tessera train --profile DIR [--profile-steps A:B]`: a torch.profiler trace of steps A..B on every rank.

Each rank writes DIR/rank{R}.trace.json (Chrome trace JSON: ui.perfetto.dev or chrome://tracing opens it);
rank 0 prints its top ops by self time (CPU, or CUDA on GPUs) when the run ends. The profiler's schedule
waits through the steps before A and warms up on the step just before it, so the recorded steps carry
no profiler start-up cost. By default it records the run's second and third steps: the first one warms
up the allocator, the kernels and any compiled graphs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from tessera.paths import check_writable_dir

DEFAULT_TABLE_ROWS = 15


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Kineto announces the profiler's start and stop on the process's stderr from C++ (`... profiler_start`):
    hold file descriptor 2 on /dev/null for those calls only, so the lines do not break into the run's own.
    A Python exception raised inside still propagates; only native writes to fd 2 in between are dropped."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def parse_steps(text: str) -> tuple[int, int]:
    """--profile-steps A:B as (A, B), both inclusive; ValueError naming the value and the fix."""
    try:
        first, last = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ValueError(
            f"--profile-steps {text!r} must be A:B, the first and last step to record (e.g. 2:3)"
        ) from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps {text!r} needs 1 <= A <= B (steps count from 1); e.g. 2:3")
    return first, last


def profile_window(text: str | None, steps: int, done: int = 0) -> tuple[int, int]:
    """The steps to record: --profile-steps A:B as given, or by default the second and third steps this run
    takes (after `done`, the step a resumed run continues from), kept within --steps."""
    if text is not None:
        return parse_steps(text)
    return min(done + 2, steps), min(done + 3, steps)


def check_profile(profile: str | None, profile_steps: str | None, steps: int, done: int = 0) -> None:
    """Every --profile input error, before any rank starts (ValueError naming the value and the fix).
    `done`: the checkpoint's step when resuming."""
    if profile is None:
        if profile_steps is not None:
            raise ValueError(
                f"--profile-steps {profile_steps} applies to --profile DIR; add --profile DIR (or drop --profile-steps)"
            )
        return
    if not profile.strip():
        raise ValueError("--profile '' needs a directory for the traces, e.g. --profile prof/")
    first, last = profile_window(profile_steps, steps, done)
    given = profile_steps or f"{first}:{last}"
    if last > steps:
        raise ValueError(
            f"--profile-steps {given} reaches past the run's last step (--steps {steps}); record "
            f"steps that run, e.g. --profile-steps {min(first, steps)}:{steps}"
        )
    if first <= done:
        raise ValueError(
            f"--profile-steps {given}: the resumed run starts after step {done}, so step {first} "
            f"never runs; record later steps, e.g. --profile-steps {done + 1}:{min(done + 2, steps)}"
        )
    if Path(profile).exists() and not Path(profile).is_dir():
        raise ValueError(f"--profile {profile} is a file; give a directory for the traces")

    check_writable_dir("--profile", profile)


def check_profile_summary(step: int | None, steps: int, done: int = 0, window: tuple[int, int] | None = None) -> None:
    """--profile-summary N names a steady-state step this run takes, outside --profile's window (torch
    runs one profiler at a time); ValueError naming the value and the fix."""
    if step is None:
        return
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"--profile-summary {step!r} must be a step number, e.g. --profile-summary {min(3, steps)}")
    first = max(2, done + 1)  # step 1 warms up the allocator, the kernels and compiled graphs
    if steps < first:
        raise ValueError(
            f"--profile-summary {step}: this run takes no step after its warm-up step (--steps {steps}"
            + (f", resumed after step {done}" if done else "")
            + f"); raise --steps to at least {first}"
        )
    if not first <= step <= steps:
        raise ValueError(
            f"--profile-summary {step} must be a step this run takes after its warm-up step, {first} to {steps} "
            f"(--steps {steps}"
            + (f", resumed after step {done}" if done else "")
            + f"); e.g. --profile-summary {steps}"
        )
    if window is not None and window[0] <= step <= window[1]:
        raise ValueError(
            f"--profile-summary {step} falls in --profile's steps {window[0]}:{window[1]} (one torch.profiler at "
            f"a time); summarize a step outside them, or drop one of the two"
        )


class StepProfiler:
    """torch.profiler over the training loop: `start()` before the first step, `step()` after each,
    `stop()` at the end (also on an early stop or an error: a window cut short is still written).
    Without --profile every method does nothing."""

    def __init__(self, config: Any, rank: int, device: torch.device, done: int):
        r = config.runtime
        self.rank, self.device = rank, device
        self.path: Path | None = None  # the trace file, set with the window
        self.prof: torch.profiler.profile | None = None  # while it runs; then `finished`
        self.finished: torch.profiler.profile | None = None
        self.written = False
        self.window: tuple[int, int] | None = None
        self.group_by_shape = r.profile_shapes
        self.next_step = done  # the step about to run, less one
        self._record: torch.profiler.record_function | None = None  # its trace label
        if not r.profile:
            return
        first, last = profile_window(r.profile_steps, r.steps, done)
        first = max(first, done + 1)  # a restart after a failure may have passed part of the window
        if last < first:
            return
        self.window, self.path = (first, last), Path(r.profile) / f"rank{rank}.trace.json"
        lead = first - done - 1  # steps before the window; the last of them warms the profiler up
        warmup = min(1, lead)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            record_shapes=r.profile_shapes,
            on_trace_ready=self._write,
            schedule=torch.profiler.schedule(wait=lead - warmup, warmup=warmup, active=last - first + 1, repeat=1),
        )

    def _write(self, prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(self.path))
        self.written = True

    def start(self) -> None:
        if self.prof is not None:
            with quiet_native_stderr():
                self.prof.start()
            self._label()

    def step(self) -> None:
        if self.prof is not None:
            self._unlabel()
            with quiet_native_stderr():  # the schedule starts and stops the profiler inside a step() call
                self.prof.step()
            self._label()

    def stop(self) -> None:
        if self.prof is not None:
            self._unlabel()
            with quiet_native_stderr():
                self.prof.stop()
            self.prof, self.finished = None, self.prof

    def _label(self) -> None:
        # torch numbers its ProfilerStep#N from the profiler's start; this names the training step
        self.next_step += 1
        self._record = torch.profiler.record_function(f"tessera train step {self.next_step}")
        self._record.__enter__()

    def _unlabel(self) -> None:
        if self._record is not None:
            self._record.__exit__(None, None, None)
            self._record = None

    def summary(self, rows: int = DEFAULT_TABLE_ROWS) -> str | None:
        """What was written, and the top ops by self time of this rank's recorded steps (None without --profile)."""
        if self.window is None:  # no --profile (or a restart past its window)
            return None
        first, last = self.window
        assert self.path is not None  # set with the window
        if not self.written or self.finished is None:
            return f"profile: no trace written (the run ended before step {first})"
        last = min(last, self.next_step)  # an early stop (SIGTERM) cuts the window short
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        where = self.path.parent / "rank{R}.trace.json"
        time = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        ops = self.finished.key_averages(group_by_input_shape=self.group_by_shape)
        ops[:] = [e for e in ops if not e.key.startswith(("tessera train step", "ProfilerStep"))]  # spans, not ops
        table = ops.table(sort_by=time, row_limit=rows)
        return (
            f"profile: {steps} traced on every rank -> {where} (open in ui.perfetto.dev or chrome://tracing); "
            f"rank {self.rank}'s top {rows} ops by self {'CUDA' if self.device.type == 'cuda' else 'CPU'} "
            f"time:\n{table}"
        )
