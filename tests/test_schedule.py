"""Pipeline schedules are pure values: property tests over stages 1-8, microbatches 1-32, virtual 1-4."""

from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.parallel.pipeline import build_schedule
from tessera.topology.schedules.schedule import KINDS, SPLIT_BACKWARD, Action, check_schedule
from tessera.topology.schedules.simulator import render, simulate, validate
from tessera.topology.errors import ConfigError
from tessera.topology.schedules.schedule import (
    VIRTUAL_KINDS,
    DEFAULT_COSTS,
    fill_weight_passes,
    placement_of,
    stage_rank,
)
from tessera.topology.schedules.simulator import fused_backwards

stages = st.integers(1, 8)
microbatches = st.integers(1, 32)
virtuals = st.integers(1, 4)


def buildable(kind, p, m, v):
    try:
        check_schedule(kind, p, m, v)
        return True
    except ValueError:
        return False


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KINDS), stages, microbatches, virtuals)
def test_every_microbatch_runs_each_op_once_per_stage_in_dependency_order(kind, p, m, v):
    assert_runs_each_op_once_per_stage_in_dependency_order(kind, p, m, v)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(KINDS), st.sampled_from([8, 16]), st.integers(1, 8), st.integers(1, 8))
def test_schedules_at_production_sizes_run_each_op_once_in_dependency_order(kind, p, rounds, v):
    """The published runs' pipelines and beyond: pp 8 and 16, up to 8 virtual stages per rank (Megatron-Bridge's
    pp 8 x vp 5 and pp 8 x vp 8), up to 128 microbatches (whole rounds of pp, as interleaved kinds need)."""
    v = v if kind in VIRTUAL_KINDS else (2 if kind in ("zbv", "dualpipev") else 1)
    assert_runs_each_op_once_per_stage_in_dependency_order(kind, p, rounds * p, v)


def assert_runs_each_op_once_per_stage_in_dependency_order(kind: str, p: int, m: int, v: int) -> None:
    assume(buildable(kind, p, m, v))
    schedule = build_schedule(kind, p, m, v)
    assert len(schedule) == p
    ops = ("F", "B", "W") if kind in SPLIT_BACKWARD else ("F", "B")
    everything = [a for row in schedule for a in row]
    assert sorted(everything) == sorted(Action(op, i, s) for op in ops for i in range(m) for s in range(p * v))
    for r, row in enumerate(schedule):
        assert all(stage_rank(a.stage, p, placement_of(kind)) == r for a in row)  # s % pp, or on zbv's V
        where = {a: k for k, a in enumerate(row)}
        for a in row:
            if a.op == "B":
                assert where[Action("F", a.microbatch, a.stage)] < where[a]
            if a.op == "W":
                assert where[Action("B", a.microbatch, a.stage)] < where[a]
    timeline = simulate(schedule)  # raises on a deadlock
    assert simulate(schedule, checked=True) == timeline  # the planner's: build_schedule's output, not validated again
    finished = {a: end for row in timeline.ranks for _, end, a in row}
    started = {a: start for row in timeline.ranks for start, _, a in row}
    last = p * v - 1
    for a in everything:  # cross-stage dependencies hold in time
        if a.op == "F" and a.stage > 0:
            assert started[a] >= finished[Action("F", a.microbatch, a.stage - 1)]
        if a.op == "B":
            dep = Action("F", a.microbatch, last) if a.stage == last else Action("B", a.microbatch, a.stage + 1)
            assert started[a] >= finished[dep]


@settings(max_examples=200, deadline=None)
@given(stages, microbatches)
def test_1f1b_holds_at_most_pp_minus_r_activations_on_rank_r(p, m):
    assume(m >= p)
    peaks = simulate(build_schedule("1f1b", p, m)).peak_activations
    assert all(peak <= p - r for r, peak in enumerate(peaks))
    assert peaks[0] == p  # and rank 0 does fill its warm-up: the bound is tight
    assert simulate(build_schedule("gpipe", p, m)).peak_activations == [m] * p


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), stages, microbatches, virtuals)
def test_unit_cost_bubble_equals_the_closed_form(kind, p, m, v):
    if kind != "interleaved-1f1b":
        v = 1
    assume(buildable(kind, p, m, v))
    timeline = simulate(build_schedule(kind, p, m, v), {"F": 1, "B": 1, "W": 0})
    assert timeline.bubble == pytest.approx(float(Fraction(p - 1, v * m + p - 1)), abs=1e-12)
    assert timeline.makespan == 2 * (v * m + p - 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), microbatches)
