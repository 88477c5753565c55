"""Communication accounting (--comm-stats): the bytes each mesh axis moved in a step, counted at the
dispatcher (tessera's collectives and FSDP2's), equal the analytic volumes of topology/estimators/comm_model.py."""

import sys

import pytest

from helpers import comm_of_first_step, small_config
from shared_spawns import SharedSpawns, selected_keys
from tessera.topology.axes import COMM_AXES

AXES = COMM_AXES  # every accounting name: ep too (a dense model sends nothing over it; tests/test_moe_accounting.py)
FOUR_D = dict(
    n_layers=8,
    global_batch=8,
    pp=2,
    dp=2,
    cp=2,
    tp=2,
    sequence_parallel=True,
    microbatches=2,
    comm_stats="every",
    steps=1,
)


def assert_matches_analytic(case: str, results) -> None:
    for rank, (counted, analytic, _) in enumerate(results):
        total = sum(counted.values())
        for axis in AXES:
            want, got = analytic[axis], counted.get(axis, 0.0)
            if want:
                assert abs(got - want) <= 0.02 * want, (
                    f"{case} rank {rank} {axis}: counted {got:.0f} B, analytic {want:.0f} B"
                )
            else:  # only scalars (loss, grad-norm partials) may travel over an axis the model says is silent
                assert got <= 1e-3 * total, f"{case} rank {rank} {axis}: {got:.0f} B counted, none predicted"
        assert counted.get("world", 0.0) <= 1e-3 * total  # the straggler watch's step times


FOUR_D_CASES = [
    ("pp2 x dp2 x cp2 x tp2 + sp", {}),
    (
        "pp2 x dp2 x cp2 x tp2 interleaved, allgather cp",
        dict(schedule="interleaved-1f1b", virtual=2, cp_method="allgather"),
    ),
]
ONE_AXIS_LAYOUTS = [
    dict(dp=4, dp_replicate=2, microbatches=2),
    dict(dp=2, tp=2, ac="full"),
    dict(dp=4, fsdp="SHARD_GRAD_OP"),
    dict(cp=2, tp=2, sequence_parallel=True, ac="selective"),
    dict(cp=2, tp=2, sequence_parallel=True, ac="op"),
    dict(cp=2, dp=2, pack_documents=True, ac="full"),
]
FSDP_STRATEGIES = ("FULL_SHARD", "NO_SHARD")


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """Every rank's first-step bytes of each layout, one spawn per world size (tests/shared_spawns.py)."""
    rows = {}
    for case, layout in FOUR_D_CASES:
        rows[("test_a_4d_step_moves_the_analytic_bytes_per_axis", case)] = (
            comm_of_first_step,
            16,
            (small_config(**{**FOUR_D, **layout}),),
        )
    for layout in ONE_AXIS_LAYOUTS:
        config = small_config(**layout, global_batch=8, comm_stats="every", steps=1)
        rows[("test_one_axis_layouts_move_the_analytic_bytes", str(layout))] = (
            comm_of_first_step,
            config.layout.world_size,
            (config,),
        )
    for strategy in FSDP_STRATEGIES:
        config = small_config(dp=4, fsdp=strategy, comm_stats="every", steps=1)
        rows[("fsdp", strategy)] = (comm_of_first_step, 4, (config,))
    selected = selected_keys(session, sys.modules[__name__], "layout") | selected_keys(
        session, sys.modules[__name__], "case"
    )
    selected |= {("fsdp", s) for s in FSDP_STRATEGIES}
    return SharedSpawns(rows, selected, every_rank=True)


@pytest.mark.parametrize("case, layout", FOUR_D_CASES)
def test_a_4d_step_moves_the_analytic_bytes_per_axis(runs, case, layout):
    config = small_config(**{**FOUR_D, **layout})
    results = runs.result(("test_a_4d_step_moves_the_analytic_bytes_per_axis", case))
    assert_matches_analytic(case, results)
    counted = results[0][0]
    assert all(
        counted.get(axis, 0) > 0
        for axis in ("tp", "pp", "dp_shard_cp" if config.layout.dp_shard * config.layout.cp > 1 else "tp")
    )


@pytest.mark.parametrize("layout", ONE_AXIS_LAYOUTS, ids=str)
def test_one_axis_layouts_move_the_analytic_bytes(runs, layout):
    assert_matches_analytic(str(layout), runs.result(("test_one_axis_layouts_move_the_analytic_bytes", str(layout))))


def test_fsdp_moves_one_and_a_half_times_ddp(runs):
    """ZeRO-3 / FULL_SHARD: all-gather twice and reduce-scatter once, 3 (n-1)/n x parameter bytes; DDP's
    all-reduce 2 (n-1)/n x (NO_SHARD puts the four ranks on dp_replicate)."""
    from tessera.models import get_preset

    P = get_preset("debug").num_params() * 4
    counted = {}
    for strategy in FSDP_STRATEGIES:
        results = runs.result(("fsdp", strategy))
        assert_matches_analytic(f"dp4 {strategy}", results)
        counted[strategy] = results[0][0]
    full, ddp = counted["FULL_SHARD"], counted["NO_SHARD"]
    assert full["dp_shard_cp"] == pytest.approx(3 * 3 / 4 * P, rel=0.02)  # FSDP2 pads shards: within 2%
    assert ddp["dp_replicate"] == pytest.approx(2 * 3 / 4 * P, rel=0.02)
    assert full["dp_shard_cp"] / ddp["dp_replicate"] == pytest.approx(1.5, rel=0.02)
