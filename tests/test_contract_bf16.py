"""The numerics contract in bf16: every layout kind of the fp32 table (tests/test_contract.py) also trains in
bf16 like the one-process bf16 run, and its records say bf16 because its matmuls ran in bf16.

The tolerance, derived. A bf16 run is the exact (here: fp32) trajectory plus rounding error: each
bf16 rounding has relative error at most u = 2^-8, and a layout rounds the same quantities at the same
precision, only at other points (a row-parallel matmul rounds tp partial sums and adds them; FSDP adds
per-rank bf16 gradient contributions in fp32; ring attention merges bf16 blocks). So a layout's error
against the exact run has the size of the one-process bf16 run's own error, E = |bf16 - fp32| of the
one-process run (measured here, per quantity), and by the triangle inequality

    |layout_bf16 - one_process_bf16| <= |layout_bf16 - exact| + |exact - one_process_bf16| ~ 2 E.

The one-process bf16 run is also run re-rounded (on 2 and 4 microbatches: the same sums in another order), and
E is the largest over those runs: one run alone can land near fp32 by chance (measured on an AVX2-only CPU, whose
bf16 GEMMs round partial sums: the one-process Qwen3-MoE run 6.4e-4 from fp32 in grad norm, the same run on 2
microbatches 4.5e-3, as far as its ep2 and dp2 rows; and on an AMX CPU, the 8-layer one-process run's step-3 grad
norm 1.7e-5 from fp32 and its largest 2.2e-3, while on 4 microbatches it is 4.5e-3 away at step 3, where every pp2
row on 4 microbatches lands, on the one-process 4-microbatch run's grad norm to 7 digits).

A tp layout rounds more than one process does, not only elsewhere: each rank rounds its partial sum of a
row-parallel matmul (and of a column-parallel one's input gradient) and the shares are added in bf16, where one
process rounds the whole sum once. So for a tp row E also takes in the one-process run rounded at those points
(helpers.round_like_tp: the same partial sums in one process, no collective), on 1 and 4 microbatches. Measured on
the AMX CPU (8 layers, bf16): that run's step-1 loss equals the tp2 row's to 8 digits, and its step-3 grad norm on 4
microbatches is 1.08e-2 from fp32, where the pp2 x tp2 + SP row is 1.05e-2 away, and tp2 + SP on 4 microbatches
without pp 1.05e-2: the distance is tp's rounding, in one process, with no parallel code.

Losses and grad norms: within 2 x the largest one-process |bf16 - fp32| over the 3 steps (the error grows
with the steps as AdamW amplifies it; the largest is the scale of this model's bf16 rounding, and step 1's
alone can cancel to nearly zero by chance). Gradients of step 1 by name: ||g - g_ref|| <= 2 ||g_bf16 -
g_fp32|| of the one-process run, per tensor (Frobenius norms over many elements concentrate, so the
per-tensor scale is stable). A real bug (a missing or doubled reduction, a wrong shard, a mask off by
one) moves these by O(1) relative, orders of magnitude past 2E. The fp32 contract is unchanged.
"""

import sys

import pytest

from conftest import PIPELINE_BASE
from helpers import small_config, train_with_dtypes, train_with_dtypes_and_graphs
from shared_spawns import SharedSpawns, selected_keys

BF16 = dict(mixed_precision="bf16")
RE_ROUNDED = (2, 4)  # microbatches
# the tp degrees of each reference's tp rows, rounded in one process as on their ranks, and on which microbatches
TP_ROUNDED = {"one_process": (2, 4), "deep_one_process": (2,)}
TP_ROUNDED_MICROBATCHES = (1, 4)

