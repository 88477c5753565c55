"""`--profile-summary N`: what one steady-state step spent its time and memory on, as a small JSON record.

Step N runs under torch.profiler (CPU, and CUDA on a GPU) and a memory meter; its metrics record gets a
"profile" entry:

- "time": the step's device time split by kind (matmul, attention, norms, other elementwise, loss,
  optimizer and clipping, casts and copies, communication) and the device's idle time within the step
  (the union of every kernel's interval against the step's span: time the host ran ahead of or behind the
  device). On CPU the "kernels" are the operators' self times and the idle time is host time outside any
  operator (Python, the launcher, waiting); the memory meter's own time is left out of the step's.
- "top_kernels": the 25 kernels (CPU: operators) with the most time, their calls, share and kind.
- "memory": the allocator's peak of the step (CUDA; on CPU the live tensor storage, tessera.metrics.memtrack)
  and what held it: parameters, gradients and optimizer state (summed from the tensors themselves), the
  activations the forward keeps for the backward (memory held when the forward reaches the loss head,
  less what the step started with), the loss head's own peak above that, and the remainder at the peak
  (gathered parameters, temporaries); the caching allocator's reserved peak beside it (fragmentation).

Kinds are given by the kernel's name first, then by the tessera ranges it was launched under
("tessera: loss", "tessera: clip", "tessera: optimizer"), then by the operator that launched it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd import DeviceType

from .kernel_kinds import KINDS, RANGE_NAMES, STEP_RANGE, kind_of, what_of
from .memtrack import LiveTensorBytes
from .profiling import quiet_native_stderr

TOP_KERNELS = 25
# the CPU memory meter's dispatch mode as torch.profiler names it: its time is the meter's, not the step's
METER_EVENTS = ("PythonDispatchMode", "PythonTLSSnapshot")


def _clipped(intervals: Iterable[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of `intervals` inside [start, end], sorted; those wholly outside (or empty) dropped."""
    return sorted((max(a, start), min(b, end)) for a, b in intervals if min(b, end) > max(a, start))


