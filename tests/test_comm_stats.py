"""Communication accounting (--comm-stats): the bytes each mesh axis moved in a step, counted at the
dispatcher (tessera's collectives and FSDP2's), equal the analytic volumes of topology/comm_model.py."""

import pytest

from helpers import comm_of_first_step, small_config
from tessera.parallel.launch import run_ranks
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


@pytest.mark.parametrize(
    "case, layout",
    [
        ("pp2 x dp2 x cp2 x tp2 + sp", {}),
        (
            "pp2 x dp2 x cp2 x tp2 interleaved, allgather cp",
            dict(schedule="interleaved-1f1b", virtual=2, cp_method="allgather"),
        ),
    ],
)
def test_a_4d_step_moves_the_analytic_bytes_per_axis(case, layout):
    config = small_config(**{**FOUR_D, **layout})
    results = run_ranks(comm_of_first_step, config.layout.world_size, config, timeout=240)
    assert_matches_analytic(case, results)
    counted = results[0][0]
    assert all(
        counted.get(axis, 0) > 0
        for axis in ("tp", "pp", "dp_shard_cp" if config.layout.dp_shard * config.layout.cp > 1 else "tp")
    )


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=4, dp_replicate=2, microbatches=2),
        dict(dp=2, tp=2, ac="full"),
        dict(dp=4, fsdp="SHARD_GRAD_OP"),
        dict(cp=2, tp=2, sequence_parallel=True, ac="selective"),
        dict(cp=2, tp=2, sequence_parallel=True, ac="op"),
        dict(cp=2, dp=2, pack_documents=True, ac="full"),
    ],
    ids=str,
)
def test_one_axis_layouts_move_the_analytic_bytes(layout):
    config = small_config(**layout, global_batch=8, comm_stats="every", steps=1)
    assert_matches_analytic(str(layout), run_ranks(comm_of_first_step, config.layout.world_size, config, timeout=120))


def test_fsdp_moves_one_and_a_half_times_ddp():
    """ZeRO-3 / FULL_SHARD: all-gather twice and reduce-scatter once, 3 (n-1)/n x parameter bytes; DDP's
    all-reduce 2 (n-1)/n x (NO_SHARD puts the four ranks on dp_replicate)."""
    from tessera.models import get_preset

    P = get_preset("debug").num_params() * 4
    runs = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        results = run_ranks(
            comm_of_first_step, 4, small_config(dp=4, fsdp=strategy, comm_stats="every", steps=1), timeout=120
        )
        assert_matches_analytic(f"dp4 {strategy}", results)
        runs[strategy] = results[0][0]
    full, ddp = runs["FULL_SHARD"], runs["NO_SHARD"]
    assert full["dp_shard_cp"] == pytest.approx(3 * 3 / 4 * P, rel=0.02)  # FSDP2 pads shards: within 2%
    assert ddp["dp_replicate"] == pytest.approx(2 * 3 / 4 * P, rel=0.02)
    assert full["dp_shard_cp"] / ddp["dp_replicate"] == pytest.approx(1.5, rel=0.02)
