"""Schedules as files (`tessera train --schedule-file`): `read_schedule_file` reads CSV, one line per pp
rank of actions written STAGE OP MICROBATCH (0F1: stage 0's forward of microbatch 1, as torch's
pipelining CSVs write them), or JSON ({"ranks": [["0F0", ...], ...]}, or lists of {"op", "stage",
"microbatch"}); `write_schedule_file` writes either (a built-in kind dumped as a starting point to edit);
`check_fits` proves one (validate, simulate) and checks it against the run's pp, virtual and microbatches.
Files are parsed, never evaluated. Pure Python, as topology/schedules/schedule.py.
"""

from __future__ import annotations

import csv
import json
import os
import re
from typing import Any

from tessera.topology.schedules.schedule import OPS, Action, Namer, Schedule
from tessera.topology.schedules.simulator import at_position, simulate, validate

_ACTION = re.compile(r"(-?\d+)\s*([A-Za-z]+)\s*(-?\d+)")  # STAGE OP MICROBATCH; signs only to name them


def action_text(a: Action) -> str:
    """An action as a schedule file writes it: STAGE OP MICROBATCH, e.g. 0F1 (torch's pipelining CSV form)."""
    return f"{a.stage}{a.op}{a.microbatch}"


def parse_action(text: str) -> Action:
    """'0F1' -> Action('F', 1, 0); ValueError naming the text and what is wrong with it."""
    m = _ACTION.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"{text!r} is not an action; write STAGE OP MICROBATCH, e.g. 0F1 (stage 0's forward of microbatch 1)"
        )
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
        raise ValueError(f'{text} is not an action; write "0F1" or {{"op": "F", "stage": 0, "microbatch": 1}}')
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
        raise ValueError(
            f"schedule file {path} cannot be read ({getattr(e, 'strerror', None) or e}); give a "
            f"readable CSV or JSON file"
        ) from None
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
        raise ValueError(
            f"schedule file {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); {shape}"
        ) from None
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


def check_fits(
    schedule: Schedule, pp: int, virtual: int, microbatches: int, source: str = "the schedule", name: Namer = str
) -> tuple[int, int, bool]:
    """The schedule is sound (validate, then simulate: dependencies, deadlocks) and runs on this pipeline:
    one row per pp rank, pp x virtual stages with stage s on rank s % pp (where the executor puts its
    layers), `microbatches` microbatches. Returns validate's (stages, microbatches, split_backward);
    ValueError naming `source`, the first bad action or value, and the fix."""
    if len(schedule) != pp:
        raise ValueError(
            f"{source} has {len(schedule)} ranks (rows) and pp={pp}: give one row of actions "
            f"per pp rank, or use pp={len(schedule)}"
        )
    try:
        stages, found, split = validate(schedule, name)
        simulate(schedule, name=name)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    for r, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            if a.stage % pp != r:
                raise ValueError(
                    f"{source}: {at_position(r, k, a, name)} runs stage {a.stage}, which lives on rank "
                    f"{a.stage % pp} (stage s on rank s % pp, where its layers are); "
                    f"move it to rank {a.stage % pp}'s row"
                )
    if stages != pp * virtual:
        fix = (
            f"use virtual={stages // pp}"
            if stages % pp == 0
            else f"give it {pp * virtual} stages (0 to {pp * virtual - 1}, stage s on rank s % pp)"
        )
        raise ValueError(f"{source} runs {stages} stages and pp={pp} x virtual={virtual} is {pp * virtual}: {fix}")
    if found != microbatches:
        raise ValueError(
            f"{source} runs {found} microbatches and microbatches={microbatches}: use "
            f"microbatches={found} (or leave it out: a schedule file's count is the default)"
        )
    return stages, found, split