def busy_seconds(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals` (start, end) clipped to [start, end]: time at least one ran."""
    total, reach = 0.0, start
    for a, b in _clipped(intervals, start, end):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def idle_gaps(intervals: Iterable[tuple[float, float]], start: float, end: float, top: int = 5) -> list[dict]:
    """The `top` longest stretches of [start, end] in which no interval ran: (offset from start, length)."""
    gaps, reach = [], start
    for a, b in _clipped(intervals, start, end):
        if a > reach:
            gaps.append((reach, a - reach))
        reach = max(reach, b)
    if end > reach:
        gaps.append((reach, end - reach))
    gaps.sort(key=lambda g: -g[1])
    return [{"at_s": at - start, "seconds": length} for at, length in gaps[:top]]


def _linked(event: Any) -> int:
    return int(getattr(event, "linked_correlation_id", 0) or 0)


def _annotation(event: Any) -> bool:
    """A range (record_function's, or its mirror on the GPU's timeline), not an operator or a kernel."""
    return (
        bool(getattr(event, "is_user_annotation", False))
        or "annotation" in str(getattr(event, "activity_type", "") or "").lower()
        or event.name.startswith(("tessera: ", "ProfilerStep"))
    )


def _context(event: Any) -> list[str]:
    names, parent = [], event
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def summarize_events(events: Sequence[Any], device_type: str) -> dict[str, Any]:
    """The step's time by kind, its top kernels and its idle time, from torch.profiler's FunctionEvents
    (prof.events()) of one step recorded inside a STEP_RANGE range."""
    span = next((e for e in events if e.name == STEP_RANGE), None)
    if span is None:
        raise ValueError(f"no {STEP_RANGE!r} range among the profiled events: nothing to summarize")
    start, end = span.time_range.start, span.time_range.end  # microseconds
    items: list[tuple[str, float, list[str], tuple[float, float]]] = []  # (name, us, context, interval)
    linked = 0  # GPU kernels whose launching operator was found (their context: ops and ranges)
    in_range = 0  # GPU kernels without one, placed by the range mirrored on the GPU timeline around them
    if device_type == "cuda":
        # the operators (not the runtime's launch calls, whose ids count CUPTI's correlations) by their id
        by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU and not _linked(e)}
        # ... and the launch calls by the correlation they share with their kernel: a kernel whose id names
        # no operator (the first H200 profile linked none: attention and the loss counted as elementwise)
        # takes the operators around its launch call
        launches = {_linked(e): e for e in events if e.device_type == DeviceType.CPU and _linked(e)}
        # ... and, where neither names one (torch 2.11's profiles linked none either way), the ranges' mirrors
        # on the GPU timeline: a kernel that starts inside one ran for that range's work
        device_ranges = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in events
            if e.device_type == DeviceType.CUDA and _annotation(e) and e.name in RANGE_NAMES
        ]
        for e in events:
            if e.device_type != DeviceType.CUDA or _annotation(e):
                continue
            launcher = by_id.get(_linked(e))
            if launcher is None and _linked(e) in launches:
                launcher = launches[_linked(e)].cpu_parent
            if launcher is not None:
                context = _context(launcher)
                linked += 1
            else:
                context = [name for a, b, name in device_ranges if a <= e.time_range.start < b]
                in_range += bool(context)
            items.append(
                (e.name, e.time_range.end - e.time_range.start, context, (e.time_range.start, e.time_range.end))
            )
    meter_us = 0.0  # the CPU memory meter's own dispatch (LiveTensorBytes): left out of the step's figures
    if device_type != "cuda":  # the operators' self time, on the threads the step ran on (forward and autograd)
        for e in events:
            if e.device_type != DeviceType.CPU or _annotation(e):
                continue
            self_us = e.self_cpu_time_total
            if e.name in METER_EVENTS:
                meter_us += self_us
            elif self_us > 0:
                items.append((e.name, self_us, _context(e.cpu_parent), (e.time_range.start, e.time_range.end)))
    wall = (end - start - meter_us) * 1e-6
    by_kind = dict.fromkeys(KINDS, 0.0)
    kernels: dict[str, dict[str, Any]] = {}
    for name, us, context, _ in items:
        kind = kind_of(name, context)
        by_kind[kind] += us * 1e-6
        k = kernels.setdefault(
            name, {"name": name[:200], "kind": kind, "what": what_of(name, kind), "calls": 0, "seconds": 0.0}
        )
        k["calls"] += 1
        k["seconds"] += us * 1e-6
    spans = [i for *_, i in items]
    if device_type == "cuda":
        busy = busy_seconds(spans, start, end) * 1e-6
        idle_what = (
            "no kernel running on the GPU within the step (the host ahead of or behind it); the kinds add "
            "kernel time, so kernels overlapping on several streams (communication beside compute) count in each"
        )
    else:
        busy = min(wall, sum(by_kind.values()))
        idle_what = "host time outside any operator (Python, the launcher, waiting)"
    total = sum(by_kind.values()) or 1.0
    top = sorted(kernels.values(), key=lambda k: -k["seconds"])[:TOP_KERNELS]
    for k in top:
        k["share"] = k["seconds"] / total
    return {
        "step_wall_s": wall,
        "device_busy_s": busy,
        "time_s": {**by_kind, "idle": max(0.0, wall - busy)},
        "time_share": {kind: s / wall if wall else None for kind, s in {**by_kind, "idle": wall - busy}.items()},
        "idle_means": idle_what,
        "idle_gaps": [{"at_s": g["at_s"] * 1e-6, "seconds": g["seconds"] * 1e-6} for g in idle_gaps(spans, start, end)]
        if device_type == "cuda"
        else [],
        "top_kernels": top,
        "kernels_counted": len(items),
        # GPU kernels whose launching operator the trace names (the rest are classified by their name alone)
        "kernels_linked": linked if device_type == "cuda" else None,
        # of the rest, those inside a range's mirror on the GPU timeline (the loss, clipping, the optimizer)
        "kernels_placed_by_range": in_range if device_type == "cuda" else None,
        "memory_meter_s": meter_us * 1e-6,
        "measured_as": "CUDA kernel time (torch.profiler, CUPTI)"
        if device_type == "cuda"
        else "CPU operator self time (torch.profiler)",
    }


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard; shared storages once)."""
    meter = LiveTensorBytes()  # its storage accounting, without entering it as a dispatch mode
    for t in tensors:
        meter.track(t)
    meter.measure()
    return meter.now


class MemoryMeter:
    """Memory held now and the peak since the last mark: the CUDA allocator's figures, or on CPU the live
    tensor storage (LiveTensorBytes, a dispatch mode entered for the step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tracker: LiveTensorBytes | None = None
        self.phases: dict[str, dict[str, int]] = {}

    def now_and_peak(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device)), int(torch.cuda.max_memory_allocated(self.device))
        assert self.tracker is not None, "enter the meter first"
        self.tracker.measure()
        return self.tracker.now, self.tracker.peak

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.peak = self.tracker.now

    def mark(self, phase: str) -> None:
        """Close `phase`: what is held now, and its peak (the largest over repeats, e.g. microbatches). The
        CUDA allocator counts on the host as it hands blocks out: no synchronization needed."""
        now, peak = self.now_and_peak()
        old = self.phases.get(phase)
        self.phases[phase] = {"held_after": now, "peak": max(peak, old["peak"]) if old else peak}
        if self.device.type == "cuda":  # the caching allocator's reserve in this phase (reset with the peak)
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            self.phases[phase]["reserved_peak"] = max(reserved, old.get("reserved_peak", 0)) if old else reserved
        self.reset_peak()


class ProfiledStep:
    """The context the trainer runs its profiled step in: torch.profiler, the memory meter, and hooks on the
    loss heads (the memory held when the forward reaches them, and their own peak). `mark(phase)` closes
    the phases the trainer sees (backward, clip, optimizer); `summary(...)` reads it all back."""

    def __init__(self, device: torch.device, parts: Sequence[nn.Module], optimizers: Sequence[Any]):
        self.device, self.parts, self.optimizers = device, list(parts), list(optimizers)
        self.meter = MemoryMeter(device)
        self.stack = ExitStack()
        self.prof: torch.profiler.profile | None = None
        self.gradient_bytes = 0
        self.started = 0.0

    def __enter__(self) -> "ProfiledStep":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        else:
            self.meter.tracker = self.stack.enter_context(LiveTensorBytes())
            self.meter.tracker.track_existing(self.parts, self.optimizers)
        self.meter.reset_peak()
        self.start_held = self.meter.now_and_peak()[0]
        for part in self.parts:
            for module in part.modules():
                if getattr(module, "takes_targets", False):  # a loss head (parallel/loss.py)
                    self.stack.enter_context(_hooked(module, self._before_loss, self._after_loss))
        self.prof = torch.profiler.profile(activities=activities)
        with quiet_native_stderr():  # its start line would break into the run's own lines
            self.prof.__enter__()
        self.stack.callback(self._stop_profiler)
        self.stack.enter_context(torch.profiler.record_function(STEP_RANGE))
        self.started = time.perf_counter()
        return self

    def _stop_profiler(self) -> None:
        assert self.prof is not None
        with quiet_native_stderr():
            self.prof.__exit__(None, None, None)

    def _before_loss(self, *_: Any) -> None:
        self.meter.mark("forward")

    def _after_loss(self, *_: Any) -> None:
        self.meter.mark("loss")

    def mark(self, phase: str) -> None:
        if phase == "backward":  # the gradients as the clip and the optimizer find them
            self.gradient_bytes = _tensor_bytes(p.grad for part in self.parts for p in part.parameters())
        self.meter.mark(phase)

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stack.close()

    def summary(self) -> dict[str, Any]:
        assert self.prof is not None, "run the step inside the ProfiledStep first"
        out = summarize_events(list(self.prof.events()), self.device.type)
        out["memory"] = self.memory()
        return out

    def memory(self) -> dict[str, Any]:
        phases = self.meter.phases
        params = _tensor_bytes(p for part in self.parts for p in part.parameters())
        state = _tensor_bytes(v for o in self.optimizers for s in o.state.values() for v in s.values())
        peak_phase = max(phases, key=lambda p: phases[p]["peak"]) if phases else None
        peak = phases[peak_phase]["peak"] if peak_phase else None
        forward = phases.get("forward")
        activations = forward["held_after"] - self.start_held if forward else None
        loss = phases["loss"]["peak"] - forward["held_after"] if forward and "loss" in phases else None
        held = {"parameters": params, "optimizer_state": state}
        if peak_phase in ("forward", "loss"):
            held["activations"] = activations or 0
        if peak_phase == "loss":
            held["loss"] = loss or 0
        if peak_phase in ("backward", "clip", "optimizer"):
            held["gradients"] = self.gradient_bytes
        out: dict[str, Any] = {
            "peak_bytes": peak,
            "peak_phase": peak_phase,
            "parameters_bytes": params,
            "gradients_bytes": self.gradient_bytes,
            "optimizer_state_bytes": state,
            "activations_bytes": activations,
            "loss_bytes": loss,
            "held_at_peak": held,
            "other_at_peak_bytes": peak - sum(held.values()) if peak is not None else None,
            "phases": phases,
            "step_start_bytes": self.start_held,
            "measured_as": "CUDA caching allocator (memory_allocated / max_memory_allocated)"
            if self.device.type == "cuda"
            else "live tensor storage (tessera.metrics.memtrack.LiveTensorBytes)",
            "definitions": "activations: held when the forward reaches the loss head, less the step's start; loss: "
            "the loss head's peak above that; other: the peak less what is named as held at it (gathered "
            "parameters, temporaries)",
        }
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            reserved, fragmentation = reserve_of(phases)
            out.update(
                reserved_peak_bytes=reserved,
                fragmentation_bytes=fragmentation,
                allocation_retries=int(stats.get("num_alloc_retries", 0)),
            )
        else:
            out.update(reserved_peak_bytes=None, fragmentation_bytes=None)
        return out


def reserve_of(phases: dict[str, dict[str, int]]) -> tuple[int | None, int | None]:
    """(the allocator's reserved peak over the step's phases, that reserve less the step's true peak: what
    fragmentation and the cache held beyond any moment's live tensors). Both peaks are reset at every phase,
    so each is the largest over the phases; a reserve after the optimizer less the optimizer's own peak (the
    first version of this figure: 53.6 GiB where the truth was 6.7) compares different moments."""
    reserves = [p["reserved_peak"] for p in phases.values() if "reserved_peak" in p]
    if not reserves or not phases:
        return None, None
    reserved = max(reserves)
    return reserved, reserved - max(p["peak"] for p in phases.values())


class _hooked:
    """Forward pre- and post-hooks on `module` for the duration of a with block."""

    def __init__(self, module: nn.Module, before: Callable[..., None], after: Callable[..., None]):
        self.module, self.before, self.after = module, before, after

    def __enter__(self) -> None:
        self.handles = [
            self.module.register_forward_pre_hook(self.before),
            self.module.register_forward_hook(self.after),
        ]

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def describe(profile: dict[str, Any], step: int) -> str:
    """One line: the step's time by kind (largest first) and its memory peak by what held it."""
    wall = profile["step_wall_s"]
    kinds = sorted(profile["time_s"].items(), key=lambda kv: -kv[1])
    time_text = ", ".join(f"{k.replace('_', ' ')} {v / wall:.0%}" for k, v in kinds if v / wall >= 0.005)
    m = profile["memory"]
    held = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in m["held_at_peak"].items())
    return (
        f"profile of step {step}: {wall * 1e3:.1f} ms: {time_text}; memory peak {_gib(m['peak_bytes'])} "
        f"in the {m['peak_phase']}: {held}, other {_gib(m['other_at_peak_bytes'])}"
    )


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"
