"""The numerics contract under --optimizer muon: every layout trains like one-process Muon.

Each row runs 3 Muon steps (AdamW on the embeddings, head and norms) on CPU ranks over gloo and is compared
with the one-process run: per-step losses and grad norms within 1e-5 relative (the fp32 contract's), and
every parameter after the 3 steps by one-process name. Rows of one world size share one spawn. A planted bug
(each rank orthogonalizing its own shard instead of the whole matrix) must fail the comparison, by name.
"""

import pytest
import torch

from muon_ranks import muon_runs
from tessera.parallel.launch import run_ranks

MOE = dict(model="qwen3-moe-debug")
PP = dict(microbatches=2)
ROWS = {
    2: {
        "dp2": dict(dp=2),
        "dp2-shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
        "tp2+sp": dict(tp=2, sequence_parallel=True),
        "cp2": dict(cp=2),
        "pp2-1f1b": dict(pp=2, schedule="1f1b", **PP),
        "pp2-zb-h1": dict(pp=2, schedule="zb-h1", **PP),
        "ep2-qwen3-moe": dict(dp=2, ep=2, **MOE),
    },
    4: {
        "hsdp2x2": dict(dp=4, dp_replicate=2),
        "tp4": dict(tp=4),
        "dp2xtp2": dict(dp=2, tp=2),
    },
    16: {"pp2xdp2xcp2xtp2": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, **PP)},
}
PLANTED = "dp2xtp2"  # the bug planted on a layout whose matrices are sharded over both dp and tp


def assert_like_one_process(case: str, run, reference) -> None:
    losses, norms, params, _ = run
    ref_losses, ref_norms, ref_params, _ = reference
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: loss {a} vs one-process {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: grad norm {a} vs one-process {b}"
    assert_parameters_like(case, params, ref_params)


def assert_parameters_like(case: str, params, ref_params) -> None:
    """Every parameter within the contract; the message names every one that is not."""
    assert sorted(params) == sorted(ref_params)
    apart = [name for name, p in params.items() if not torch.allclose(p, ref_params[name], rtol=1e-5, atol=1e-6)]
    worst = {n: float((params[n] - ref_params[n]).abs().max()) for n in apart}
    assert not apart, f"{case}: parameters apart from one process after 3 steps (max abs difference): {worst}"


@pytest.fixture(scope="module")
def runs():
    """Every row's run, and the one-process references (debug and Qwen3-MoE debug), by name."""
    references = run_ranks(muon_runs, 1, [({}, False), (MOE, False)], timeout=120)[0]
    out = {"one-process": references[0], "one-process-moe": references[1]}
    for world, rows in ROWS.items():
        cases = [(kw, False) for kw in rows.values()] + ([(ROWS[4][PLANTED], True)] if world == 4 else [])
        results = run_ranks(muon_runs, world, cases, timeout=240)[0]
        out.update(zip(rows, results))
        if world == 4:
            out["planted"] = results[-1]
    return out


@pytest.mark.parametrize("case", [name for rows in ROWS.values() for name in rows])
def test_muon_layout_trains_like_one_process(runs, case):
    reference = runs["one-process-moe" if "moe" in case else "one-process"]
    assert_like_one_process(case, runs[case], reference)


def test_the_orthogonalization_is_spread_over_the_ranks(runs):
    """No rank orthogonalizes every matrix: the FLOPs' max / mean over the ranks of dp2 x tp2."""
    flops = runs["dp2xtp2"][3]
    assert min(flops) > 0
    assert max(flops) / (sum(flops) / len(flops)) <= 1.25, flops


def test_a_shard_orthogonalized_alone_is_caught_by_name(runs):
    with pytest.raises(AssertionError, match=r"dp2xtp2: .*'layers\.0\.attention\.wo\.weight'"):
        assert_parameters_like(PLANTED, runs["planted"][2], runs["one-process"][2])