def test_zero_bubble_beats_1f1b_when_microbatches_are_at_least_twice_the_stages(p, m):
    assume(m >= 2 * p)
    costs = {"F": 1, "B": 1, "W": 1}
    zb = simulate(build_schedule("zb-h1", p, m), costs)
    one_f_one_b = simulate(build_schedule("1f1b", p, m), costs)  # its B costs B + W
    assert zb.bubble < one_f_one_b.bubble
    assert zb.makespan == 3 * m + p - 1  # ZB-H1's bubble: (p-1) (F + B - W)
    assert zb.peak_activations == one_f_one_b.peak_activations  # at 1F1B's activation memory


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(1, 8), st.integers(2, 4))
def test_interleaved_zero_bubble_beats_interleaved_1f1b_holding_virtual_x_pp_activations(p, rounds, v):
    """With F = B = W, splitting the backward shortens interleaved 1F1B's step, never lengthens it (bubble
    (p-1)/(3 v m + p-1)), with no more activations in flight, and every rank holds v x pp activations at most
    (F run, W not yet): the W's run right after a B from the rank's (r + 1)-th backward on."""
    m = p * rounds
    costs = {"F": 1, "B": 1, "W": 1}
    zb = simulate(build_schedule("interleaved-zb", p, m, v), costs)
    interleaved = simulate(build_schedule("interleaved-1f1b", p, m, v), costs)  # its B costs B + W
    assert zb.makespan <= interleaved.makespan and zb.bubble < interleaved.bubble
    assert zb.bubble == pytest.approx(float(Fraction(p - 1, 3 * v * m + p - 1)), abs=1e-12)
    assert all(a <= b for a, b in zip(zb.peak_activations, interleaved.peak_activations))
    assert zb.peak_held_activations == [v * p] * p
    assert max(zb.peak_pending_weight_grads) <= p


@settings(max_examples=100, deadline=None)
@given(stages, microbatches, virtuals)
def test_looped_bfs_runs_every_forward_of_a_stage_before_the_next_and_holds_them_all(p, m, v):
    schedule = build_schedule("looped-bfs", p, m, v)
    for r, row in enumerate(schedule):
        forwards = [a.stage for a in row if a.op == "F"]
        assert forwards == sorted(forwards) and len(forwards) == m * v
    assert simulate(schedule).peak_activations == [m * v] * p


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12))
def test_filling_weight_passes_keeps_the_order_and_bounds_the_pending(p, m):
    """fill_weight_passes on 1F1B's order: the F/B order is kept, each W after its B, and never more than
    max_pending + 1 pending."""
    assume(m >= p)
    order = build_schedule("1f1b", p, m)
    for cap in (0, 1, p):
        filled = fill_weight_passes(order, max_pending=cap)
        for r in range(p):
            assert [a for a in filled[r] if a.op != "W"] == order[r]
        timeline = simulate(filled)
        assert max(timeline.peak_pending_weight_grads) <= cap + 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4))
def test_zbv_puts_two_stages_on_each_rank_in_a_v_and_beats_1f1b(p, rounds):
    """zbv: rank r runs stages r and 2 pp - 1 - r (stage 0 and the last on rank 0), and with F = B = W its
    step is no longer than 1F1B's with the same layers per rank (two half-size stages: F, B, W cost 1/2)."""
    m = p * rounds
    schedule = build_schedule("zbv", p, m, 2)
    assert [sorted({a.stage for a in row}) for row in schedule] == [sorted({r, 2 * p - 1 - r}) for r in range(p)]
    half = simulate(schedule, {"F": 0.5, "B": 0.5, "W": 0.5})
    one_f_one_b = simulate(build_schedule("1f1b", p, m), {"F": 1, "B": 1, "W": 1})
    assert half.makespan <= one_f_one_b.makespan
    if p > 1 and m >= 2 * p:
        assert half.bubble < one_f_one_b.bubble


