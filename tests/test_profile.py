"""`tessera train --profile DIR [--profile-steps A:B]`: a torch.profiler trace per rank and the top ops table."""

import json
import os

import pytest

from helpers import cli_here

from tessera.config import Config
from tessera.metrics.profiling import StepProfiler, check_profile, parse_steps, profile_window

TINY = ["--model", "debug", "--seq-len", "16", "--global-batch", "2", "--quiet"]


def _tessera(*args):
    return cli_here(*args)


def _trace_names(path) -> set[str]:
    trace = json.loads(path.read_text())
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_one_rank_writes_its_trace_of_steps_2_and_3_and_prints_the_top_ops(tmp_path):
    out = _tessera("train", *TINY, "--steps", "3", "--profile", str(tmp_path / "prof"))
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path / "prof")) == ["rank0.trace.json"]
    names = _trace_names(tmp_path / "prof" / "rank0.trace.json")
    assert {"aten::mm", "tessera train step 2", "tessera train step 3"} <= names
    assert "tessera train step 1" not in names  # the default window leaves out step 1's warm-up
    head, _, table = out.stdout.partition("\n")  # printed even with --quiet: asked for with --profile
    assert head.startswith("profile: steps 2-3 traced on every rank -> ") and "ui.perfetto.dev" in head
    assert "top 15 ops by self CPU time" in head and "Self CPU" in table and "aten::mm" in table
    rows = [line for line in table.splitlines() if "%" in line and "Self CPU %" not in line]
    assert 1 <= len(rows) <= 15 and not any("tessera train step" in r or "ProfilerStep" in r for r in rows)


def test_two_ranks_each_write_a_trace_beside_the_checkpoints_and_metrics(tmp_path):
    prof, ckpt, metrics = tmp_path / "prof", tmp_path / "ckpt", tmp_path / "run.jsonl"
    out = _tessera(
        "train",
        *TINY,
        "--dp",
        "2",
        "--steps",
        "3",
        "--profile",
        str(prof),
        "--profile-steps",
        "1:2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "1",
        "--metrics",
        str(metrics),
    )
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(prof)) == ["rank0.trace.json", "rank1.trace.json"]
    for rank in (0, 1):
        names = _trace_names(prof / f"rank{rank}.trace.json")
        assert {"tessera train step 1", "tessera train step 2"} <= names and "tessera train step 3" not in names
        assert any(n.startswith("aten::") for n in names)
    assert out.stdout.startswith("profile: steps 1-2 traced on every rank")
    assert (ckpt / "latest").exists() and len(metrics.read_text().splitlines()) == 4  # header + 3 steps


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile-steps", "3:2"], "--profile-steps '3:2' needs 1 <= A <= B"),
        (["--profile-steps", "2"], "--profile-steps '2' must be A:B"),
        (["--profile-steps", ""], "--profile-steps '' must be A:B"),
        (["--profile-steps", "2:9"], "--profile-steps 2:9 reaches past the run's last step (--steps 3)"),
        (["--profile", "FILE"], "is a file; give a directory for the traces"),
        (["--profile", "FILE/sub"], "cannot be created (Not a directory); choose a writable directory"),
        (["--profile-steps", "2:3", "--no-profile"], "--profile-steps 2:3 applies to --profile DIR"),
    ],
)
def test_bad_values_get_one_line_before_any_rank_starts(tmp_path, args, message):
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    given = ["--profile", str(tmp_path / "prof")] if "--profile" not in args and "--no-profile" not in args else []
    out = cli_here("train", *TINY, "--steps", "3", *given, *[a for a in args if a != "--no-profile"])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("tessera train: error: "), out.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "prof").exists() or not os.listdir(tmp_path / "prof")


def test_train_help_renders_the_profile_flags():
    out = _tessera("train", "--help")
    assert out.returncode == 0 and "--profile DIR" in out.stdout and "--profile-steps A:B" in out.stdout


def test_steps_parse_and_the_default_window_stays_within_the_run():
    assert parse_steps("2:3") == (2, 3) and parse_steps("4:4") == (4, 4)
    assert profile_window(None, 50) == (2, 3)
    assert profile_window(None, 1) == (1, 1) and profile_window(None, 2) == (2, 2)
    assert profile_window(None, 50, done=10) == (12, 13)  # resumed after step 10: its own 2nd and 3rd steps
    with pytest.raises(ValueError, match="--profile-steps 'x:3' must be A:B"):
        parse_steps("x:3")
    with pytest.raises(ValueError, match="the resumed run starts after step 4, so step 3 never runs"):
        check_profile("unused", "3:5", 8, done=4)


def test_a_window_cut_short_is_still_written(tmp_path):
    """An early stop (SIGTERM's checkpoint-and-stop, an error) ends the loop inside the window."""
    import torch

    config = Config.create(profile=str(tmp_path), profile_steps="2:40", steps=50)
    profiler = StepProfiler(config, 0, torch.device("cpu"), done=0)
    profiler.start()
    for step in (1, 2, 3):
        torch.ones(8, 8) @ torch.ones(8, 8)
        if step == 3:  # SIGTERM: the loop breaks after step 3's checkpoint, before profiler.step()
            break
        profiler.step()
    profiler.stop()
    names = _trace_names(tmp_path / "rank0.trace.json")
    assert {"tessera train step 2", "tessera train step 3", "aten::mm"} <= names
    assert profiler.summary().startswith("profile: steps 2-3 traced")  # what ran of 2-40


def test_a_run_that_ends_before_the_window_says_so(tmp_path):
    import torch

    profiler = StepProfiler(
        Config.create(profile=str(tmp_path), profile_steps="5:6", steps=10), 0, torch.device("cpu"), 0
    )
    profiler.start()
    profiler.step()
    profiler.stop()
    assert not os.listdir(tmp_path) and "no trace written" in profiler.summary()
    assert StepProfiler(Config.create(steps=10), 0, torch.device("cpu"), 0).summary() is None
