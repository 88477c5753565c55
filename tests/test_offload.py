"""--offload's numerics contract: an offloaded run equals the same layout without offload, on every layout FSDP2 is
on (CPU ranks over gloo, where the mechanism still runs: the host copies are separate tensors, the host step the
same fused AdamW kernel).

Each row trains 3 steps of a layout with --offload optimizer and params and is compared with that layout's run
without: per-step losses and grad norms, step 1's gradients by name, every parameter after the 3 steps, all within
1e-6 relative (the issue's fp32 figure; the bf16 row is held to it too, stricter than the bf16 contract's derived
tolerance: the offloaded update runs the same kernel on the same values). A checkpoint saved offloaded resumes
without offload and the other way round, equal to the uninterrupted run's step 3. Each rank's record of what it
holds on the host is measured from its tensors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from offload_ranks import offload_resume, offload_run
from shared_spawns import SharedSpawns, selected_keys

MOE = dict(model="qwen3-moe-debug")
LAYOUTS = {
    "one-process": dict(),
    "dp2": dict(dp=2),
    "dp2-shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "dp2-bf16": dict(dp=2, mixed_precision="bf16"),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "cp2": dict(cp=2),
    "pp2-1f1b": dict(pp=2, microbatches=2),
    "ep2-qwen3-moe": dict(dp=2, ep=2, **MOE),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "dp2xtp2": dict(dp=2, tp=2),
}
MODES = ("none", "optimizer", "params")
# (saved with, resumed with): a checkpoint crosses between offloaded and not, both ways
RESUMES = {"optimizer->none": ("optimizer", "none"), "none->params": ("none", "params")}


def world_of(kw: dict) -> int:
    from helpers import small_config

    return small_config(**kw).layout.world_size


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    rows = {}
    selected = selected_keys(session, sys.modules[__name__])
    for case, kw in LAYOUTS.items():
        for mode in MODES:
            rows[("test_offloaded_layout_trains_like_the_same_layout_without", (case, mode))] = (
                offload_run,
                world_of(kw),
                (kw | dict(offload=mode),),
            )
    # the rows without offload are the references of the offloaded ones: run whenever one of those is
    picked = {
        value[0] for name, value in selected if name == "test_offloaded_layout_trains_like_the_same_layout_without"
    }
    selected |= {("test_offloaded_layout_trains_like_the_same_layout_without", (c, "none")) for c in picked}
    return SharedSpawns(rows, selected)


def assert_close(what: str, a: float, b: float) -> None:
    assert abs(a - b) <= 1e-6 * abs(b), f"{what}: {a} vs without offload {b}"


def assert_tensors_close(what: str, got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), what
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-9, msg=lambda m: f"{what} {name}: {m}")  # noqa: B023


@pytest.mark.parametrize("case", [(c, m) for c in LAYOUTS for m in MODES[1:]], ids=lambda c: f"{c[0]}-{c[1]}")
def test_offloaded_layout_trains_like_the_same_layout_without(runs, case):
    layout, mode = case
    key = "test_offloaded_layout_trains_like_the_same_layout_without"
    run, reference = runs.result((key, case)), runs.result((key, (layout, "none")))
    for i, what in ((0, "loss"), (1, "grad norm")):
        assert len(run[i]) == 3
        for step, (a, b) in enumerate(zip(run[i], reference[i]), 1):
            assert_close(f"{layout} --offload {mode} step {step}: {what}", a, b)
    assert_tensors_close(f"{layout} --offload {mode}: step 1's gradient of", run[2], reference[2])
    assert_tensors_close(f"{layout} --offload {mode}: after 3 steps, parameter", run[3], reference[3])
    reports = run[4]
    assert all(r is not None and r["mode"] == mode for r in reports), reports
    assert all(r["states_on_host"] == {"parameters": True, "optimizer_state": True} for r in reports), reports
    params = sum(p.numel() for p in run[3].values())
    for r in reports:  # what ran, read from the tensors and FSDP2's units
        if mode == "optimizer":  # each rank's masters, gradient buffers and both moments: 16 B a local element
            assert r["host_copies_bytes"] >= 16 * params / world_of(LAYOUTS[layout]) * 0.9, r
            assert r["fsdp_offloaded_parameters"] == 0, r
        else:
            assert r["host_copies_bytes"] is None and r["fsdp_offloaded_parameters"] > 0, r


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    from tessera.launching.launch import run_ranks
    from shared_spawns import each_in_turn

    root = tmp_path_factory.mktemp("offload-checkpoints")
    cases = [
        (offload_resume, (dict(dp=2), saved, loaded, str(root / name))) for name, (saved, loaded) in RESUMES.items()
    ]
    cases.append((offload_run, (dict(dp=2),)))
    results = run_ranks(each_in_turn, 2, cases, timeout=300)[0]
    return dict(zip([*RESUMES, "uninterrupted"], results))


@pytest.mark.parametrize("case", list(RESUMES))
def test_a_checkpoint_moves_between_offloaded_and_not(resumed, case):
    """Saved after step 2 with one --offload, step 3 taken with the other: equal to the uninterrupted run's."""
    losses, norms, params = resumed[case]
    ref = resumed["uninterrupted"]
    assert_close(f"{case} step 3: loss", losses[0], ref[0][2])
    assert_close(f"{case} step 3: grad norm", norms[0], ref[1][2])
    assert_tensors_close(f"{case}: after step 3, parameter", params, ref[3])
