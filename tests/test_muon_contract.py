"""The numerics contract under --optimizer muon: every layout trains like one-process Muon, in fp32 and bf16.

Each row runs 3 Muon steps (AdamW on the embeddings, head and norms) on CPU ranks over gloo and is compared
with the one-process run: per-step losses and grad norms within 1e-5 relative (the fp32 contract's), and
every parameter after the 3 steps by one-process name, within 1e-5 relative per tensor (assert_parameters_like).
Rows of one world size share one spawn, the bf16 rows included. A planted bug (each rank orthogonalizing its own
shard instead of the whole matrix) must fail the comparison, by name.

bf16 rows (--mixed-precision bf16; Newton-Schulz then runs in bf16 too, the run's matmul dtype) are held to
the bf16 contract's derived tolerance (tests/test_contract_bf16.py): a layout rounds the same quantities
at the same precision at other points, so its distance to one-process bf16 Muon is at most about twice the
one-process bf16 run's own distance E = |bf16 - fp32|. Losses and grad norms: within 2 x the largest E over
the 3 steps; every parameter after the 3 steps: ||p - p_ref|| <= 2 E_p, E_p = ||p_bf16 - p_fp32||, per
matrix, and over AdamW's parameters together: AdamW's first steps are nearly sign(g) x lr per element, so
one element of a 64-element norm weight whose gradient is near zero may step the other way (cp2 does, once:
one element 2.6e-3 apart, its step-1 gradient within the bf16 contract), and the Frobenius norm's
concentration, which the per-tensor bound rests on, needs many elements. The records must say bf16 (the
dtype the matmuls ran in, measured), not the configured one.

E is measured on three one-process bf16 runs that differ only by where they round (1, 2 and 4 microbatches:
no distributed code) and the largest taken. One run's E is a single sample of the rounding error's size,
and under bf16 Muon a small one: Newton-Schulz raises every singular direction of the update to ~1, the
rounding noise's too, so bf16 runs scatter more widely than under AdamW, and the 1-microbatch run happens
to land near fp32 (its step-3 loss 5e-5 from fp32's, the 2-microbatch run's 4e-4 and exactly dp2's).
The planted shard-alone bug in bf16 must still fail by name (O(1) apart, not O(E)).
"""

import math

import pytest
import torch

from muon_ranks import muon_run
from shared_spawns import each_in_turn
from tessera.models.spec import get_spec
from tessera.launching.launch import run_ranks

MOE = dict(model="qwen3-moe-debug")
PP = dict(microbatches=2)
BF16 = dict(mixed_precision="bf16")
ROWS = {
    2: {
        "dp2": dict(dp=2),
        "dp2-shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
        "dp2-no_shard": dict(dp=2, fsdp="NO_SHARD"),
        "tp2+sp": dict(tp=2, sequence_parallel=True),
        "cp2": dict(cp=2),
        "pp2-1f1b": dict(pp=2, schedule="1f1b", **PP),
        "pp2-zb-h1": dict(pp=2, schedule="zb-h1", **PP),
        "ep2-qwen3-moe": dict(dp=2, ep=2, **MOE),
    },
    4: {
        "dp4": dict(dp=4),
        "hsdp2x2": dict(dp=4, dp_replicate=2),
        "hybrid_shard2x2": dict(dp=4, dp_replicate=2, fsdp="HYBRID_SHARD"),
        "tp4": dict(tp=4),
        "dp2xtp2": dict(dp=2, tp=2),
        "dp4xep2-qwen3-moe": dict(dp=4, ep=2, **MOE),  # 2 whole experts a rank: no gather
        "dp2xtp2xep2-qwen3-moe": dict(dp=2, tp=2, ep=2, **MOE),  # experts cut by tp: gathered whole
    },
    16: {"pp2xdp2xcp2xtp2": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, **PP)},
}
BF16_ROWS = {
    world: {f"{name}-bf16": {**rows[name], **BF16} for name in names}
    for world, rows, names in (
        (2, ROWS[2], ("dp2", "tp2+sp", "cp2", "pp2-1f1b", "ep2-qwen3-moe")),
        (4, ROWS[4], ("dp2xtp2",)),
        (16, ROWS[16], ("pp2xdp2xcp2xtp2",)),
    )
}
# Checkpoints moving between layouts: (saved by the row, resumed on) -> (world size, the resuming layout).
# Each saves after step 2 of its row and takes step 3 on the other layout.
RESUMES = {("dp4", "dp2xtp2"): (4, dict(dp=2, tp=2)), ("pp2-1f1b", "one-process"): (1, {})}
REROUNDED = ("", "2", "4")  # the one-process bf16 runs E is measured on: 1, 2 and 4 microbatches
PLANTED = "dp2xtp2"  # the bug planted on a layout whose matrices are sharded over both dp and tp