def _torch_order(schedule_class, rank_count, **attributes):
    """torch.distributed.pipelining's own order for `schedule_class` (its per-rank list, computed without
    stages: `attributes` are what its _calculate_single_rank_operations reads) in tessera's actions: an
    overlapped F/B pair as its two actions, a full backward as B with its W, torch's idle slots left out."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, schedule_class):
        pytest.skip(f"this torch has no {schedule_class}")
    op = {schedules.FORWARD: "F", schedules.BACKWARD_INPUT: "B", schedules.BACKWARD_WEIGHT: "W"}
    fake = SimpleNamespace(**attributes)
    out = []
    for r in range(rank_count):
        row = []
        for a in getattr(schedules, schedule_class)._calculate_single_rank_operations(fake, r):
            for x in (a.sub_actions or (a,)) if a is not None else ():
                if x.computation_type == schedules.FULL_BACKWARD:
                    row += [
                        Action("B", x.microbatch_index, x.stage_index),
                        Action("W", x.microbatch_index, x.stage_index),
                    ]
                else:
                    row.append(Action(op[x.computation_type], x.microbatch_index, x.stage_index))
        out.append(row)
    return out


def _torch_dualpipev(p, m):
    """torch's ScheduleDualPipeV order in tessera's actions."""
    return _torch_order("ScheduleDualPipeV", p, pp_group_size=p, _n_microbatches=m)


def _torch_zbv(p, m):
    """torch's ScheduleZBVZeroBubble order in tessera's actions (torch plans max(m, 2 pp - 1) microbatches
    and leaves the slots of those past m idle)."""
    return _torch_order("ScheduleZBVZeroBubble", p, pp_group_size=p, _n_microbatches=m, num_stages=2 * p)


def _torch_interleaved_zb(p, m, v):
    """torch's ScheduleInterleavedZeroBubble order in tessera's actions, or None for a microbatch count torch
    refuses (not a multiple of its max(1, m // pp) rounds)."""
    rounds = max(1, m // p)
    if m % rounds:
        return None
    return _torch_order(
        "ScheduleInterleavedZeroBubble",
        p,
        pp_group_size=p,
        _n_microbatches=m,
        n_local_stages=v,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
    )


COST_MODELS = [  # F = B = W; a cheap W; the ratios benchmarks/bench_pipeline.py measures on CPU (F 1, B 1.25, W 0.75)
    {"F": 1, "B": 1, "W": 1},
    {"F": 1, "B": 1, "W": 0.5},
    {"F": 1, "B": 1.3, "W": 0.8},
]


@pytest.mark.parametrize("p", range(1, 7))
def test_zbv_is_torchs_order_and_with_pp_microbatches_idles_less_at_torchs_held_activations(p):
    """zbv lists exactly torch's ScheduleZBVZeroBubble actions for pp + 1 to 4 pp + 2 microbatches (each W right
    after its B: 2 pp activations held per rank at most). With pp microbatches (torch's order idles where the
    microbatches it lacks would run) it keeps torch's F/B order and holds on each rank what torch's holds, and
    its bubble is no larger than torch's under each cost model (smaller from pp = 2 on)."""
    for m in range(p + 1, 4 * p + 3):
        schedule = build_schedule("zbv", p, m, 2)
        assert schedule == _torch_zbv(p, m), m
        assert max(simulate(schedule).peak_held_activations) <= 2 * p
    schedule, torchs = build_schedule("zbv", p, p, 2), _torch_zbv(p, p)
    assert [[a for a in row if a.op != "W"] for row in schedule] == [[a for a in row if a.op != "W"] for row in torchs]
    for costs in COST_MODELS:
        mine, theirs = simulate(schedule, costs), simulate(torchs, costs)
        assert mine.peak_held_activations == theirs.peak_held_activations
        assert mine.bubble <= theirs.bubble + 1e-12
        if p > 1:
            assert mine.bubble < theirs.bubble


@pytest.mark.parametrize("p", range(1, 7))
def test_interleaved_zb_is_torchs_order_holding_virtual_x_pp_activations(p):
    """interleaved-zb lists exactly torch's ScheduleInterleavedZeroBubble actions, for 1 to 4 stages per rank
    and every microbatch count up to 4 pp + 2 that both accept (with one stage per rank: zb-h1's order, for
    counts torch refuses too); each rank holds virtual x pp activations at most, at the unit-cost bubble
    (p-1)/(3 v m + p-1)."""
    for v in range(1, 5):
        for m in range(p, 4 * p + 3):
            if not buildable("interleaved-zb", p, m, v):
                continue
            schedule = build_schedule("interleaved-zb", p, m, v)
            torchs = _torch_interleaved_zb(p, m, v)
            if torchs is not None:
                assert schedule == torchs, (m, v)
            if v == 1:
                assert schedule == build_schedule("zb-h1", p, m)
            timeline = simulate(schedule)
            assert timeline.peak_held_activations == [v * p] * p
            assert timeline.bubble == pytest.approx(float(Fraction(p - 1, 3 * v * m + p - 1)), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12))
def test_dualpipev_is_torchs_order_on_the_v_holds_at_most_2pp_plus_1_and_beats_zbv(p, extra):
    """dualpipev lists exactly torch's ScheduleDualPipeV actions (written independently from DeepSeek's steps);
    on zbv's V it holds at most 2 pp + 1 activations per rank, its bubble is no larger than zbv's, and with
    half-size stages its step is no longer than 1F1B's over the same layers."""
    m = 2 * p + extra
    schedule = build_schedule("dualpipev", p, m, 2)
    assert schedule == _torch_dualpipev(p, m)
    assert [sorted({a.stage for a in row}) for row in schedule] == [sorted({r, 2 * p - 1 - r}) for r in range(p)]
    timeline = simulate(schedule)
    assert max(timeline.peak_held_activations) <= 2 * p + 1
    assert timeline.bubble <= simulate(build_schedule("zbv", p, m, 2)).bubble + 1e-12
    half = simulate(schedule, {"F": 0.5, "B": 0.5, "W": 0.5})
    assert half.makespan <= simulate(build_schedule("1f1b", p, m), {"F": 1, "B": 1, "W": 1}).makespan


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SPLIT_BACKWARD), st.integers(1, 6), st.integers(1, 24), st.integers(1, 3))
def test_a_b_runs_with_its_w_where_no_rank_waits_longer_for_it(kind, p, m, v):
    """fused_backwards picks only B's whose W comes next; every pair whose input gradient stays on its rank;
    and pairs that send it to another rank only where the simulated makespan is no longer for it."""
    v = 2 if kind in ("zbv", "dualpipev") else v
    assume(buildable(kind, p, m, v))
    schedule = build_schedule(kind, p, m, v)
    placement = placement_of(kind)
    fused = fused_backwards(schedule, placement)
    pairs = [
        {k for k, a in enumerate(row[:-1]) if a.op == "B" and row[k + 1] == Action("W", a.microbatch, a.stage)}
        for row in schedule
    ]
    local = [
        {k for k in pairs[r] if row[k].stage == 0 or stage_rank(row[k].stage - 1, p, placement) == r}
        for r, row in enumerate(schedule)
    ]
    assert all(local[r] <= fused[r] <= pairs[r] for r in range(p))

    def makespan(chosen):
        durations = {}
        for r, row in enumerate(schedule):
            for k in chosen[r]:
                durations[row[k]], durations[row[k + 1]] = DEFAULT_COSTS["B"] + DEFAULT_COSTS["W"], 0.0
        return simulate(schedule, durations=durations).makespan

    assert makespan(fused) <= min(makespan(pairs), makespan(local))
    if fused != pairs:  # remote pairs split only when that is strictly faster
        assert makespan(local) < makespan(pairs)


