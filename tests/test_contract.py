"""The numerics contract: every layout trains like one process.

One table of layout cases that every axis adds to. Each case runs 3 AdamW steps on CPU ranks over gloo
and is compared with the session's one-process run: per-step losses and grad norms within 1e-5
relative (AdamW hides clipping errors from the losses, the grad norm does not), and every parameter's
gradient of step 1 within 1e-4, by one-process parameter name. Cases of one world size train one after
the other in one spawn (tests/shared_spawns.py), each with its own Trainer, each compared alone.
"""

import sys

import pytest
import torch

from helpers import small_config, train_losses_and_grads
from shared_spawns import SharedSpawns, selected_keys

LAYOUTS = {
    # tensor parallel (+ sequence parallel); tp4 > n_kv_heads=2 replicates kv heads
    "tp2": dict(tp=2),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "tp4": dict(tp=4),
    "tp4+sp": dict(tp=4, sequence_parallel=True),
    # FSDP2 on the data axes
    "dp_shard2": dict(dp=2),
    "dp_shard4": dict(dp=4),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "dp2xtp2": dict(dp=2, tp=2),
    "dp2xtp2+sp": dict(dp=2, tp=2, sequence_parallel=True),
    "shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "no_shard": dict(dp=2, fsdp="NO_SHARD"),
    "hybrid_shard": dict(dp=4, dp_replicate=2, fsdp="HYBRID_SHARD"),
    "ac_full": dict(dp=2, ac="full"),
    "ac_selective+prefetch": dict(dp=2, ac="selective", prefetch=1),
    "dp2xtp2+sp+ac_op": dict(dp=2, tp=2, sequence_parallel=True, ac="op"),
    "cp2xdp2+ac_op": dict(cp=2, dp=2, ac="op"),
    # today's loss on full logits against the chunked (fused) default of the reference
    "loss_logits": dict(loss="logits"),
    "tp2+sp+loss_logits": dict(tp=2, sequence_parallel=True, loss="logits"),
    # gradient accumulation: microbatches on one process and under FSDP (sync on the last only)
    "microbatches4": dict(microbatches=4),
    "dp2+microbatches2": dict(dp=2, microbatches=2),
    "dp2xtp2+microbatches2": dict(dp=2, tp=2, microbatches=2),
    # context parallel (zigzag), each with ring and all-gather attention; FSDP2 shards over dp_shard x cp
    **{
        f"{name}-{method}": dict(cp_method=method, **layout)
        for method in ("ring", "allgather")
        for name, layout in {
            "cp2": dict(cp=2),
            "cp4": dict(cp=4),
            "cp2xtp2": dict(cp=2, tp=2),
            "cp2xtp2+sp": dict(cp=2, tp=2, sequence_parallel=True),
            "cp2xdp2": dict(cp=2, dp=2),
            "cp2xhsdp2x2": dict(cp=2, dp=4, dp_replicate=2),
        }.items()
    },
    "pp2xcp2": dict(pp=2, cp=2, microbatches=2),
}

# targets masked unevenly over the rows (helpers.MaskedStream): dp rank 0 holds mostly -100
MASKED_LAYOUTS = {
    "dp2": dict(dp=2),
    "dp4": dict(dp=4),
    "dp2xtp2": dict(dp=2, tp=2),
    "microbatches2": dict(microbatches=2),
}


