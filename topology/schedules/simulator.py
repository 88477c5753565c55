"""The simulator that proves pipeline schedules (topology/schedules/schedule.py builds them): pure Python, no torch.

validate        every (microbatch, stage) has one F, one B (and one W for split kinds), each stage on one
                rank, F before B before W; errors name the first bad action by rank and position
simulate        each rank takes its actions in order, each as soon as its dependency has finished: the
                timeline, makespan, bubble, peak activations, or an error naming the stuck ranks
fused_backwards which B's the executor runs with their W as one backward pass
bubble_of       a run's bubble from the executor's trace, counted as `simulate` counts it
render          the timeline as text, one row per rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tessera.topology.schedules.schedule import (
    DEFAULT_COSTS,
    OPS,
    Action,
    Namer,
    Schedule,
    dependency,
    held_peak,
    stage_rank,
)


@dataclass
class Timeline:
    """A simulated run: per rank, (start, end, action) in order; makespan; bubble fraction (idle share
    of ranks x makespan); peak activations in flight per rank (F run, its B not yet)."""

    ranks: list[list[tuple[float, float, Action]]]
    makespan: float
    bubble: float
    peak_activations: list[int]
    peak_pending_weight_grads: list[int] = field(default_factory=list)
    # activations held per rank at the peak: F run, its W (or, without W's, its B) not yet
    peak_held_activations: list[int] = field(default_factory=list)


def at_position(r: int, k: int, a: Action, name: Namer) -> str:
    """How an error names an action: its rank and its position in that rank's list (both from 0)."""
    return f"rank {r} position {k} ({name(a)})"


def validate(schedule: Schedule, name: Namer = str) -> tuple[int, int, bool]:
    """Check the schedule's shape: every (microbatch, stage) has exactly one F and one B (and one W if any
    rank has W's), each stage on one rank, F before B before W on it. Returns (stages, microbatches,
    split_backward); ValueError naming the first bad action (rank, position, action)."""
    seen: dict[Action, tuple[int, int]] = {}  # action -> (rank, position)
    rank_of: dict[int, tuple[int, int]] = {}  # stage -> (rank, position) of its first action
    for r, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            if a.op not in OPS:
                raise ValueError(f"{at_position(r, k, a, name)} has op {a.op!r}; ops are F, B and W")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (a.stage, a.microbatch)):
                raise ValueError(f"{at_position(r, k, a, name)}: stage and microbatch must be integers >= 0")
            if a in seen:
                raise ValueError(
                    f"{at_position(r, k, a, name)}: {name(a)} appears twice (first at rank {seen[a][0]} "
                    f"position {seen[a][1]}); drop one"
                )
            first = rank_of.setdefault(a.stage, (r, k))
            if first[0] != r:
                raise ValueError(
                    f"{at_position(r, k, a, name)}: stage {a.stage} has actions on ranks {first[0]} and {r}; "
                    f"a stage's actions run on one rank (where its layers are)"
                )
            seen[a] = (r, k)
    if not seen:
        raise ValueError("the schedule has no actions")
    stages = max(a.stage for a in seen) + 1
    microbatches = max(a.microbatch for a in seen) + 1
    split = any(a.op == "W" for a in seen)
    for s in range(stages):
        for i in range(microbatches):
            for op in OPS if split else ("F", "B"):
                missing = Action(op, i, s)
                if missing in seen:
                    continue
                before = Action({"B": "F", "W": "B"}.get(op, "F"), i, s)
                why = (
                    f"rank {seen[before][0]} runs {name(before)} at position {seen[before][1]} but never its {op}"
                    if before in seen
                    else f"stage {s} runs on rank {rank_of[s][0]}"
                    if s in rank_of
                    else f"no rank runs stage {s}"
                )
                raise ValueError(f"{name(missing)} is missing: {why}; every microbatch needs one {op} on every stage")
    for r, actions in enumerate(schedule):
        position = {a: k for k, a in enumerate(actions)}
        for k, a in enumerate(actions):
            earlier_op = {"B": "F", "W": "B"}.get(a.op)
            if earlier_op and position[Action(earlier_op, a.microbatch, a.stage)] > k:
                needed = Action(earlier_op, a.microbatch, a.stage)
                raise ValueError(
                    f"{at_position(r, k, a, name)} comes before {name(needed)} (position {position[needed]}); "
                    f"a microbatch runs F, then B, then W on a stage"
                )
    return stages, microbatches, split