def test_zbv_splits_the_pairs_a_peer_waits_for_and_dualpipev_keeps_its_full_backwards_on_two_ranks():
    """The two cases measured on CPU (pp 2, 8 and 16 microbatches): zbv idled 3% more with its B's and W's as
    one pass, dualpipev's full backwards ran 1-3% slower split."""
    zbv = build_schedule("zbv", 2, 8, 2)
    assert [len(f) for f in fused_backwards(zbv, "v")] == [8, 7]  # rank 1's stage-2 pairs: local (stage 1 on it)
    assert all(zbv[0][k].stage == 0 for k in fused_backwards(zbv, "v")[0])
    dualpipev = build_schedule("dualpipev", 2, 8, 2)
    pairs = [
        sum(a.op == "B" and row[k + 1] == Action("W", a.microbatch, a.stage) for k, a in enumerate(row[:-1]))
        for row in dualpipev
    ]
    assert [len(f) for f in fused_backwards(dualpipev, "v")] == pairs


def test_a_deadlocking_schedule_is_named():
    # rank 0 waits for B0 from rank 1 before sending F1; rank 1 wants F1 first: a cycle
    bad = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        [Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1)],
    ]
    with pytest.raises(ValueError) as e:
        simulate(bad)
    assert str(e.value) == (
        "the schedule deadlocks: rank 0 position 1 (B0@0) waits for B0@1 (rank 1 position 2); "
        "rank 1 position 0 (F1@1) waits for F1@0 (rank 0 position 2)"
    )


