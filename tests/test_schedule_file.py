"""Pipeline schedules from a file (`--schedule-file`): CSV and JSON round-trips of every built-in kind; each
kind of bad file refused before any rank starts, in one line naming the file and its first bad action or
value and the fix; and training: 1F1B read from a file trains exactly like --schedule 1f1b, and a
hand-written GPipe order like one process."""

import argparse
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from helpers import small_config, train_losses_and_grads
from tessera.config import add_arguments, config_from_args
from tessera.topology.schedules.schedule import KINDS, Action, build_schedule, check_schedule
from tessera.topology.schedules.schedule_files import action_text, parse_action, read_schedule_file, write_schedule_file


def buildable(kind: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(kind, p, m, v)
        return True
    except ValueError:
        return False


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(KINDS), st.integers(1, 4), st.integers(1, 12), st.integers(1, 3), st.sampled_from(["csv", "json"])
)
def test_every_built_in_kind_round_trips_through_a_file(kind, p, m, v, suffix):
    v = v if kind == "interleaved-1f1b" else 1  # only the interleaved kind has virtual stages
    assume(buildable(kind, p, m, v))
    schedule = build_schedule(kind, p, m, v)
    with tempfile.TemporaryDirectory() as d:  # not tmp_path: hypothesis runs many examples per test call
        path = Path(d) / f"schedule.{suffix}"
        write_schedule_file(schedule, path)
        assert read_schedule_file(path) == schedule
        assert read_schedule_file(str(path)) == schedule


@given(st.integers(0, 10**6), st.sampled_from("FBW"), st.integers(0, 10**6))
def test_an_action_is_written_stage_op_microbatch_and_read_back(stage, op, mb):
    a = Action(op, mb, stage)
    assert action_text(a) == f"{stage}{op}{mb}" and parse_action(action_text(a)) == a