def simulate(
    schedule: Schedule,
    costs: dict[str, float] | None = None,
    name: Namer = str,
    durations: Mapping[Action, float] | None = None,
    checked: bool = False,
) -> Timeline:
    """Run the schedule on paper: each rank takes its actions in order, each as soon as the rank is free
    and its dependency has finished (sends and receives cost nothing). For a kind without W the cost of
    B is costs["B"] + costs["W"] (the whole backward). `durations` gives actions their own cost (measured
    ones: the executor's trace), over `costs`. Raises ValueError naming each stuck rank's action (and where
    the action it waits for sits) if the schedule would deadlock. `checked`: the schedule is build_schedule's
    (whose kinds tests/test_schedule.py validates over their parameters), so `validate` is skipped (the planner
    simulates a hundred schedules per plan: validating them took 45% of that)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    if checked:
        stages, split = 1 + max(a.stage for row in schedule for a in row), any(a.op == "W" for r in schedule for a in r)
    else:
        stages, _, split = validate(schedule, name)
    per_op = {"F": costs["F"], "B": costs["B"] if split else costs["B"] + costs["W"], "W": costs["W"]}
    durations = durations or {}
    finished: dict[Action, float] = {}
    next_index = [0] * len(schedule)
    free = [0.0] * len(schedule)
    ranks: list[list[tuple[float, float, Action]]] = [[] for _ in schedule]
    remaining = sum(len(a) for a in schedule)
    deps = [[dependency(a, stages) for a in actions] for actions in schedule]  # once, not once per pass
    while remaining:
        progressed = False
        for r, actions in enumerate(schedule):
            while next_index[r] < len(actions):
                a = actions[next_index[r]]
                dep = deps[r][next_index[r]]
                if dep is not None and dep not in finished:
                    break
                start = max(free[r], finished[dep] if dep is not None else 0.0)
                end = start + durations.get(a, per_op[a.op])
                finished[a], free[r] = end, end
                ranks[r].append((start, end, a))
                next_index[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            where = {a: (r, k) for r, actions in enumerate(schedule) for k, a in enumerate(actions)}
            waits = []
            for r, k in enumerate(next_index):
                if k < len(schedule[r]):
                    dep = dependency(schedule[r][k], stages)
                    assert dep is not None  # an action with no dependency never waits
                    waits.append(
                        f"{at_position(r, k, schedule[r][k], name)} waits for {name(dep)} "
                        f"(rank {where[dep][0]} position {where[dep][1]})"
                    )
            raise ValueError("the schedule deadlocks: " + "; ".join(waits))
    makespan = max(free)
    busy = sum(end - start for row in ranks for start, end, _ in row)
    bubble = 1.0 - busy / (len(schedule) * makespan) if makespan > 0 else 0.0
    return Timeline(
        ranks,
        makespan,
        bubble,
        [held_peak(row, "F", "B") for row in schedule],
        [held_peak(row, "B", "W") if split else 0 for row in schedule],
        [held_peak(row, "F", "W" if split else "B") for row in schedule],
    )


def fused_backwards(schedule: Schedule, placement: str = "loop") -> list[set[int]]:
    """Per rank, the positions of the B's that run with their W (listed right after it) as one backward pass.

    One pass saves the split's cost (the weight pass walks the graph again), but it sends the input gradient
    only when the weight gradient is done too. A pair whose gradient stays on the rank (stage 0, or the stage
    before on the same rank) always runs as one. Pairs whose gradient goes to another rank run as one only
    if the simulator (unit costs, a fused pair costing B + W on its B) finds the makespan no longer that way
    than with all of them split: on CPU, zbv (pp 2, 8 microbatches) idled 3% more fused, while dualpipev's
    full backwards, which its peer is busy through, ran 1-3% slower split."""
    pp = len(schedule)
    pairs = [
        [k for k, a in enumerate(row[:-1]) if a.op == "B" and row[k + 1] == Action("W", a.microbatch, a.stage)]
        for row in schedule
    ]

    def stays(r: int, a: Action) -> bool:
        return a.stage == 0 or stage_rank(a.stage - 1, pp, placement) == r

    def chosen(fuse_remote: bool) -> list[set[int]]:
        return [{k for k in pairs[r] if fuse_remote or stays(r, schedule[r][k])} for r in range(pp)]

    def makespan(fused: list[set[int]]) -> float:
        durations = {}
        for r, row in enumerate(schedule):
            for k in fused[r]:
                durations[row[k]] = DEFAULT_COSTS["B"] + DEFAULT_COSTS["W"]
                durations[row[k + 1]] = 0.0
        return simulate(schedule, DEFAULT_COSTS, durations=durations).makespan

    all_fused, split_remote = chosen(True), chosen(False)
    if all_fused == split_remote or makespan(all_fused) <= makespan(split_remote):
        return all_fused
    return split_remote


def bubble_of(traces: Sequence[Sequence[tuple[float, float, Action]]]) -> float:
    """The bubble of a run: the idle share of the ranks' time between the first action's start and the last
    one's end, from each rank's (start, end, action) in order (the executor's trace, one clock for all
    ranks), as `simulate` counts it."""
    begin = min(row[0][0] for row in traces if row)
    end = max(row[-1][1] for row in traces if row)
    busy = sum(e - s for row in traces for s, e, _ in row)
    return 1.0 - busy / (len(traces) * (end - begin)) if end > begin else 0.0


def render(timeline: Timeline, width: int = 4) -> str:
    """The timeline as text, one row per rank, one cell of `width` characters per time unit: F3 is the
    forward of microbatch 3 (F3.1 on virtual stage 1 of a multi-stage rank), . is idle."""
    multi = any(len({a.stage for _, _, a in row}) > 1 for row in timeline.ranks)
    lines = []
    for r, row in enumerate(timeline.ranks):
        cells = []
        clock = 0.0
        for start, end, a in row:
            cells += [".".ljust(width)] * int(round(start - clock))
            label = f"{a.op}{a.microbatch}" + (f".{a.stage // len(timeline.ranks)}" if multi else "")
            cells += [label.ljust(width)] + [(a.op.lower()).ljust(width)] * (int(round(end - start)) - 1)
            clock = end
        lines.append(f"rank {r} | " + "".join(cells).rstrip())
    return "\n".join(lines)