def assert_like_one_process(case: str, run, reference) -> None:
    losses, norms, params = run[:3]
    ref_losses, ref_norms, ref_params = reference[:3]
    assert run[4] == ["float32"] * len(losses), f"{case}: the records say the matmuls ran in {run[4]}"
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: loss {a} vs one-process {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: grad norm {a} vs one-process {b}"
    assert_parameters_like(case, params, ref_params)


def assert_parameters_like(case: str, params, ref_params) -> None:
    """Every parameter within the contract's 1e-5 relative, per tensor: ||p - p_ref|| <= 1e-5 ||p_ref||; the message
    names every one that is not. Per tensor, as the bf16 check below, not element by element: Newton-Schulz raises
    every singular direction of an update to ~1, so a small matrix's elements carry its gradient's reassociation
    amplified. Measured on torch 2.11 (an AMX CPU): Qwen3-MoE's 8 x 64 router after 3 steps, one-process runs on 2
    and 4 microbatches alone 3.5e-7 and 7.2e-7 apart element-wise, dp2 x tp2 x ep2 1.67e-6 (3.7e-6 relative per
    tensor), its step-1 gate gradient 4.5e-7 relative from one process, as dp2 x tp2's without experts."""
    assert sorted(params) == sorted(ref_params)
    relative = {n: float((p - ref_params[n]).norm() / ref_params[n].norm().clamp_min(1e-30)) for n, p in params.items()}
    apart = {n: f"{r:.1e}" for n, r in relative.items() if r > 1e-5}
    assert not apart, f"{case}: parameters apart from one process after 3 steps (relative difference): {apart}"


def assert_like_one_process_in_bf16(case: str, run, bf16s: list, fp32) -> None:
    """The bf16 contract's check (module docstring) against one-process bf16 Muon (bf16s[0]); E the largest
    distance to one-process fp32 Muon over the one-process bf16 runs `bf16s`."""
    losses, norms, params, _, dtypes, flops = run
    bf16 = bf16s[0]
    assert dtypes == ["bfloat16"] * 3, f"{case}: the records say the matmuls ran in {dtypes}"
    assert flops["bfloat16"] > 0.9 * sum(flops.values()), f"{case}: matmul FLOPs by dtype {flops}"
    for what, i in (("loss", 0), ("grad norm", 1)):
        tol = 2 * max(abs(a - b) for one in bf16s for a, b in zip(one[i], fp32[i]))
        for step, (a, b) in enumerate(zip(run[i], bf16[i]), 1):
            assert abs(a - b) <= tol, f"{case} step {step}: {what} {a} vs one-process bf16 {b} (tolerance {tol:.2e})"
    assert sorted(params) == sorted(bf16[2])
    spec = get_spec("qwen3_moe" if "moe" in case else "llama")
    rest = sorted(n for n, p in params.items() if not spec.is_matrix(n, p.ndim))
    apart = {}
    for names in [[n] for n in params if n not in rest] + [rest]:  # each matrix; AdamW's parameters together

        def distance(a: dict, b: dict) -> float:
            return math.sqrt(sum(float((a[n] - b[n]).norm()) ** 2 for n in names))  # noqa: B023 (used at once)

        err, tol = distance(params, bf16[2]), 2 * max(distance(one[2], fp32[2]) for one in bf16s)
        if err > tol:
            apart[names[0] if len(names) == 1 else "AdamW's parameters"] = f"{err:.3e} > {tol:.3e}"
    assert not apart, f"{case}: ||p - p_bf16|| > 2 E_p after 3 steps: {apart}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every row's run, and the one-process references (debug and Qwen3-MoE debug, fp32 and bf16), by name.
    The rows of RESUMES save their step-2 checkpoints, resumed in later spawns (or later in the same one)."""
    root = tmp_path_factory.mktemp("muon-checkpoints")
    singles = {"one-process": {}, "one-process-moe": MOE}
    for kind, kw in (("one-process", {}), ("one-process-moe", MOE)):
        singles |= {f"{kind}-bf16{mb}": kw | BF16 | dict(microbatches=int(mb or 1)) for mb in REROUNDED}
    out = {}
    for world in (2, 1, 4, 16):  # pp2's checkpoint first: one process resumes it
        rows = singles if world == 1 else {**ROWS[world], **BF16_ROWS.get(world, {})}
        saves = {src for src, _ in RESUMES}
        cases = [
            (kw | dict(checkpoint_dir=str(root / name)), False, 2) if name in saves else (kw, False)
            for name, kw in rows.items()
        ]
        resumed = [(src, dst) for (src, dst), (at, _) in RESUMES.items() if at == world]
        for src, dst in resumed:  # after the rows: dp4 saves in this very spawn
            cases.append((RESUMES[src, dst][1] | dict(resume=str(root / src / "step_00000002")), False))
        cases += [(ROWS[4][PLANTED], True), (ROWS[4][PLANTED] | BF16, True)] if world == 4 else []
        results = run_ranks(each_in_turn, world, [(muon_run, case) for case in cases], timeout=300)[0]
        out.update(zip([*rows, *(f"{src}->{dst}" for src, dst in resumed)], results))
        if world == 4:
            out["planted"], out["planted-bf16"] = results[-2:]
    return out


@pytest.mark.parametrize("case", [name for rows in ROWS.values() for name in rows])
def test_muon_layout_trains_like_one_process(runs, case):
    reference = runs["one-process-moe" if "moe" in case else "one-process"]
    assert_like_one_process(case, runs[case], reference)


@pytest.mark.parametrize("case", [f"{src}->{dst}" for src, dst in RESUMES])
def test_a_muon_checkpoint_resumes_on_another_layout_like_one_process(runs, case):
    """Saved after step 2 on one layout, step 3 taken on another: its loss, grad norm and every parameter
    after it within the fp32 contract of the uninterrupted one-process run (momentum resharded)."""
    steps = len(runs[case][0])
    assert steps == 1, f"{case}: resumed at step {4 - steps}, not 3"
    ref = runs["one-process"]
    assert_like_one_process(case, runs[case], (ref[0][2:], ref[1][2:], *ref[2:]))


def test_bf16_muon_differs_from_fp32_on_one_process(runs):
    """The bf16 tolerance is not vacuous: one process's bf16 Muon lands elsewhere than its fp32 Muon."""
    for kind in ("one-process", "one-process-moe"):
        bf16, fp32 = runs[kind + "-bf16"], runs[kind]
        assert bf16[4] == ["bfloat16"] * 3
        assert all(a != b for a, b in zip(bf16[0], fp32[0])), kind
        assert all(not torch.equal(p, fp32[2][n]) for n, p in bf16[2].items()), kind


@pytest.mark.parametrize("case", [name for rows in BF16_ROWS.values() for name in rows])
def test_muon_layout_trains_like_one_process_in_bf16(runs, case):
    assert_like_one_process_in_bf16(case, runs[case], *references_bf16(runs, "moe" in case))


def references_bf16(runs, moe: bool) -> tuple[list, tuple]:
    """([one-process bf16 Muon on 1, 2, 4 microbatches], one-process fp32 Muon)."""
    kind = "one-process-moe" if moe else "one-process"
    return [runs[f"{kind}-bf16{mb}"] for mb in REROUNDED], runs[kind]


def test_the_orthogonalization_is_spread_over_the_ranks(runs):
    """No rank orthogonalizes every matrix: the FLOPs' max / mean over the ranks of dp2 x tp2."""
    flops = runs["dp2xtp2"][3]
    assert min(flops) > 0
    assert max(flops) / (sum(flops) / len(flops)) <= 1.25, flops


def test_a_shard_orthogonalized_alone_is_caught_by_name(runs):
    with pytest.raises(AssertionError, match=r"dp2xtp2: .*'layers\.0\.attention\.wo\.weight'"):
        assert_parameters_like(PLANTED, runs["planted"][2], runs["one-process"][2])


def test_a_shard_orthogonalized_alone_is_caught_by_name_in_bf16(runs):
    """The bf16 tolerance still sees the planted bug: it moves matrices by O(1), not by bf16 rounding."""
    with pytest.raises(AssertionError, match=r"dp2xtp2-bf16: .*'layers\.0\.attention\.wo\.weight'"):
        bf16s, fp32 = references_bf16(runs, moe=False)
        run = runs["planted-bf16"]
        assert_like_one_process_in_bf16(PLANTED + "-bf16", (bf16s[0][0], bf16s[0][1], *run[2:]), bf16s, fp32)
