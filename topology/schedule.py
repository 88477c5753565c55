"""Pipeline schedules as data, and a simulator that proves them.

A schedule is one list of actions per pipeline rank, run in order. An action is (op, microbatch, stage):
F runs a stage's forward on a microbatch, B its backward (input and weight gradients, or only the input
gradient for a split-backward kind), W the weight gradient that a split-backward kind deferred. Stages
are virtual: with `virtual` stages per rank there are pp * virtual of them, and stage s lives on rank
s % pp. The communication is implied: F of stage s > 0 needs F of stage s - 1 (its activations); B of
stage s needs B of stage s + 1 (its output gradient), or its own F on the last stage (the loss).

    gpipe             all forwards, then all backwards: peak m activations per rank
    1f1b              warm-up of pp - r - 1 forwards on rank r, then one forward / one backward, then the
                      remaining backwards: at most pp - r activations in flight on rank r
    interleaved-1f1b  Megatron's interleaved 1F1B over `virtual` stages per rank (microbatches in rounds
                      of pp): the bubble shrinks by `virtual`
    zb-h1             zero-bubble ZB-H1: 1F1B's order with B split into B (input gradient) and W (weight
                      gradient); rank r defers its first r W's to fill the cool-down, at 1F1B's memory

`simulate` runs a schedule with per-op costs (no compute is done): each rank's timeline, the makespan, the
bubble fraction, the peak activations in flight, and a clear error if the schedule would deadlock.
`render` draws the timeline as text, one row per rank.

Pure Python (no torch): the planner simulates schedules with it, and tessera.parallel.pipeline runs them
(`tessera.parallel.schedule` re-exports this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # kinds whose backward is B (input gradient) + W (weight gradient)


class Action(NamedTuple):
    op: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # the virtual stage index

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}@{self.stage}"


def check_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """ValueError naming the value and the fix for any (kind, stages, microbatches, virtual) that
    `build_schedule` cannot build."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; use one of {', '.join(KINDS)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value} must be a positive integer")
    if virtual > 1 and kind != "interleaved-1f1b":
        raise ValueError(f"--virtual {virtual} needs --schedule interleaved-1f1b ({kind} runs one stage per rank); "
                         f"use --virtual 1")
    if kind != "gpipe" and microbatches < stages:
        raise ValueError(f"--schedule {kind} needs at least as many microbatches as stages: --microbatches "
                         f"{microbatches} < --pp {stages}; use --microbatches {stages} or more (or --schedule gpipe)")
    if kind == "interleaved-1f1b" and virtual > 1 and microbatches % stages:
        raise ValueError(f"--schedule interleaved-1f1b runs microbatches in rounds of pp: --microbatches "
                         f"{microbatches} is not a multiple of --pp {stages}; use "
                         f"--microbatches {stages * -(-microbatches // stages)}")


def fewest_microbatches(kind: str, stages: int, virtual: int = 1) -> int:
    """The fewest microbatches `kind` runs on `stages` ranks (what check_schedule asks for): GPipe one; the
    others one per stage (interleaved 1F1B runs them in rounds of pp)."""
    return 1 if kind == "gpipe" else stages


