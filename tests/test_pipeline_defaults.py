"""Pipelines that need no flag beyond --pp: without --microbatches the fewest microbatches the schedule runs
(that divide each dp rank's rows) are chosen and said at the start; given ones are kept and checked."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import cli_here, small_config
from tessera.topology.schedules.schedule import KINDS, V_KINDS, VIRTUAL_KINDS, check_schedule, fewest_microbatches


@given(st.sampled_from(KINDS), st.integers(1, 8))
def test_the_fewest_microbatches_are_what_the_schedule_accepts(kind, stages):
    virtual = 2 if kind in VIRTUAL_KINDS + V_KINDS else 1
    least = fewest_microbatches(kind, stages, virtual)
    check_schedule(kind, stages, least, virtual)  # accepted
    if least > 1:
        with pytest.raises(ValueError):
            check_schedule(kind, stages, least - 1, virtual)


@pytest.mark.parametrize(
    "flags, chosen",
    [
        (dict(), 1),
        (dict(pp=2), 2),
        (dict(pp=2, schedule="gpipe"), 1),
        (dict(pp=4, n_layers=4), 4),
        (dict(pp=2, schedule="interleaved-1f1b", virtual=2, n_layers=4), 2),
        (dict(pp=2, schedule="zbv", virtual=2, n_layers=4), 2),
        (dict(pp=2, schedule="zbv", n_layers=4), 2),  # --virtual left out: the V's two stages per rank
        (dict(pp=2, schedule="dualpipev", n_layers=4), 4),  # 2 pp
        (dict(pp=2, schedule="looped-bfs", virtual=2, n_layers=4), 1),
        (dict(pp=4, n_layers=4, global_batch=10), 5),  # 4 does not divide 10 rows: the next count that does
        (dict(pp=2, microbatches=4), 4),  # given: kept
    ],
)
def test_microbatches_default_to_the_fewest_the_pipeline_runs(flags, chosen):
    config = small_config(**flags)
    assert config.data.microbatches == chosen
    assert config.microbatches_chosen == ("microbatches" not in flags)
    assert config.virtual == flags.get("virtual", 2 if flags.get("schedule") in V_KINDS else 1)
    config.check()


def test_pp_alone_trains_and_says_what_it_chose(tmp_path):
    out = cli_here("train", "--pp", "2", "--steps", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "in 2 microbatches (the fewest the schedule runs; --microbatches M to choose)" in out.stdout
    assert "done: loss" in out.stdout


def test_a_v_schedule_needs_only_its_name(tmp_path):
    """--schedule dualpipev with --pp 2 (and the 4 layers its 4 stages need): two stages per rank on the V
    and 2 pp microbatches are chosen; the library's refusal of too few microbatches reaches the command line
    in its flags."""
    run = ["train", "--pp", "2", "--schedule", "dualpipev", "--n-layers", "4", "--steps", "2"]
    out = cli_here(*run, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "in 4 microbatches (the fewest the schedule runs" in out.stdout
    out = cli_here(*run, "--microbatches", "2")  # a refusal
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "--schedule dualpipev needs at least as many microbatches as its 2 x pp stages: --microbatches 2 < 2 x "
            "--pp 2; use --microbatches 4 or more"
        )
    )


def test_compile_runs_with_the_kinds_without_w_and_a_split_backward_kind_refuses_it_in_one_line():
    """--compile composes with --pp (contract row pp2-interleaved+compile); a kind with W passes refuses it
    before any rank starts: a compiled block's backward is one graph, which W cannot run apart from B."""
    out = cli_here("train", "--pp", "2", "--schedule", "zbv", "--compile", "--n-layers", "4", "--steps", "1")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.strip().splitlines() == [
        "tessera train: error: --schedule zbv with --compile is not supported: a compiled block's backward is one "
        "graph, which the W pass cannot run apart from B; use --schedule 1f1b (or gpipe, interleaved-1f1b, "
        "looped-bfs), or drop --compile"
    ]
    assert small_config(pp=2, n_layers=4, microbatches=2, compile=True).check() is None  # 1f1b: accepted
