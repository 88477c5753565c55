"""The numerics contract for the second family: Qwen3 (QK-norm, head_dim apart from dim / heads, a tied
embedding and head) on every axis, against its own one-process run, as tests/test_contract.py does for
Llama. Nothing in parallel/ knows Qwen3: every axis reads its spec (models/qwen3.py).

The tied weight is the sharpest row: under pp the first stage's embedding and the last stage's head are
one tensor held by two ranks, whose gradients are summed (parallel/tied.py) and counted once in the norm.
"""

import sys

import pytest

from helpers import small_config, train_losses_and_grads, train_with_dtypes
from shared_spawns import SharedSpawns, selected_keys
from test_contract import assert_trains_like_one_process
from test_contract_bf16 import assert_trains_like_one_process_in_bf16, rerounded, rerounded_rows

BASE = dict(model="qwen3-debug", n_layers=4, global_batch=8)

LAYOUTS = {
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "tp4": dict(tp=4),  # beyond the 2 kv heads: replicated K/V and k_norm
    "dp2": dict(dp=2),
    "shard_grad_op": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "no_shard": dict(dp=2, fsdp="NO_SHARD"),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "dp2xtp2+sp+ac_op": dict(dp=2, tp=2, sequence_parallel=True, ac="op"),
    "cp2-ring": dict(cp=2),
    "cp2xtp2-allgather": dict(cp=2, tp=2, cp_method="allgather"),
    "cp2xdp2-ring": dict(cp=2, dp=2),
    "cp4-ring": dict(cp=4),
    "ac_full+prefetch": dict(dp=2, ac="full", prefetch=1),
    "tp2+sp+compile": dict(tp=2, sequence_parallel=True, compile=True),
    "tp2+sp+loss_logits": dict(tp=2, sequence_parallel=True, loss="logits"),
    "microbatches4": dict(microbatches=4),
    # the tied embedding and head on the first and last stage
    "pp2-1f1b": dict(pp=2, microbatches=2),
    "pp2-zb-h1": dict(pp=2, schedule="zb-h1", microbatches=2),
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=2),
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2),
    "pp4-1f1b": dict(pp=4, microbatches=4),
    "pp4-zb-h1": dict(pp=4, schedule="zb-h1", microbatches=4),
    "pp2xhsdp2x2": dict(pp=2, dp=4, dp_replicate=2, microbatches=2),
    "pp2xtp2+sp": dict(pp=2, tp=2, sequence_parallel=True, microbatches=2),
    "pp2xdp2": dict(pp=2, dp=2, microbatches=2),
    "pp2-interleaved-v2xdp2": dict(pp=2, dp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2),
    # the V placement: the first and last stage (embedding and tied head) on one rank, their gradients summed there
    "pp2-zbv": dict(pp=2, schedule="zbv", virtual=2, microbatches=2),
    "pp2-zbvxdp2": dict(pp=2, dp=2, schedule="zbv", virtual=2, microbatches=2),
    "pp2xdp2xcp2xtp2+sp": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, microbatches=2),
}


MASKED_LAYOUTS = {"dp2": dict(dp=2), "dp2xtp2": dict(dp=2, tp=2), "pp2": dict(pp=2, microbatches=2)}


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """This file's runs, one spawn per world size (tests/shared_spawns.py): the one-process references
    (fp32, masked fp32, bf16 and fp32 with their dtypes) and every selected layout."""
    one = small_config(**BASE)
    rows = {
        ("reference", "fp32"): (train_losses_and_grads, 1, (one,)),
        ("reference", "masked"): (train_losses_and_grads, 1, (one, True)),
        ("reference", "bf16+dtypes"): (train_with_dtypes, 1, (small_config(**BASE, mixed_precision="bf16"),)),
        ("reference", "fp32+dtypes"): (train_with_dtypes, 1, (small_config(**BASE, mixed_precision="fp32"),)),
        # the bf16 reference re-rounded (tests/test_contract_bf16.py): E of the bf16 rows is measured over them too
        **{("reference", kind): row for kind, row in rerounded_rows(BASE, (2, 4)).items()},
    }
    for test, table, fn, precision, extra in (
        (
            "test_qwen3_unevenly_masked_targets_train_like_one_process",
            MASKED_LAYOUTS,
            train_losses_and_grads,
            {},
            (True,),
        ),
        ("test_qwen3_layout_trains_like_its_one_process_run", LAYOUTS, train_losses_and_grads, {}, ()),
        (
            "test_qwen3_layout_trains_like_its_one_process_run_in_bf16",
            BF16_LAYOUTS,
            train_with_dtypes,
            dict(mixed_precision="bf16"),
            (),
        ),
    ):
        for case, layout in table.items():
            config = small_config(**BASE, **layout, **precision)
            rows[(test, case)] = (fn, config.layout.world_size, (config, *extra))
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]) | {k for k in rows if k[0] == "reference"})


