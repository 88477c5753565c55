"""Rough edges a new user meets with `tessera train`: each ends in one clear line, before any rank starts
where the input is known then (the built-in data's vocabulary, unwritable paths, --sequence-parallel
without tp), and a run that goes on does what it says (a bounded --on-nonfinite skip, strict JSON
metrics, one fallback warning, the steps a resumed run took)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import cli_here, small_config
from tessera.launching.launch import run_ranks

FAST = ["--seq-len", "32", "--global-batch", "4"]


def _tessera(*args):
    return cli_here(*args)


def _one_error_line(out, expected_start: str) -> str:
    """The command failed before any rank started, with exactly one line naming the problem."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"tessera train: error: {expected_start}"), lines[0]
    assert "step " not in out.stdout
    return lines[0]


def _strict_loads(line: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


# ---------------------------------------------------------------------- 1. the built-in data's vocabulary
@pytest.mark.parametrize("layout", [{}, dict(tp=2)], ids=["one", "tp2"])
def test_a_vocab_below_the_builtin_datas_ids_is_refused_before_any_rank_starts(layout):
    with pytest.raises(ValueError) as e:
        small_config(vocab_size=10, **layout).check()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--vocab-size 10 is below the token ids of the built-in data (byte-level: ids 0-257")
    assert "use --vocab-size 258 or more" in message and "--data PATH" in message
    small_config(vocab_size=258, **layout).check()  # exactly the byte-level vocabulary fits


def test_the_cli_refuses_a_small_vocab_with_one_line():
    line = _one_error_line(
        cli_here("train", "--model", "debug", "--vocab-size", "10", "--steps", "2", *FAST),
        "--vocab-size 10 is below the token ids of the built-in data",
    )
    assert "use --vocab-size 258 or more" in line


# ---------------------------------------------------------------------- 2. --on-nonfinite skip, bounded
def test_max_skipped_steps_is_checked():
    with pytest.raises(
        ValueError,
        match=r"^--max-skipped-steps 3 applies to --on-nonfinite skip, and it is stop: add "
        r"--on-nonfinite skip, or drop --max-skipped-steps$",
    ):
        small_config(max_skipped_steps=3).check()
    with pytest.raises(
        ValueError,
        match=r"^--max-skipped-steps 0 must be a positive number of steps \(to stop at the "
        r"first non-finite step, use --on-nonfinite stop\)$",
    ):
        small_config(on_nonfinite="skip", max_skipped_steps=0).check()
    small_config(on_nonfinite="skip", max_skipped_steps=1).check()
    assert small_config(on_nonfinite="skip").runtime.skip_limit == 5  # the default, as --help says


def test_the_help_names_max_skipped_steps_and_its_default():
    import argparse

    from tessera.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    entry = help_text.split("--max-skipped-steps N with --on-nonfinite skip", 1)[1][:200].replace("- ", "-")  # wrapped
    assert "stops the run as --on-nonfinite stop does (default: 5)" in entry


def _poisoned_steps_run(config, poisoned):
    """Train one rank; on each step in `poisoned`, a NaN lands in one gradient after backward."""
    from tessera.trainer import NonFiniteError, Trainer

    trainer = Trainer(config, torch.device("cpu"))

    def poison(parts):
        p = dict(parts[0].named_parameters())["layers.1.feed_forward.w2.weight"]
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.view(-1)[0] = float("nan")

    records, reports, error = [], [], None
    try:
        for s in range(1, config.runtime.steps + 1):
            result = trainer.train_step(on_grads=poison if s in poisoned else None)
            records.append(result.record())
            reports.append(result.skip_report)
    except NonFiniteError as e:
        error = str(e)
    return records, reports, error, trainer.progress.state_dict()


def test_skip_gives_up_after_max_skipped_steps_in_a_row_and_a_finite_step_resets_the_count():
    config = small_config(steps=8, on_nonfinite="skip", max_skipped_steps=2)
    records, reports, error, progress = run_ranks(_poisoned_steps_run, 1, config, {2, 3, 5, 6, 7}, timeout=120)[0]
    # 2 and 3 skipped; 4 is finite (the count starts over); 5 and 6 skipped; 7 would be a third in a row
    assert [r["skipped"] for r in records] == [False, True, True, False, True, True]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 2, 3, 4]
    assert error is not None and "\n" not in error
    assert error.startswith("non-finite values at step 7: loss ") and "grad norm nan" in error
    assert (
        "stopped before the update after 2 skipped steps in a row (--max-skipped-steps 2): nothing poisoned was "
        "applied or saved" in error
    )
    assert progress["skipped_steps"] == 4 and progress["skipped_in_a_row"] == 2 and progress["step"] == 6
    # each skip carries its one-line report (the run prints it on rank 0), a finite step none
    assert [r is not None for r in reports] == [False, True, True, False, True, True]
    assert all(
        "\n" not in r and r.startswith(f"non-finite values at step {s}: ") and "of at most 2 in a row" in r
        for s, r in zip(range(1, 7), reports)
        if r
    )


def test_a_diverging_run_under_skip_stops_after_five_skipped_steps_with_one_line_each(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = _tessera(
        "train",
        "--model",
        "debug",
        "--lr",
        "1e10",
        "--tp",
        "2",
        "--warmup",
        "0",
        "--steps",
        "8",
        "--on-nonfinite",
        "skip",
        "--metrics",
        str(metrics),
        *FAST,
    )
    assert out.returncode == 2, out.stderr
    assert "UserWarning" not in out.stderr and "warnings.warn" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tessera train: error: non-finite values at step ") and "Traceback" not in out.stderr
    assert "after 5 skipped steps in a row (--max-skipped-steps 5)" in last, last
    stopped_at = int(last.split("at step ")[1].split(":")[0])
    # one line per skipped step on stdout, and the progress line of each says it was skipped
    skip_lines = [line for line in out.stdout.splitlines() if line.startswith("tessera: non-finite values at step ")]
    assert len(skip_lines) == 5 and all("the step's update was skipped" in line for line in skip_lines)
    progress = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    marked = [line for line in progress if "| skipped: non-finite, no update" in line]
    assert len(marked) == 5 and len(progress) == stopped_at - 1
    assert all("loss nan" not in line or "skipped: non-finite" in line for line in progress)
    # strict JSON throughout: the non-finite numbers are null
    lines = metrics.read_text().splitlines()
    records = [_strict_loads(line) for line in lines]
    header, steps = records[0], records[1:]
    assert header["type"] == "header" and header["nonfinite_as"] == "null"
    assert [r["skipped"] for r in steps] == [False] * (stopped_at - 6) + [True] * 5
    assert all(r["loss"] is None or r["grad_norm"] is None for r in steps if r["skipped"])
    assert steps[-1]["skipped_steps"] == 5


def test_metrics_records_are_strict_json():
    from tessera.metrics.results import strict_json

    record = {
        "loss": float("nan"),
        "grad_norm": float("inf"),
        "lr": 1e-3,
        "nested": [float("-inf"), {"x": 1.5}],
        "layout": {"tp": 2},
        "skipped": True,
    }
    line = strict_json(record)
    assert _strict_loads(line) == {
        "loss": None,
        "grad_norm": None,
        "lr": 1e-3,
        "nested": [None, {"x": 1.5}],
        "layout": {"tp": 2},
        "skipped": True,
    }
    json.dumps(_strict_loads(line), allow_nan=False)


def test_the_progress_line_marks_a_skipped_step():
    from tessera.training.run import progress_line

    config = small_config(steps=8, on_nonfinite="skip")
    m = {
        "step": 3,
        "loss": float("nan"),
        "grad_norm": float("nan"),
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "peak_memory_bytes": 2**20,
        "layout": config.layout.as_dict(),
        "skipped": True,
        "skipped_steps": 2,
    }
    line = progress_line(m, config, 1.0, 3)
    assert line.startswith("step    3/8 | skipped: non-finite, no update (2 skipped so far) | loss nan")
    assert "skipped" not in progress_line({**m, "loss": 4.0, "grad_norm": 1.0, "skipped": False}, config, 1.0, 3)


# ---------------------------------------------------------------------- 3. paths that cannot be written
def test_a_metrics_path_that_cannot_be_created_is_refused_by_name(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^--metrics /proc/run\.jsonl cannot be written \(creating it fails: .*\); "
        r"choose a path you can write$",
    ):
        small_config(metrics="/proc/run.jsonl").check()
    with pytest.raises(
        ValueError, match=r"^--checkpoint-dir /proc cannot be written \(.*\); choose a writable directory$"
    ):
        small_config(checkpoint_dir="/proc", checkpoint_every=1).check()
    # a writable path passes and is left as it was: a new file is not left behind, an existing one keeps its lines
    fresh, existing = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    existing.write_text('{"step": 1}\n')
    opened = _paths_opened_during(lambda: small_config(metrics=str(fresh)).check())
    with pytest.raises(ValueError, match=r"old\.jsonl already holds data; a new run writes a file of its own"):
        small_config(metrics=str(existing)).check()  # a new run does not append to another run's file
    assert not fresh.exists() and existing.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]  # the probe beside it is gone too
    # never created, even for a moment: a watcher waiting for the file saw it appear and vanish again
    assert str(fresh) not in opened and any(Path(p).parent == tmp_path for p in opened), opened
    longest = tmp_path / ("m" * 249 + ".jsonl")  # 255 bytes, the filesystem's limit: the probe's name is shorter
    small_config(metrics=str(longest)).check()
    assert not longest.exists()
    small_config(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1).check()
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe file is gone


def _paths_opened_during(action) -> list[str]:
    """Every path opened through open() or os.open() while `action` ran."""
    from unittest import mock

    opened: list[str] = []
    real_open, real_os_open = open, os.open

    def recording_open(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    def recording_os_open(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    with mock.patch("builtins.open", recording_open), mock.patch("os.open", recording_os_open):
        action()
    return opened


def test_the_cli_refuses_an_unwritable_metrics_path_with_one_line():
    _one_error_line(
        cli_here("train", "--metrics", "/proc/run.jsonl", "--steps", "1", *FAST),
        "--metrics /proc/run.jsonl cannot be written (creating it fails: ",
    )


# ---------------------------------------------------------------------- 5. --sequence-parallel needs tp
def test_sequence_parallel_without_tp_is_refused():
    with pytest.raises(
        ValueError,
        match=r"^--sequence-parallel shards the norms and the residual stream over tensor "
        r"parallel, and --tp is 1: add --tp 2 \(or more\), or drop --sequence-parallel$",
    ):
        small_config(sequence_parallel=True, dp=2).check()
    small_config(sequence_parallel=True, tp=2).check()


def test_the_cli_refuses_sequence_parallel_without_tp_with_one_line():
    _one_error_line(
        cli_here("train", "--sequence-parallel", "--steps", "1", *FAST),
        "--sequence-parallel shards the norms and the residual stream over tensor parallel, and --tp is 1",
    )


# ---------------------------------------------------------------------- 4. and 6. resuming, stopping, restarting
@pytest.fixture(scope="module")
def damaged_checkpoints(tmp_path_factory):
    """dp2 checkpoints at steps 2 and 4 of a 6-step run; step 4's shard truncated, so a resume falls back to 2."""
    from tessera.training.run import train

    root = tmp_path_factory.mktemp("edges") / "ckpt"
    train(small_config(dp=2, steps=6, checkpoint_dir=str(root), checkpoint_every=2, keep_checkpoints=3))
    (root / "latest").write_text("step_00000004")  # as if the run had been stopped after step 4
    shutil.rmtree(root / "step_00000006")
    shard = next((root / "step_00000004" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    return root


def test_the_checkpoint_fallback_warning_is_one_line_printed_once(damaged_checkpoints, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(damaged_checkpoints, root)
    out = _tessera("train", "--dp", "2", "--steps", "6", "--resume", str(root), *FAST, "--lr", "3e-3", "--warmup", "1")
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "is unusable" in line]
    assert len(warned) == 1, out.stderr  # not once per rank, and not again by the pre-run checks
    assert warned[0].startswith(
        f"tessera: warning: the latest checkpoint {root}/step_00000004 is unusable (truncated "
        f"or altered checkpoint file"
    )
    assert warned[0].endswith(f"using {root}/step_00000002, the newest intact one")
    assert "UserWarning" not in out.stderr and "warnings.warn" not in out.stderr
    assert f"resumed from {root}/step_00000002: step 2" in out.stdout


def test_the_done_line_counts_the_steps_this_run_took():
    from tessera.training.run import done_line

    config = small_config(dp=2, steps=6)
    fresh = [{"step": s, "loss": 5.0 - s} for s in range(1, 7)]
    assert done_line(fresh, config) == "done: loss 4.0000 -> -1.0000 over 6 steps on dp_shard2"
    resumed = [{"step": 5, "loss": 3.5}, {"step": 6, "loss": 3.25}]
    assert (
        done_line(resumed, config)
        == "done: loss 3.5000 -> 3.2500 over 2 steps (5-6, resumed after step 4) on dp_shard2"
    )
    assert "over 1 step (6-6" in done_line(resumed[1:], config)


def test_the_stop_message_suggests_resume_only_where_a_checkpoint_is_saved(tmp_path):
    from tessera.training.run import stopped_message

    plain = stopped_message("stopped by SIGTERM", small_config())
    assert plain == (
        "stopped by SIGTERM; every rank was stopped (no --checkpoint-dir was given: this run saved nothing "
        "to resume from)"
    )
    root = tmp_path / "ckpt"
    root.mkdir()
    saving = small_config(checkpoint_dir=str(root), checkpoint_every=5)
    assert stopped_message("stopped by SIGINT", saving) == (
        f"stopped by SIGINT; every rank was stopped (no checkpoint was saved in {root} yet: nothing to resume from)"
    )
    (root / "latest").write_text("step_00000005")
    assert stopped_message("stopped by SIGINT", saving) == (
        f"stopped by SIGINT; every rank was stopped (resume from the last checkpoint in {root} with --resume)"
    )
    saved = stopped_message("stopped by SIGTERM; the ranks saved a checkpoint first", small_config())
    assert saved == "stopped by SIGTERM; the ranks saved a checkpoint first (resume with --resume)"


def test_the_restart_message_names_the_cause():
    from tessera.launching.launch import RankFailure
    from tessera.training.run import failure_cause

    assert (
        failure_cause(RankFailure("rank 1 of 4 died without a result (exit code -9)"))
        == "rank 1 of 4 died without a result (killed by SIGKILL, exit code -9)"
    )
    assert failure_cause(RankFailure("rank 0 of 2 died without a result (exit code 3)")).endswith("(exit code 3)")
    raised = RankFailure(
        'rank 2 of 4 raised:\nTraceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "RuntimeError: connection reset by peer\n"
    )
    assert failure_cause(raised) == "rank 2 of 4 raised RuntimeError: connection reset by peer"


def _check_a_sixteen_rank_layout():
    from tessera.config import Config

    config = Config.create(model="debug", n_layers=4, pp=2, dp=2, cp=2, tp=2, seq_len=64, global_batch=8)
    try:
        config.check()
    except ValueError as e:
        return str(e)
    return None


def test_a_job_launched_with_the_wrong_process_count_is_named_first_in_one_line():
    """The quick start under `torchrun --nproc_per_node 2`: Config.check names the process count before any mesh."""
    messages = run_ranks(_check_a_sixteen_rank_layout, 2, timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None and "\n" not in messages[0]
    assert "uses 16 ranks but WORLD_SIZE is 2; launch 16 ranks" in messages[0]


def test_the_run_label_says_one_process_and_sequence_parallel():
    from tessera.config import Config
    from tessera.training.run import run_label

    assert run_label(Config.create(model="debug")) == "one process"
    assert run_label(Config.create(model="debug", tp=2, sequence_parallel=True)) == "tp2 + sequence parallel"
    assert run_label(Config.create(model="debug", dp=2)) == "dp_shard2"


def test_the_resume_line_names_one_process_as_every_other_line_does():
    """Issue 65 item 12: the resume line said 'saved on single' where everything else says 'one process'."""
    from tessera.topology import Layout
    from tessera.training.report import layout_words

    assert layout_words(Layout()) == "one process" and layout_words(Layout(dp_shard=2)) == str(Layout(dp_shard=2))