# one case per layout kind of the fp32 table
LAYOUTS = {
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "tp4": dict(tp=4),  # tp beyond the kv heads: replicated kv
    "dp_shard2": dict(dp=2),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "no_shard": dict(dp=2, fsdp="NO_SHARD"),
    "hybrid_shard": dict(dp=4, dp_replicate=2, fsdp="HYBRID_SHARD"),
    "ac_full": dict(dp=2, ac="full"),
    "dp2xtp2+sp+ac_op": dict(dp=2, tp=2, sequence_parallel=True, ac="op"),
    "tp2+sp+compile": dict(tp=2, sequence_parallel=True, compile=True),
    "microbatches4": dict(microbatches=4),
    "dp2xtp2+microbatches2": dict(dp=2, tp=2, microbatches=2),
    "cp2-ring": dict(cp=2),
    "cp2-allgather": dict(cp=2, cp_method="allgather"),
    "cp2xtp2+sp-ring": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2xdp2-ring": dict(cp=2, dp=2),
    "pp2xcp2": dict(pp=2, cp=2, microbatches=2),
}

PIPELINE_LAYOUTS = {
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=4),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "pp2-zb-h1": dict(pp=2, schedule="zb-h1", microbatches=4),
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=4),
    "pp2xtp2+sp": dict(pp=2, tp=2, sequence_parallel=True, microbatches=4),
    "pp2xhsdp2x2": dict(pp=2, dp=4, dp_replicate=2, microbatches=2),
    "pp2xdp2xcp2xtp2+sp": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, microbatches=2),  # 4D, 16 ranks
}


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """This file's runs, one spawn per world size (tests/shared_spawns.py): the one-process bf16 and fp32
    references (8 layers for the pipelines) and every selected layout."""
    rows = {}
    for name, base in (("one_process", {}), ("deep_one_process", PIPELINE_BASE)):
        for precision in ("bf16", "fp32"):
            config = small_config(**base, mixed_precision=precision)
            rows[(name, precision)] = (train_with_dtypes, 1, (config,))
        rows |= {(name, kind): row for kind, row in rerounded_rows(base, TP_ROUNDED[name]).items()}
    for test, table, base in (
        ("test_layout_trains_like_one_process_in_bf16", LAYOUTS, {}),
        ("test_pipeline_layout_trains_like_one_process_in_bf16", PIPELINE_LAYOUTS, PIPELINE_BASE),
    ):
        for case, layout in table.items():
            config = small_config(**base, **layout, **BF16)
            fn = train_with_dtypes_and_graphs if layout.get("compile") else train_with_dtypes
            rows[(test, case)] = (fn, config.layout.world_size, (config,))
    references = {k for k in rows if k[0] in ("one_process", "deep_one_process")}
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]) | references)


@pytest.fixture(scope="module")
def one_process(runs):
    """(bf16 run, fp32 run) of one process."""
    return runs.result(("one_process", "bf16")), runs.result(("one_process", "fp32"))


@pytest.fixture(scope="module")
def deep_one_process(runs):
    return runs.result(("deep_one_process", "bf16")), runs.result(("deep_one_process", "fp32"))


def rerounded_rows(base: dict, tp_degrees: tuple = ()) -> dict:
    """The one-process bf16 runs of `base` (small_config's keywords) that E is measured on beside its own, by
    kind: on 2 and 4 microbatches, and rounded as on each of `tp_degrees` tp ranks (on 1 and 4 microbatches), as
    (rank function, world size 1, its arguments): rows for tests/shared_spawns.py. The Qwen3 and families files
    use them too."""
    rows = {
        f"bf16-mb{mb}": (train_with_dtypes, 1, (small_config(**base, **BF16, microbatches=mb),)) for mb in RE_ROUNDED
    }
    for tp in tp_degrees:
        for mb in TP_ROUNDED_MICROBATCHES:
            rows[f"bf16-tp{tp}-mb{mb}"] = (train_with_dtypes, 1, (small_config(**base, **BF16, microbatches=mb), tp))
    return rows


def rerounded_kinds(layout: dict, tp_rounded: bool = True) -> list[str]:
    """The kinds of `rerounded_rows` a row of `layout` measures E on: the microbatch runs, and for a tp layout
    (where `tp_rounded`) the runs rounded as on its tp degree."""
    kinds = [f"bf16-mb{mb}" for mb in RE_ROUNDED]
    if tp_rounded and layout.get("tp", 1) > 1:
        kinds += [f"bf16-tp{layout['tp']}-mb{mb}" for mb in TP_ROUNDED_MICROBATCHES]
    return kinds


