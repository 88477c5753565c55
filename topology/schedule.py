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
`render` draws the timeline as text, one row per rank. Errors name the first bad action by its rank and
its position in that rank's list (both counted from 0).

Schedules as files (`tessera train --schedule-file`): `read_schedule_file` reads CSV, one line per pp
rank of actions written STAGE OP MICROBATCH (0F1: stage 0's forward of microbatch 1, as torch's
pipelining CSVs write them), or JSON ({"ranks": [["0F0", ...], ...]}, or lists of {"op", "stage",
"microbatch"}); `write_schedule_file` writes either (a built-in kind dumped as a starting point to edit);
`check_fits` proves one (validate, simulate) and checks it against the run's pp, virtual and microbatches.
Files are parsed, never evaluated.

Pure Python (no torch): the planner simulates schedules with it, and tessera.parallel.pipeline runs them
(`tessera.parallel.schedule` re-exports this module).
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # kinds whose backward is B (input gradient) + W (weight gradient)
OPS = ("F", "B", "W")


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


Schedule = Sequence[Sequence[Action]]
Namer = Callable[[Action], str]  # how messages spell an action: str (F1@0) or action_text (0F1, a file's form)


def _at(r: int, k: int, a: Action, name: Namer) -> str:
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
                raise ValueError(f"{_at(r, k, a, name)} has op {a.op!r}; ops are F, B and W")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (a.stage, a.microbatch)):
                raise ValueError(f"{_at(r, k, a, name)}: stage and microbatch must be integers >= 0")
            if a in seen:
                raise ValueError(f"{_at(r, k, a, name)}: {name(a)} appears twice (first at rank {seen[a][0]} "
                                 f"position {seen[a][1]}); drop one")
            first = rank_of.setdefault(a.stage, (r, k))
            if first[0] != r:
                raise ValueError(f"{_at(r, k, a, name)}: stage {a.stage} has actions on ranks {first[0]} and {r}; "
                                 f"a stage's actions run on one rank (where its layers are)")
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
                why = (f"rank {seen[before][0]} runs {name(before)} at position {seen[before][1]} but never its {op}"
                       if before in seen
                       else f"stage {s} runs on rank {rank_of[s][0]}" if s in rank_of else f"no rank runs stage {s}")
                raise ValueError(f"{name(missing)} is missing: {why}; every microbatch needs one {op} on every stage")
    for r, actions in enumerate(schedule):
        position = {a: k for k, a in enumerate(actions)}
        for k, a in enumerate(actions):
            before = {"B": "F", "W": "B"}.get(a.op)
            if before and position[Action(before, a.microbatch, a.stage)] > k:
                needed = Action(before, a.microbatch, a.stage)
                raise ValueError(f"{_at(r, k, a, name)} comes before {name(needed)} (position {position[needed]}); "
                                 f"a microbatch runs F, then B, then W on a stage")
    return stages, microbatches, split


def dependency(a: Action, stages: int) -> Action | None:
    """The action on another stage (or this one) that `a` waits for."""
    if a.op == "F":
        return Action("F", a.microbatch, a.stage - 1) if a.stage > 0 else None
    if a.op == "B":
        return Action("B", a.microbatch, a.stage + 1) if a.stage < stages - 1 else Action("F", a.microbatch, a.stage)
    return Action("B", a.microbatch, a.stage)