def test_malformed_schedules_are_refused_naming_the_first_bad_action():
    good = build_schedule("gpipe", 2, 2)
    with pytest.raises(ValueError, match="B1@1 is missing: rank 1 runs F1@1 at position 1 but never its B"):
        validate([good[0], good[1][:-1]])
    with pytest.raises(
        ValueError, match=r"rank 0 position 4 \(F0@0\): F0@0 appears twice \(first at rank 0 position 0\)"
    ):
        validate([good[0] + [good[0][0]], good[1]])
    with pytest.raises(ValueError, match=r"rank 0 position 0 \(B1@0\) comes before F1@0 \(position 2\)"):
        validate([good[0][::-1], good[1]])
    with pytest.raises(ValueError, match=r"rank 1 position 0 \(F0@0\): stage 0 has actions on ranks 0 and 1"):
        validate([good[0][1:], [good[0][0]] + good[1]])
    with pytest.raises(ValueError, match=r"rank 0 position 0 \(X0@0\) has op 'X'"):
        validate([[Action("X", 0, 0)]])
    with pytest.raises(ValueError, match=r"rank 0 position 0 \(F-1@0\): stage and microbatch must be integers >= 0"):
        validate([[Action("F", -1, 0)]])


@pytest.mark.parametrize(
    "args, message",
    [
        (("1f1b", 4, 2), "needs at least as many microbatches as stages: microbatches=2 < pp=4"),
        (("zb-h1", 4, 3), "microbatches=4 or more"),
        (("interleaved-1f1b", 2, 3, 2), "microbatches=3 is not a multiple of pp=2; use microbatches=4"),
        (("1f1b", 2, 4, 2), "virtual=2 needs schedule=interleaved-1f1b"),
        (("pipedream", 2, 4), "unknown pipeline schedule=pipedream"),
        (("dualpipev", 2, 3, 2), "microbatches=3 < 2 x pp=2; use microbatches=4 or more"),
        (("dualpipev", 2, 4, 1), "schedule=dualpipev runs two stages per rank on a V: use virtual=2 (not 1)"),
    ],
)
def test_bad_schedule_arguments_name_the_value_and_the_fix(args, message):
    """The library names PipelineConfig's and Layout's parameters (the CLI writes its flags for them)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(*args)


def test_render_draws_one_row_per_rank():
    text = render(simulate(build_schedule("1f1b", 2, 2)))
    assert text.splitlines() == ["rank 0 | F0  F1  .   .   B0  b   .   B1  b", "rank 1 | .   F0  B0  b   F1  B1  b"]