@pytest.fixture(scope="module")
def qwen3_masked_reference(runs):
    return runs.result(("reference", "masked"))


@pytest.mark.parametrize("case", list(MASKED_LAYOUTS))
def test_qwen3_unevenly_masked_targets_train_like_one_process(qwen3_masked_reference, runs, case):
    run = runs.result(("test_qwen3_unevenly_masked_targets_train_like_one_process", case))
    assert_trains_like_one_process(f"qwen3 masked {case}", run, qwen3_masked_reference)


@pytest.fixture(scope="module")
def qwen3_reference(runs):
    return runs.result(("reference", "fp32"))


def test_the_qwen3_reference_learns_and_ties_its_head(qwen3_reference):
    losses, norms, grads = qwen3_reference
    assert losses[-1] < losses[0] and all(n > 0 for n in norms)
    assert "embed_tokens.weight" in grads and "lm_head.weight" not in grads  # one tensor, one name
    assert any(name.endswith("self_attn.q_norm.weight") for name in grads)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_qwen3_layout_trains_like_its_one_process_run(qwen3_reference, runs, case):
    run = runs.result(("test_qwen3_layout_trains_like_its_one_process_run", case))
    assert_trains_like_one_process(f"qwen3 {case}", run, qwen3_reference)


# bf16 (tests/test_contract_bf16.py's tolerance: twice the one-process |bf16 - fp32|), one row per axis kind
BF16_LAYOUTS = {
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "tp4": dict(tp=4),
    "dp2": dict(dp=2),
    "hsdp2x2": dict(dp=4, dp_replicate=2),
    "cp2-ring": dict(cp=2),
    "cp2xtp2+sp-allgather": dict(cp=2, tp=2, sequence_parallel=True, cp_method="allgather"),
    "pp2-1f1b": dict(pp=2, microbatches=2),
    "pp2-zb-h1": dict(pp=2, schedule="zb-h1", microbatches=2),
    "pp2xtp2+sp": dict(pp=2, tp=2, sequence_parallel=True, microbatches=2),
    "pp2xdp2xcp2xtp2+sp": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, microbatches=2),
}


@pytest.fixture(scope="module")
def qwen3_one_process_bf16_and_fp32(runs):
    return runs.result(("reference", "bf16+dtypes")), runs.result(("reference", "fp32+dtypes"))


@pytest.mark.parametrize("case", list(BF16_LAYOUTS))
def test_qwen3_layout_trains_like_its_one_process_run_in_bf16(qwen3_one_process_bf16_and_fp32, runs, case):
    run = runs.result(("test_qwen3_layout_trains_like_its_one_process_run_in_bf16", case))
    # on CPU attention multiplies in fp32; qwen3-debug's attention is twice as wide as its dim (4 heads x 32),
    # so it carries 11% of the matmul FLOPs (Llama's debug: under 10%)
    more = rerounded(runs, "reference", BF16_LAYOUTS[case])
    assert_trains_like_one_process_in_bf16(
        f"qwen3 {case}", run, qwen3_one_process_bf16_and_fp32, bf16_share=0.85, rerounded=more
    )