def simulate(schedule: Schedule, costs: dict[str, float] | None = None, name: Namer = str) -> Timeline:
    """Run the schedule on paper: each rank takes its actions in order, each as soon as the rank is free
    and its dependency has finished (sends and receives cost nothing). For a kind without W the cost of
    B is costs["B"] + costs["W"] (the whole backward). Raises ValueError naming each stuck rank's action
    (and where the action it waits for sits) if the schedule would deadlock."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    stages, _, split = validate(schedule, name)
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
            where = {a: (r, k) for r, actions in enumerate(schedule) for k, a in enumerate(actions)}
            waits = []
            for r, k in enumerate(next_index):
                if k < len(schedule[r]):
                    dep = dependency(schedule[r][k], stages)
                    waits.append(f"{_at(r, k, schedule[r][k], name)} waits for {name(dep)} "
                                 f"(rank {where[dep][0]} position {where[dep][1]})")
            raise ValueError("the schedule deadlocks: " + "; ".join(waits))
    makespan = max(free)
    busy = sum(end - start for row in ranks for start, end, _ in row)
    bubble = 1.0 - busy / (len(schedule) * makespan) if makespan > 0 else 0.0
    return Timeline(ranks, makespan, bubble, [_peak(row, "F", "B") for row in schedule],
                    [_peak(row, "B", "W") if split else 0 for row in schedule])


def _peak(actions: Sequence[Action], opens: str, closes: str) -> int:
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


# ----------------------------------------------------------------------------- schedules as files
_ACTION = re.compile(r"(-?\d+)\s*([A-Za-z]+)\s*(-?\d+)")  # STAGE OP MICROBATCH; signs only to name them


def action_text(a: Action) -> str:
    """An action as a schedule file writes it: STAGE OP MICROBATCH, e.g. 0F1 (torch's pipelining CSV form)."""
    return f"{a.stage}{a.op}{a.microbatch}"


def parse_action(text: str) -> Action:
    """'0F1' -> Action('F', 1, 0); ValueError naming the text and what is wrong with it."""
    m = _ACTION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not an action; write STAGE OP MICROBATCH, e.g. 0F1 (stage 0's forward of "
                         f"microbatch 1)")
    stage, op, microbatch = int(m[1]), m[2].upper(), int(m[3])
    if op not in OPS:
        # torch's I (input gradient) is our B of a schedule with W's; its full backward is our B
        hint = " (torch's I, the input gradient, is B here, with W's in the file)" if op == "I" else ""
        raise ValueError(f"{text!r} has op {m[2]!r}; ops are F, B and W{hint}")
    return _checked(text, op, stage, microbatch)


def _checked(text: str, op: str, stage: int, microbatch: int) -> Action:
    for what, value in (("stage", stage), ("microbatch", microbatch)):
        if value < 0:
            raise ValueError(f"{text!r} has {what} {value}; stages and microbatches count from 0")
    return Action(op, microbatch, stage)


def _action_from_json(item: Any) -> Action:
    """A JSON action: "0F1", or {"op": "F", "stage": 0, "microbatch": 1}."""
    if isinstance(item, str):
        return parse_action(item)
    text = json.dumps(item)
    if not isinstance(item, dict) or set(item) != {"op", "stage", "microbatch"}:
        raise ValueError(f"{text} is not an action; write \"0F1\" or {{\"op\": \"F\", \"stage\": 0, \"microbatch\": 1}}")
    op, stage, microbatch = item["op"], item["stage"], item["microbatch"]
    if not isinstance(op, str) or op.upper() not in OPS:
        raise ValueError(f"{text} has op {json.dumps(op)}; ops are F, B and W")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (stage, microbatch)):
        raise ValueError(f"{text}: stage and microbatch must be integers")
    return _checked(text, op.upper(), stage, microbatch)


def _is_json(path: str, text: str) -> bool:
    if path.lower().endswith(".json"):
        return True
    return not path.lower().endswith(".csv") and text.lstrip()[:1] in ("{", "[")


