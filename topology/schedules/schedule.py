"""Pipeline schedules as data (topology/schedules/simulator.py proves them).

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
    looped-bfs        breadth first over `virtual` stages per rank: every microbatch's forward through a
                      rank's first stage, then its next, ...; backwards in reverse (GPipe per stage: fewest
                      switches, peak m x virtual activations)
    interleaved-zb    zero bubble with virtual stages, torch's ScheduleInterleavedZeroBubble order: interleaved 1F1B
                      with B split into B and W, a warm-up of (virtual - 1) pp + pp - r - 1 forwards on rank r, and
                      from its (r + 1)-th backward on each B followed by the W of the backward r before it: at most
                      virtual x pp activations held per rank (F run, W not yet), unit-cost bubble (p-1)/(3 virtual
                      m + p-1); with one stage per rank it is zb-h1. (W's held back for idle time, up to pp pending,
                      gave the same unit-cost bubble holding up to pp more activations per rank.)
    zbv               zero bubble on a V, torch's ScheduleZBVZeroBubble order: two stages per rank, rank r holding
                      stages r and 2 pp - 1 - r (the first and the last on rank 0, so a microbatch's forward turns
                      around on rank pp - 1 with no message); a warm-up of forwards, then steps "F, B, W" of one
                      stage and of the other, each W right after its B (the executor runs such a pair as one
                      backward pass): at most 2 pp activations held per rank, pp fewer than W's held back for idle
                      time, at no larger bubble. With m = pp microbatches torch's order idles where the ones it
                      lacks would run: there its F/B order with each W in a wait, or before an F once the rank
                      holds what torch's order holds (the same held activations, a smaller bubble)
    dualpipev         DeepSeek's DualPipe cut in half (torch's ScheduleDualPipeV, same order): on zbv's V, a
                      warm-up of forwards, then pairs "forward of one chunk, full backward of the other" (which
                      DeepSeek overlaps to hide expert-parallel all-to-alls), then zero-bubble cool-down with
                      split B and W; needs 2 pp microbatches

Placement: stage s runs on rank `stage_rank(s, pp, placement)`: s % pp for every kind but the V kinds' "v".

simulator.py: `simulate` runs a schedule with per-op costs (no compute is done): each rank's timeline,
the makespan, the bubble fraction, the peak activations in flight, and a clear error if the schedule would
deadlock; `bubble_of` measures a run's bubble from the executor's trace the same way; `render` draws the
timeline as text. Errors name the first bad action by its rank and its position in that rank's list (both
counted from 0).

Schedules as files (`tessera train --schedule-file`): topology/schedules/schedule_files.py.

Pure Python (no torch): the planner simulates schedules with it, and tessera.parallel.pipeline runs them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from tessera.topology.errors import ConfigError

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
# kinds whose backward is B (input gradient) + W (weight gradient); dualpipev's full backwards are a B with its W
# right after (the executor runs such a pair as one backward pass)
SPLIT_BACKWARD = ("zb-h1", "interleaved-zb", "zbv", "dualpipev")
V_KINDS = ("zbv", "dualpipev")  # kinds on the V placement: two stages per rank, rank r holding r and 2 pp - 1 - r
VIRTUAL_KINDS = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")  # kinds that run several stages per rank
ANY_MICROBATCHES = ("gpipe", "looped-bfs")  # kinds that run any number of microbatches (the rest: >= pp)
OPS = ("F", "B", "W")


class Action(NamedTuple):
    op: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # the virtual stage index

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}@{self.stage}"


def placement_of(kind: str | None) -> str:
    """Where a kind puts its stages: "v" (zbv) or "loop" (stage s on rank s % pp; a schedule file too)."""
    return "v" if kind in V_KINDS else "loop"


def stage_rank(stage: int, pp: int, placement: str = "loop") -> int:
    """The pp rank that holds `stage`: s % pp, or on the V rank s for s < pp and 2 pp - 1 - s after."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stages_on_rank(rank: int, pp: int, virtual: int = 1, placement: str = "loop") -> list[int]:
    """The stages pp rank `rank` holds, ascending: r, r + pp, r + 2 pp, ... or on the V r and 2 pp - 1 - r."""
    if placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def check_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """ConfigError (a ValueError) naming the value and the fix for any (kind, stages, microbatches, virtual)
    that `build_schedule` cannot build. Messages name the values as PipelineConfig and Layout do (schedule=,
    pp= for `stages`, microbatches=, virtual=); the CLI writes its flags for them."""
    if kind not in KINDS:
        raise ConfigError(f"unknown pipeline schedule={kind}; use one of {', '.join(KINDS)}")
    for name, value in (("pp", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    if kind in V_KINDS and virtual != 2:
        raise ConfigError(f"schedule={kind} runs two stages per rank on a V: use virtual=2 (not {virtual})")
    if virtual > 1 and kind not in VIRTUAL_KINDS + V_KINDS:
        raise ConfigError(
            f"virtual={virtual} needs schedule={' or '.join(VIRTUAL_KINDS)} ({kind} runs one stage per rank); "
            f"use virtual=1"
        )
    if kind == "dualpipev" and microbatches < 2 * stages:
        raise ConfigError(
            f"schedule={kind} needs at least as many microbatches as its 2 x pp stages: microbatches="
            f"{microbatches} < 2 x pp={stages}; use microbatches={2 * stages} or more"
        )
    if kind not in ANY_MICROBATCHES and microbatches < stages:
        raise ConfigError(
            f"schedule={kind} needs at least as many microbatches as stages: microbatches={microbatches} < "
            f"pp={stages}; use microbatches={stages} or more (or schedule=gpipe)"
        )
    if kind in ("interleaved-1f1b", "interleaved-zb") and virtual > 1 and microbatches % stages:
        raise ConfigError(
            f"schedule={kind} runs microbatches in rounds of pp: microbatches={microbatches} is not a "
            f"multiple of pp={stages}; use microbatches={stages * -(-microbatches // stages)}"
        )


def fewest_microbatches(kind: str, stages: int, virtual: int = 1) -> int:
    """The fewest microbatches `kind` runs on `stages` ranks (what check_schedule asks for): GPipe and looped
    BFS one; dualpipev one per virtual stage (2 pp); the others one per rank."""
    return 1 if kind in ANY_MICROBATCHES else 2 * stages if kind == "dualpipev" else stages


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
    if kind == "looped-bfs":
        return [
            [Action("F", i, c * p + r) for c in range(virtual) for i in range(m)]
            + [Action("B", i, c * p + r) for c in reversed(range(virtual)) for i in range(m)]
            for r in range(p)
        ]
    if kind == "interleaved-zb":
        return [_interleaved_zb(r, p, m, virtual) for r in range(p)]
    if kind == "zbv":
        order = [_zbv(r, p, m) for r in range(p)]
        if m > p:
            return order
        # m == pp: torch's order idles where the microbatches it lacks would run; the same F/B order with each W
        # placed in a wait, or before an F once the rank holds what torch's order holds at most there
        return fill_weight_passes(
            [[a for a in row if a.op != "W"] for row in order], max_held=[held_peak(row, "F", "W") for row in order]
        )
    if kind == "dualpipev":
        return [_dualpipev(r, p, m) for r in range(p)]
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


def _interleaved_zb(r: int, p: int, m: int, v: int) -> list[Action]:
    """Interleaved zero bubble (ZB1P) on rank r as torch's ScheduleInterleavedZeroBubble lists it: interleaved
    1F1B's forwards and backwards (the k-th of each on chunk (k // p) % v, backwards in reverse, microbatches
    in rounds of p) after a warm-up of (v - 1) p + p - r - 1 forwards, one less per rank down (Megatron's
    interleaved 1F1B warms up with 2 (p - r - 1) + (v - 1) p); each B from the (r + 1)-th on is followed by
    the W of the backward r before it (the W's of the first r wait: they fill the waits of the warm-up and
    the cool-down), the last r W's at the end. Rank r then holds v p activations at most, F run, W not yet:
    the W's run soon, where waiting for idle time (up to p pending) held up to p more."""
    total = m * v

    def step(op: str, k: int, chunk: int) -> Action:
        return Action(op, (k // (p * v)) * p + k % p, chunk * p + r)

    warmup = min((v - 1) * p + p - 1 - r, total)
    out = [step("F", k, (k // p) % v) for k in range(warmup)]
    backwards: list[Action] = []
    for k in range(total):
        if warmup + k < total:
            out.append(step("F", warmup + k, ((warmup + k) // p) % v))
        backwards.append(step("B", k, v - 1 - (k // p) % v))
        out.append(backwards[-1])
        if k >= r:
            out.append(backwards[k - r]._replace(op="W"))
    return out + [b._replace(op="W") for b in backwards[total - r :]]


def _zbv(r: int, p: int, m: int) -> list[Action]:
    """ZB-V on rank r (stages r and 2 p - 1 - r) as torch's ScheduleZBVZeroBubble lists it, planned for
    max(m, 2 p - 1) microbatches with those past m left out: 2 (p - r) - 1 forwards of the first stage, r pairs
    of forwards (second, first), p - r steps "F, B, W" of the second stage; then, while forwards remain, F, B, W
    of the first stage and F, B, W of the second (each W right after its own B: no W pending); the cool-down:
    r pairs of B's (first, second), p - r steps "B, W" of the first stage, and the W's left, second stage's
    first. At most 2 p activations held per rank."""
    n = max(m, 2 * p - 1)
    first, second = r, 2 * p - 1 - r
    count = {(op, s): 0 for op in OPS for s in (first, second)}
    out: list[Action] = []

    def add(*steps: tuple[str, int]) -> None:
        for op, stage in steps:
            out.append(Action(op, count[(op, stage)], stage))
            count[(op, stage)] += 1

    for _ in range(2 * (p - r) - 1):
        add(("F", first))
    for _ in range(r):
        add(("F", second), ("F", first))
    for _ in range(p - r):
        add(("F", second), ("B", second), ("W", second))
    while count[("F", second)] < count[("F", first)] or count[("F", first)] < n:
        if count[("F", first)] < n:
            add(("F", first))
        add(("B", first), ("W", first), ("F", second), ("B", second), ("W", second))
    for _ in range(r):
        add(("B", first), ("B", second))
    for _ in range(p - r):
        add(("B", first), ("W", first))
    for stage in (second, first):
        while count[("W", stage)] < count[("B", stage)]:
            add(("W", stage))
    return [a for a in out if a.microbatch < m]


def _dualpipev(r: int, p: int, m: int) -> list[Action]:
    """DualPipeV on rank r (stages r and 2 p - 1 - r), step by step as torch's ScheduleDualPipeV lists it.
    A full backward is B with its W right after; "overlapped" F and B pairs run one after the other (as torch
    runs them: the overlap is for a model that interleaves the two passes' compute and communication)."""
    first, second = r, 2 * p - 1 - r
    count = {(op, s): 0 for op in OPS for s in (first, second)}
    pending: list[Action] = []  # W's of split backwards, oldest first
    out: list[Action] = []

    def add(op: str, stage: int) -> None:
        a = Action(op, count[(op, stage)], stage)
        count[(op, stage)] += 1
        out.append(a)
        if op == "B":
            pending.append(Action("W", a.microbatch, stage))

    def full_backward(stage: int) -> None:
        add("B", stage)
        out.append(pending.pop())  # its W at once
        count[("W", stage)] += 1

    def weight_pass() -> None:
        if pending:
            out.append(pending.pop(0))

    for _ in range(2 * (p - r - 1)):  # 1: forwards of the first stage
        add("F", first)
    for _ in range(r + 1):  # 2: forwards of both
        add("F", first)
        add("F", second)
    for _ in range(p - r - 1):  # 3: zero bubble on the second stage: B, a W, F
        add("B", second)
        weight_pass()
        add("F", second)
    for i in range(m - 2 * p + r + 1):  # 4: the main part, F of one stage with the full backward of the other
        add("F", first)
        full_backward(second)  # (torch: not overlapped at i = 0 on the last rank; the order is the same)
        add("F", second)
        full_backward(first)
    for _ in range(p - r - 1):  # 5: the second stage's full backward, then F of it with the first's backward
        full_backward(second)
        add("F", second)
        full_backward(first)
    split = False  # 6: backwards of both, split from the middle on (odd ranks one action earlier)
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add("B", second) if split else full_backward(second)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add("B", first) if split else full_backward(first)
    for _ in range(p - r - 1):  # 7: a W, then B of the first stage
        weight_pass()
        add("B", first) if split else full_backward(first)
    while pending:  # 8: the W's left
        weight_pass()
    return out


def fill_weight_passes(
    order: Sequence[Sequence[Action]],
    costs: dict[str, float] | None = None,
    max_pending: int | None = None,
    max_held: Sequence[int] | None = None,
) -> list[list[Action]]:
    """A split-backward schedule from an order of F's and B's per rank (each B now the input gradient only):
    each weight gradient W waits, pending, until its rank would otherwise sit idle (the next F or B's input
    not there yet, or arriving later than a W takes), and runs there; the oldest pending runs first as well
    when more than `max_pending` are pending, or before an F when rank r already holds `max_held[r]`
    activations (F run, W not yet); the rest at the end. Decided on the simulator's clock, ranks taken in the
    order they come free; the F/B order is kept, so a deadlock-free order stays so. (zbv fills torch's order
    of pp microbatches with it, within torch's held activations.)"""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    stages = 1 + max((a.stage for row in order for a in row), default=0)
    p = len(order)
    finished: dict[Action, float] = {}
    free, index = [0.0] * p, [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p

    def run(r: int, a: Action, start: float) -> None:
        finished[a] = free[r] = start + costs[a.op]
        out[r].append(a)
        held[r] += (a.op == "F") - (a.op == "W")
        if a.op == "B":
            pending[r].append(Action("W", a.microbatch, a.stage))

    while any(index[r] < len(order[r]) for r in range(p)):
        for r in sorted(range(p), key=free.__getitem__):
            if index[r] == len(order[r]):
                continue
            a = order[r][index[r]]
            dep = dependency(a, stages)
            ready = 0.0 if dep is None else finished.get(dep)
            full = (max_pending is not None and len(pending[r]) > max_pending) or (
                max_held is not None and a.op == "F" and held[r] >= max_held[r]
            )
            if pending[r] and (full or ready is None or ready >= free[r] + costs["W"]):
                run(r, pending[r].pop(0), free[r])  # a W in the time the rank would wait
            elif ready is not None:
                run(r, a, max(free[r], ready))
                index[r] += 1
            else:
                continue  # waits for another rank
            break
        else:
            raise ValueError(
                "the F/B order deadlocks: "
                + "; ".join(f"rank {r} waits at {order[r][index[r]]}" for r in range(p) if index[r] < len(order[r]))
            )
    return [row + pending[r] for r, row in enumerate(out)]


# ----------------------------------------------------------------------------- what every schedule shares
DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


Schedule = Sequence[Sequence[Action]]
Namer = Callable[[Action], str]  # how messages spell an action: str (F1@0) or action_text (0F1, a file's form)


def dependency(a: Action, stages: int) -> Action | None:
    """The action on another stage (or this one) that `a` waits for."""
    if a.op == "F":
        return Action("F", a.microbatch, a.stage - 1) if a.stage > 0 else None
    if a.op == "B":
        return Action("B", a.microbatch, a.stage + 1) if a.stage < stages - 1 else Action("F", a.microbatch, a.stage)
    return Action("B", a.microbatch, a.stage)


def held_peak(actions: Sequence[Action], opens: str, closes: str) -> int:
    """The most actions of one rank opened by `opens` and not yet closed by `closes` (activations held: F, W)."""
    live = peak = 0
    for a in actions:
        live += (a.op == opens) - (a.op == closes)
        peak = max(peak, live)
    return peak