# pipeline parallel, compared with the 8-layer one-process run (conftest.deep_reference, 8 rows per step)
PIPELINE_LAYOUTS = {
    **{f"pp2-{kind}": dict(pp=2, schedule=kind, microbatches=4) for kind in ("gpipe", "1f1b", "zb-h1")},
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=4),
    "pp2-interleaved-v4": dict(pp=2, schedule="interleaved-1f1b", virtual=4, microbatches=2),
    **{f"pp4-{kind}": dict(pp=4, schedule=kind, microbatches=4) for kind in ("gpipe", "1f1b", "zb-h1")},
    "pp4-interleaved-v2": dict(pp=4, schedule="interleaved-1f1b", virtual=2, microbatches=4),
    "pp2-layers-5,3": dict(pp=2, pp_layers="5,3", microbatches=2),
    "pp2xtp2": dict(pp=2, tp=2, microbatches=2),
    "pp2xtp2+sp": dict(pp=2, tp=2, sequence_parallel=True, microbatches=4),
    "pp2xtp2-zb-h1+sp": dict(pp=2, tp=2, sequence_parallel=True, schedule="zb-h1", microbatches=2),
    "pp2xdp2": dict(pp=2, dp=2, microbatches=2),
    "pp2xdp2-interleaved": dict(pp=2, dp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2),
    # zero bubble under FSDP2: the weight gradients of the deferred W passes are reduced after the last W
    "pp2xdp2-zb-h1": dict(pp=2, dp=2, schedule="zb-h1", microbatches=2),
    "pp2xhsdp2x2": dict(pp=2, dp=4, dp_replicate=2, microbatches=2),
    # looped BFS and interleaved zero bubble (B/W split over virtual stages), alone and with tp (+SP) and FSDP2
    **{
        f"pp{pp}-{kind}-v2": dict(pp=pp, schedule=kind, virtual=2, microbatches=4)
        for pp in (2, 4)
        for kind in ("looped-bfs", "interleaved-zb", "zbv")
    },
    "pp2xtp2-zbv+sp": dict(pp=2, tp=2, sequence_parallel=True, schedule="zbv", virtual=2, microbatches=2),
    "pp2xdp2-zbv": dict(pp=2, dp=2, schedule="zbv", virtual=2, microbatches=2),
    "pp2xtp2-interleaved-zb+sp": dict(
        pp=2, tp=2, sequence_parallel=True, schedule="interleaved-zb", virtual=2, microbatches=2
    ),
    "pp2xdp2-interleaved-zb": dict(pp=2, dp=2, schedule="interleaved-zb", virtual=2, microbatches=2),
    "pp2xdp2-looped-bfs": dict(pp=2, dp=2, schedule="looped-bfs", virtual=2, microbatches=2),
    # DualPipeV (2 pp microbatches at least): full backwards (B and W as one pass) beside split ones, on the V
    "pp2-dualpipev": dict(pp=2, schedule="dualpipev", virtual=2, microbatches=4),
    "pp4-dualpipev": dict(pp=4, schedule="dualpipev", virtual=2, microbatches=8),
    "pp2xtp2-dualpipev+sp": dict(pp=2, tp=2, sequence_parallel=True, schedule="dualpipev", virtual=2, microbatches=4),
    "pp2xdp2-dualpipev": dict(pp=2, dp=2, schedule="dualpipev", virtual=2, microbatches=4),
    "pp2+ac_full": dict(pp=2, ac="full", microbatches=2),
    # torch.compile per block inside the stages (the split-backward kinds refuse it: tests/test_pipeline_defaults.py);
    # tp2 + SP + compile: the bf16 and Qwen3 rows
    "pp2-interleaved+compile": dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2, compile=True),
    # all four axes at once: 16 ranks (pp2 x dp2 x cp2 x tp2 + sp and pp2 x HSDP x tp2: tests/test_four_d.py)
    "pp2xdp2xcp2xtp2-interleaved-allgather": dict(
        pp=2, dp=2, cp=2, tp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2, cp_method="allgather"
    ),
}


def assert_trains_like_one_process(case: str, run, reference) -> None:
    losses, norms, grads = run
    ref_losses, ref_norms, ref_grads = reference
    assert len(losses) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: loss {a} vs one-process {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: grad norm {a} vs one-process {b}"
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        assert g.shape == ref_grads[name].shape, name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """Every selected case of this file, trained in one spawn per world size on first request."""
    from conftest import PIPELINE_BASE

    rows = {}
    for test, table, base, extra in (
        ("test_layout_trains_like_one_process", LAYOUTS, {}, ()),
        ("test_unevenly_masked_targets_train_like_one_process", MASKED_LAYOUTS, {}, (True,)),
        ("test_pipeline_layout_trains_like_one_process", PIPELINE_LAYOUTS, PIPELINE_BASE, ()),
    ):
        for case, layout in table.items():
            config = small_config(**base, **layout)
            rows[(test, case)] = (train_losses_and_grads, config.layout.world_size, (config, *extra))
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]))


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layout_trains_like_one_process(reference, runs, case):
    run = runs.result(("test_layout_trains_like_one_process", case))
    assert_trains_like_one_process(case, run, reference)


def test_the_reference_learns(reference):
    losses, norms, _ = reference
    assert losses[-1] < losses[0] and all(n > 0 for n in norms)


@pytest.mark.parametrize("case", list(MASKED_LAYOUTS))
def test_unevenly_masked_targets_train_like_one_process(masked_reference, reference, runs, case):
    run = runs.result(("test_unevenly_masked_targets_train_like_one_process", case))
    assert_trains_like_one_process(f"masked {case}", run, masked_reference)
    assert abs(masked_reference[0][0] - reference[0][0]) > 1e-3  # the mask really changed the objective


@pytest.mark.parametrize("case", list(PIPELINE_LAYOUTS))
def test_pipeline_layout_trains_like_one_process(deep_reference, runs, case):
    run = runs.result(("test_pipeline_layout_trains_like_one_process", case))
    assert_trains_like_one_process(case, run, deep_reference)