def rerounded(runs, name: str, layout: dict) -> tuple:
    """The one-process bf16 runs of reference `name` that a row of `layout` measures E on."""
    return tuple(runs.result((name, kind)) for kind in rerounded_kinds(layout))


def assert_trains_like_one_process_in_bf16(
    case: str, run, one_process, bf16_share: float = 0.9, rerounded: tuple = ()
) -> None:
    """`bf16_share`: the least share of matmul FLOPs in bf16 (the rest is the CPU attention kernel's fp32).
    `rerounded`: more one-process bf16 runs that differ from the reference only by where they round (2 and 4
    microbatches; for a tp row also rounded as on its tp ranks: `rerounded`); E is then the largest |bf16 - fp32|
    over all of them (the scale of the bf16 rounding, which one run alone can understate: on a CPU whose bf16
    GEMMs round partial sums, AVX2-only, the one-process MoE run's grad norms came within 6.4e-4 of fp32 while the
    same run on 2 microbatches was 4.5e-3 away)."""
    losses, norms, grads, dtypes, flops = run
    (ref_losses, ref_norms, ref_grads, _, _), (fp_losses, fp_norms, fp_grads, _, _) = one_process
    assert dtypes == ["bfloat16"] * 3, f"{case}: the records say the matmuls ran in {dtypes}"
    assert flops["bfloat16"] > bf16_share * sum(flops.values()), f"{case}: matmul FLOPs by dtype {flops}"
    bf16s = [one_process[0], *rerounded]
    loss_tol = 2 * max(abs(a - b) for one in bf16s for a, b in zip(one[0], fp_losses))
    norm_tol = 2 * max(abs(a - b) for one in bf16s for a, b in zip(one[1], fp_norms))
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= loss_tol, (
            f"{case} step {step}: loss {a} vs one-process bf16 {b} (tolerance {loss_tol:.2e})"
        )
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= norm_tol, (
            f"{case} step {step}: grad norm {a} vs one-process bf16 {b} (tolerance {norm_tol:.2e})"
        )
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        tol = 2 * max((one[2][name] - fp_grads[name]).norm() for one in bf16s)
        err = (g - ref_grads[name]).norm()
        assert err <= tol, f"{case} {name}: ||g - g_ref|| = {err:.3e} > 2 ||g_bf16 - g_fp32|| = {tol:.3e}"


def test_bf16_differs_from_fp32_on_one_process(one_process):
    (bf16_losses, _, _, bf16_dtypes, flops), (fp32_losses, _, _, fp32_dtypes, _) = one_process
    assert bf16_dtypes == ["bfloat16"] * 3 and fp32_dtypes == ["float32"] * 3
    assert all(a != b for a, b in zip(bf16_losses, fp32_losses))
    assert flops["bfloat16"] > 0.9 * sum(flops.values())


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layout_trains_like_one_process_in_bf16(one_process, runs, case):
    run = runs.result(("test_layout_trains_like_one_process_in_bf16", case))
    assert_trains_like_one_process_in_bf16(
        case, run[:5], one_process, rerounded=rerounded(runs, "one_process", LAYOUTS[case])
    )
    if "compile" in case:
        # the blocks compile after the probed step 1 (dynamo skips frames under its dispatch mode), and a compiled
        # tp2 + SP block is one graph: tessera's collective bookkeeping (a ContextVar) once broke it at every tp
        # collective, into 12 graphs
        graphs, breaks = run[5:]
        assert graphs == 1 and breaks == {}, (case, graphs, breaks)


@pytest.mark.parametrize("case", list(PIPELINE_LAYOUTS))
def test_pipeline_layout_trains_like_one_process_in_bf16(deep_one_process, runs, case):
    run = runs.result(("test_pipeline_layout_trains_like_one_process_in_bf16", case))
    more = rerounded(runs, "deep_one_process", PIPELINE_LAYOUTS[case])
    assert_trains_like_one_process_in_bf16(case, run, deep_one_process, rerounded=more)