def build_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """One list of actions per pipeline rank (`stages` ranks, `stages * virtual` virtual stages)."""
    check_schedule(kind, stages, microbatches, virtual)
    p, m = stages, microbatches
    if kind == "gpipe":
        return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(p)]
    if kind == "1f1b" or (kind == "interleaved-1f1b" and virtual == 1):
        return [_one_f_one_b(r, p, m) for r in range(p)]
    if kind == "interleaved-1f1b":
        return [_interleaved(r, p, m, virtual) for r in range(p)]
    return [_zb_h1(r, p, m) for r in range(p)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    warmup = min(p - r - 1, m)  # forwards before the first backward can arrive
    out = [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        out += [Action("F", warmup + i, r), Action("B", i, r)]
    out += [Action("B", i, r) for i in range(m - warmup, m)]  # cool-down
    return out


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the k-th forward of a rank takes microbatch round k // (p v), chunk
    (k // p) % v; backwards walk the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards, or
    all of them when m == p."""
    total = m * v

    def forward(k: int) -> Action:
        chunk, mb = (k // p) % v, (k // (p * v)) * p + k % p
        return Action("F", mb, chunk * p + r)

    def backward(k: int) -> Action:
        chunk, mb = v - 1 - (k // p) % v, (k // (p * v)) * p + k % p
        return Action("B", mb, chunk * p + r)

    warmup = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    out += [backward(k) for k in range(total - warmup, total)]
    return out


def _zb_h1(r: int, p: int, m: int) -> list[Action]:
    """1F1B with B split: in the steady state rank r runs F, B, then the oldest pending W, except for its
    first r steady steps, whose W's wait for the cool-down, where they fill the time spent waiting for
    the next stage's B. With F = B = W the bubble falls from (p-1)/(m+p-1) to (p-1)/(3m+p-1)."""
    warmup = min(p - r - 1, m)
    out = [Action("F", i, r) for i in range(warmup)]
    pending: list[int] = []
    for i in range(m - warmup):
        out += [Action("F", warmup + i, r), Action("B", i, r)]
        pending.append(i)
        if i >= r:
            out.append(Action("W", pending.pop(0), r))
    for i in range(m - warmup, m):
        out.append(Action("B", i, r))
        pending.append(i)
        out.append(Action("W", pending.pop(0), r))
    return out + [Action("W", i, r) for i in pending]


# ----------------------------------------------------------------------------- the simulator
@dataclass
class Timeline:
    """A simulated run: per rank, (start, end, action) in order; makespan; bubble fraction (idle share
    of ranks x makespan); peak activations in flight per rank (F run, its B not yet)."""

    ranks: list[list[tuple[float, float, Action]]]
    makespan: float
    bubble: float
    peak_activations: list[int]
    peak_pending_weight_grads: list[int] = field(default_factory=list)


DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


def validate(schedule: list[list[Action]]) -> tuple[int, int, bool]:
    """Check the schedule's shape: every (microbatch, stage) has exactly one F and one B (and one W if any
    rank has W's), each stage on one rank, F before B before W on it. Returns (stages, microbatches,
    split_backward); ValueError naming the first problem."""
    seen: dict[Action, int] = {}
    rank_of: dict[int, int] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.op not in ("F", "B", "W"):
                raise ValueError(f"rank {r}: action {a} has op {a.op!r}; ops are F, B and W")
            if a in seen:
                raise ValueError(f"{a} appears twice (ranks {seen[a]} and {r})")
            if rank_of.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} has actions on ranks {rank_of[a.stage]} and {r}")
            seen[a] = r
    if not seen:
        raise ValueError("the schedule has no actions")
    stages = max(a.stage for a in seen) + 1
    microbatches = max(a.microbatch for a in seen) + 1
    split = any(a.op == "W" for a in seen)
    for s in range(stages):
        for i in range(microbatches):
            for op in ("F", "B", "W") if split else ("F", "B"):
                if Action(op, i, s) not in seen:
                    raise ValueError(f"{Action(op, i, s)} is missing: every microbatch needs one {op} on every stage")
    for r, actions in enumerate(schedule):
        position = {a: k for k, a in enumerate(actions)}
        for a in actions:
            before = {"B": "F", "W": "B"}.get(a.op)
            if before and position[Action(before, a.microbatch, a.stage)] > position[a]:
                raise ValueError(f"rank {r}: {a} comes before {Action(before, a.microbatch, a.stage)}")
    return stages, microbatches, split


def dependency(a: Action, stages: int) -> Action | None:
    """The action on another stage (or this one) that `a` waits for."""
    if a.op == "F":
        return Action("F", a.microbatch, a.stage - 1) if a.stage > 0 else None
    if a.op == "B":
        return Action("B", a.microbatch, a.stage + 1) if a.stage < stages - 1 else Action("F", a.microbatch, a.stage)
    return Action("B", a.microbatch, a.stage)


def simulate(schedule: list[list[Action]], costs: dict[str, float] | None = None) -> Timeline:
    """Run the schedule on paper: each rank takes its actions in order, each as soon as the rank is free
    and its dependency has finished (sends and receives cost nothing). For a kind without W the cost of
    B is costs["B"] + costs["W"] (the whole backward). Raises ValueError naming the stuck ranks if the
    schedule would deadlock."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    stages, _, split = validate(schedule)
    cost = {"F": costs["F"], "B": costs["B"] if split else costs["B"] + costs["W"], "W": costs["W"]}
    finished: dict[Action, float] = {}
    next_index = [0] * len(schedule)
    free = [0.0] * len(schedule)
    ranks: list[list[tuple[float, float, Action]]] = [[] for _ in schedule]
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r, actions in enumerate(schedule):
            while next_index[r] < len(actions):
                a = actions[next_index[r]]
                dep = dependency(a, stages)
                if dep is not None and dep not in finished:
                    break
                start = max(free[r], finished[dep] if dep is not None else 0.0)
                end = start + cost[a.op]
                finished[a], free[r] = end, end
                ranks[r].append((start, end, a))
                next_index[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = [f"rank {r} at {schedule[r][i]} waits for {dependency(schedule[r][i], stages)}"
                     for r, i in enumerate(next_index) if i < len(schedule[r])]
            raise ValueError("the schedule deadlocks: " + "; ".join(waits))
    makespan = max(free)
    busy = sum(end - start for row in ranks for start, end, _ in row)
    bubble = 1.0 - busy / (len(schedule) * makespan) if makespan > 0 else 0.0
    return Timeline(ranks, makespan, bubble, [_peak(row, "F", "B") for row in schedule],
                    [_peak(row, "B", "W") if split else 0 for row in schedule])


def _peak(actions: list[Action], opens: str, closes: str) -> int:
    live = peak = 0
    for a in actions:
        live += (a.op == opens) - (a.op == closes)
        peak = max(peak, live)
    return peak


def render(timeline: Timeline, width: int = 4) -> str:
    """The timeline as text, one row per rank, one cell of `width` characters per time unit: F3 is the
    forward of microbatch 3 (F3.1 on virtual stage 1 of a multi-stage rank), . is idle."""
    multi = any(len({a.stage for _, _, a in row}) > 1 for row in timeline.ranks)
    lines = []
    for r, row in enumerate(timeline.ranks):
        cells = []
        clock = 0.0
        for start, end, a in row:
            cells += ["." .ljust(width)] * int(round(start - clock))
            label = f"{a.op}{a.microbatch}" + (f".{a.stage // len(timeline.ranks)}" if multi else "")
            cells += [label.ljust(width)] + [(a.op.lower()).ljust(width)] * (int(round(end - start)) - 1)
            clock = end
        lines.append(f"rank {r} | " + "".join(cells).rstrip())
    return "\n".join(lines)
