"""Long runs judged against one process's own drift: the envelope of one-process runs that differ only in how
the global batch's sums are ordered (microbatch counts), and a layout's distance from one process measured
against it rather than a fixed tolerance."""

from helpers import small_config, cli_here
from tessera.training.run import train
from tessera.testing import drift_envelope, judge_drift


def test_a_layout_stays_within_one_process_envelope_and_a_planted_drift_does_not():
    config = small_config(steps=6, dp=2, tp=2, global_batch=4)
    envelope = drift_envelope(config, microbatches=(1, 2))
    assert len(envelope["envelope"]) == 6 and all(v >= 0 for row in envelope["envelope"] for v in row.values())
    layout = train(config)
    assert judge_drift(layout, envelope) == []
    # a run that drifts by more than reassociation: another learning rate from step 1 on
    other = train(small_config(steps=6, dp=2, tp=2, global_batch=4, lr=4e-3))
    problems = judge_drift(other, envelope)
    assert problems and problems[0].startswith("step 2: loss") and "x the spread of one process" in problems[0]


def test_train_check_drift_judges_the_run_against_one_process_and_refuses_what_it_cannot_check(tmp_path):

    def run(*args):
        return cli_here("train", *args, cwd=tmp_path)

    out = run("--dp", "2", "--tp", "2", "--steps", "3", "--check-drift", "--quiet")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(
        "drift check: all 3 steps within 2x one process's own spread (one process at microbatches 1, 2, 4 spreads up to"
    ), out.stdout
    for args, message in (
        (
            ["--global-batch", "7"],
            "--check-drift runs one process at 1 and 2 microbatches: "
            "--global-batch 7 must be even; use --global-batch 8",
        ),
        (["--resume", str(tmp_path / "none")], "--check-drift compares the run from step 0"),
    ):
        out = run("--steps", "2", "--check-drift", *args)
        assert out.returncode == 2 and message in out.stderr, out.stderr