def read_schedule_file(path: str | os.PathLike) -> list[list[Action]]:
    """The schedule a file holds, one list of actions per pp rank, parsed (never evaluated). CSV (any name
    but *.json, unless it starts with { or [): one line per rank, comma-separated cells STAGE OP MICROBATCH
    (0F0,0F1,0B0,...), blank cells ignored, blank lines and lines starting with # skipped. JSON:
    {"ranks": [["0F0", ...], ...]} or a list of such lists, each action a string or {"op", "stage",
    "microbatch"}. Only the text is checked here (validate / check_fits prove the schedule); ValueError
    naming the file, the rank (and the CSV line) and the bad action's text."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"schedule file {path} does not exist; give the path of a CSV or JSON schedule") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"schedule file {path} cannot be read ({getattr(e, 'strerror', None) or e}); give a "
                         f"readable CSV or JSON file") from None
    schedule = _read_json(path, text) if _is_json(path, text) else _read_csv(path, text)
    if not schedule:
        raise ValueError(f"schedule file {path} holds no ranks; write one line of actions per pp rank, e.g. 0F0,0B0")
    return schedule


def _read_csv(path: str, text: str) -> list[list[Action]]:
    schedule: list[list[Action]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        row: list[Action] = []
        for cell in next(csv.reader([line])):  # csv, so quoted cells ("0F1") read as their text
            if cell.strip():
                try:
                    row.append(parse_action(cell))
                except ValueError as e:
                    raise ValueError(f"schedule file {path}, line {number} (rank {len(schedule)}): {e}") from None
        schedule.append(row)
    return schedule


def _read_json(path: str, text: str) -> list[list[Action]]:
    shape = 'write {"ranks": [["0F0", "0B0"], ...]}, one list of actions per pp rank'
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"schedule file {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                         f"{shape}") from None
    ranks = data.get("ranks") if isinstance(data, dict) else data
    if not isinstance(ranks, list) or not all(isinstance(row, list) for row in ranks):
        raise ValueError(f"schedule file {path} holds no list of ranks; {shape}")
    schedule: list[list[Action]] = []
    for r, row in enumerate(ranks):
        actions: list[Action] = []
        for k, item in enumerate(row):
            try:
                actions.append(_action_from_json(item))
            except ValueError as e:
                raise ValueError(f"schedule file {path}, rank {r} position {k}: {e}") from None
        schedule.append(actions)
    return schedule


def write_schedule_file(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write a schedule for read_schedule_file: JSON ({"ranks": [...]}, one rank per line) when the path
    ends in .json, else CSV (one line per rank)."""
    path = os.fspath(path)
    rows = [[action_text(a) for a in actions] for actions in schedule]
    if path.lower().endswith(".json"):
        text = '{"ranks": [\n' + ",\n".join("  " + json.dumps(row) for row in rows) + "\n]}\n"
    else:
        text = "".join(",".join(row) + "\n" for row in rows)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def check_fits(schedule: Schedule, pp: int, virtual: int, microbatches: int,
               source: str = "the schedule", name: Namer = str) -> tuple[int, int, bool]:
    """The schedule is sound (validate, then simulate: dependencies, deadlocks) and runs on this pipeline:
    one row per pp rank, pp x virtual stages with stage s on rank s % pp (where the executor puts its
    layers), `microbatches` microbatches. Returns validate's (stages, microbatches, split_backward);
    ValueError naming `source`, the first bad action or value, and the fix."""
    if len(schedule) != pp:
        raise ValueError(f"{source} has {len(schedule)} ranks (rows) and --pp is {pp}: give one row of actions "
                         f"per pp rank, or use --pp {len(schedule)}")
    try:
        stages, found, split = validate(schedule, name)
        simulate(schedule, name=name)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    for r, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            if a.stage % pp != r:
                raise ValueError(f"{source}: {_at(r, k, a, name)} runs stage {a.stage}, which lives on rank "
                                 f"{a.stage % pp} (stage s on rank s % pp, where its layers are); move it to rank {a.stage % pp}'s row")
    if stages != pp * virtual:
        fix = (f"use --virtual {stages // pp}" if stages % pp == 0
               else f"give it {pp * virtual} stages (0 to {pp * virtual - 1}, stage s on rank s % pp)")
        raise ValueError(f"{source} runs {stages} stages and --pp {pp} x --virtual {virtual} is {pp * virtual}: {fix}")
    if found != microbatches:
        raise ValueError(f"{source} runs {found} microbatches and --microbatches is {microbatches}: use "
                         f"--microbatches {found} (or leave it out: a schedule file's count is the default)")
    return stages, found, split