def test_the_forms_a_file_may_take(tmp_path):
    want = build_schedule("gpipe", 2, 2)
    forms = {
        # comments, blank lines, spaces, blank and quoted cells, lower case
        "a.csv": '# pp2 GPipe\n\n 0F0 , 0F1,,0B0,"0B1",\n1f0,1F1,1B0,1B1\n',
        "b.json": json.dumps({"ranks": [[action_text(a) for a in row] for row in want]}),
        "c.json": json.dumps(
            [[{"op": a.op, "stage": a.stage, "microbatch": a.microbatch} for a in row] for row in want]
        ),
        "d.txt": json.dumps([[action_text(a) for a in row] for row in want]),  # JSON by its first character
        "e.txt": "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n",  # else CSV
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
        assert read_schedule_file(tmp_path / name) == want, name


def _gpipe(p: int, m: int) -> str:
    return "".join(",".join(action_text(a) for a in row) + "\n" for row in build_schedule("gpipe", p, m))


PP2 = dict(pp=2)  # the debug preset's 2 layers, 4 rows per step

BAD_FILES = [
    # the text: the file, the line (rank) and the cell
    (
        "bad-text.csv",
        "0F0,0F1,zz,0B0,0B1\n1F0,1F1,1B0,1B1\n",
        PP2,
        "schedule file {path}, line 1 (rank 0): 'zz' is not an action; write STAGE OP MICROBATCH, e.g. 0F1",
    ),
    (
        "bad-op.csv",
        "# a comment\n\n0F0,0F1,0B0,0B1\n1F0,1F1,1X0,1B1\n",
        PP2,
        "schedule file {path}, line 4 (rank 1): '1X0' has op 'X'; ops are F, B and W",
    ),
    (
        "torch-op.csv",
        "0F0,0I0,0W0\n",
        PP2,
        "'0I0' has op 'I'; ops are F, B and W (torch's I, the input gradient, is B here",
    ),
    (
        "negative.csv",
        "0F0,0F-1,0B0,0B1\n1F0,1F1,1B0,1B1\n",
        PP2,
        "line 1 (rank 0): '0F-1' has microbatch -1; stages and microbatches count from 0",
    ),
    ("negative-stage.csv", "-1F0\n", PP2, "'-1F0' has stage -1; stages and microbatches count from 0"),
    (
        "bad.json",
        '{"ranks": [["0F0"], [{"op": "F", "stage": 1}]]}',
        PP2,
        'schedule file {path}, rank 1 position 0: {"op": "F", "stage": 1} is not an action',
    ),
    ("bad-op.json", '[["0F0"], [{"op": "Z", "stage": 1, "microbatch": 0}]]', PP2, 'has op "Z"; ops are F, B and W'),
    ("broken.json", '{"ranks": [["0F0"', PP2, "schedule file {path} is not valid JSON (line 1 column 18"),
    ("empty.csv", "# nothing\n", PP2, "schedule file {path} holds no ranks"),
    ("absent.csv", None, PP2, "schedule file {path} does not exist"),
    # the schedule: dependencies and deadlocks, named by the first bad action (rank, position, its text)
    (
        "no-backward.csv",
        "0F0,0F1,0B0,0B1\n1F0,1F1,1B0\n",
        PP2,
        "--schedule-file {path}: 1B1 is missing: rank 1 runs 1F1 at position 1 but never its B",
    ),
    (
        "twice.csv",
        "0F0,0F1,0B0,0B1,0F0\n1F0,1F1,1B0,1B1\n",
        PP2,
        "--schedule-file {path}: rank 0 position 4 (0F0): 0F0 appears twice (first at rank 0 position 0)",
    ),
    (
        "order.csv",
        "0F0,0B0,0F1,0B1\n1B0,1F0,1F1,1B1\n",
        PP2,
        "--schedule-file {path}: rank 1 position 0 (1B0) comes before 1F0 (position 1)",
    ),
    (
        "deadlock.csv",
        "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n",
        PP2,
        "--schedule-file {path}: the schedule deadlocks: rank 0 position 1 (0B0) waits for 1B0 (rank 1 position 2); "
        "rank 1 position 0 (1F1) waits for 0F1 (rank 0 position 2)",
    ),
    # the run: pp, the stages' placement, virtual, microbatches, checkpointing
    (
        "three-ranks.csv",
        _gpipe(3, 2),
        PP2,
        "--schedule-file {path} has 3 ranks (rows) and --pp 2: give one row of actions per pp rank, or use --pp 3",
    ),
    (
        "swapped.csv",
        "1F0,1F1,1B0,1B1\n0F0,0F1,0B0,0B1\n",
        PP2,
        "--schedule-file {path}: rank 0 position 0 (1F0) runs stage 1, which lives on rank 1 (stage s on rank s % pp",
    ),
    (
        "interleaved.csv",
        "".join(",".join(map(action_text, row)) + "\n" for row in build_schedule("interleaved-1f1b", 2, 2, 2)),
        dict(pp=2, n_layers=4),
        "--schedule-file {path} runs 4 stages and --pp 2 x --virtual 1 is 2: use --virtual 2",
    ),
    (
        "two-microbatches.csv",
        _gpipe(2, 2),
        dict(pp=2, microbatches=4),
        "--schedule-file {path} runs 2 microbatches and --microbatches 4: use --microbatches 2",
    ),
    ("three-microbatches.csv", _gpipe(2, 3), PP2, "--microbatches 3 does not divide the 4 rows each dp rank reads"),
    (
        "zb.csv",
        "".join(",".join(map(action_text, row)) + "\n" for row in build_schedule("zb-h1", 2, 2)),
        dict(pp=2, ac="full"),
        "--schedule-file {path} (W actions) with --ac full is not supported",
    ),
    # the flags
    (
        "both.csv",
        _gpipe(2, 2),
        dict(pp=2, schedule="gpipe"),
        "--schedule gpipe and --schedule-file {path} together: the file is the schedule; drop one of them",
    ),
    ("no-pp.csv", _gpipe(1, 2), dict(), "--schedule-file applies to pipeline parallel, and --pp is 1: add --pp 2"),
]


@pytest.mark.parametrize("name, text, flags, message", BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_a_bad_schedule_file_is_one_line_naming_it_before_any_rank_starts(tmp_path, name, text, flags, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        small_config(schedule_file=str(path), **flags).check()
    assert message.replace("{path}", str(path)) in str(e.value) and "\n" not in str(e.value)


def test_the_file_gives_the_microbatches_when_none_are_given(tmp_path):
    from tessera.training.run import pipeline_summary

    path = tmp_path / "gpipe.csv"
    path.write_text(_gpipe(2, 4))
    config = small_config(pp=2, schedule_file=str(path))
    assert config.data.microbatches == 4 and not config.microbatches_chosen  # the file's, not tessera's choice
    config.check()
    assert pipeline_summary(config) == (
        f"pipeline schedule from {path} (4 microbatches, at most 4 in flight on a rank) "
        f"over 2 stages (layers 0-0 | 1-1), simulated bubble 20.0%"
    )
    assert small_config(pp=2, schedule_file=str(path), microbatches=4).microbatches_chosen is False
    # on the command line too
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = config_from_args(parser.parse_args(["--pp", "2", "--schedule-file", str(path)]))
    assert parsed.parallel.schedule_file == str(path) and parsed.data.microbatches == 4


def test_an_interleaved_schedule_file_runs_with_its_virtual_stages(tmp_path):
    path = tmp_path / "v2.json"
    write_schedule_file(build_schedule("interleaved-1f1b", 2, 4, 2), path)
    small_config(pp=2, virtual=2, n_layers=4, schedule_file=str(path)).check()


# ----------------------------------------------------------------------------- training from a file
def test_1f1b_read_from_a_file_trains_exactly_like_schedule_1f1b(tmp_path):
    from tessera.training.run import pipeline_summary, train

    path = tmp_path / "1f1b.csv"
    write_schedule_file(build_schedule("1f1b", 2, 2), path)
    config = small_config(pp=2, schedule_file=str(path))
    # the start line's pipeline part (printed by rank 0, whose output a forkserver child may not share with
    # this test's captured stdout: the line is checked from its function)
    assert f"pipeline schedule from {path} (2 microbatches, at most 2 in flight on a rank)" in pipeline_summary(config)
    from_file = train(config)
    built_in = train(small_config(pp=2, schedule="1f1b", microbatches=2))
    assert len(from_file) == 3
    assert [(m["loss"], m["grad_norm"]) for m in from_file] == [(m["loss"], m["grad_norm"]) for m in built_in]


def test_a_hand_written_gpipe_schedule_trains_like_one_process(tmp_path, reference):
    import torch

    from tessera.launching.launch import run_ranks

    path = tmp_path / "gpipe-by-hand.csv"
    path.write_text(
        "0F0,0F1,0B1,0B0\n"  # rank 0: both forwards, then the backwards newest first
        "1F0,1F1,1B1,1B0\n"
    )
    losses, norms, grads = run_ranks(
        train_losses_and_grads, 2, small_config(pp=2, schedule_file=str(path)), timeout=120
    )[0]
    ref_losses, ref_norms, ref_grads = reference
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs one-process {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs one-process {b}"
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
