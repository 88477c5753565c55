"""The numerics contract for mixture of experts: Qwen3-MoE on every axis and with expert parallelism (ep
borrows dp_shard x cp), against its own one-process run at the fp32 tolerances of tests/test_contract.py:
losses and grad norms within 1e-5, every gradient by name within 1e-4.

The rows run with a large auxiliary loss (0.1) and the auxiliary-loss-free bias on (0.01 a step), so a
wrongly scaled auxiliary gradient or a bias that differs between ranks changes the norms and, through the
routing, the later losses. Routing is deterministic (top-k of the same scores), so every layout routes every
token to the same experts as one process.
"""

import sys

import pytest

from helpers import small_config, train_with_dtypes, train_with_records
from shared_spawns import SharedSpawns, selected_keys
from test_contract import assert_trains_like_one_process
from test_contract_bf16 import assert_trains_like_one_process_in_bf16

BASE = dict(model="qwen3-moe-debug", global_batch=8, moe_aux_loss=0.1, moe_bias_rate=0.01)

LAYOUTS = {
    # MoE without expert parallel: the experts are ordinary parameters of their block's FSDP2 unit
    "dp2": dict(dp=2),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    # expert parallel
    "ep2": dict(dp=2, ep=2),
    "ep4": dict(dp=4, ep=4),
    "dp2xep2": dict(dp=4, ep=2),  # the experts FSDP-sharded over the 2 ranks ep leaves
    "ep2xtp2+sp": dict(dp=2, tp=2, ep=2, sequence_parallel=True),
    "pp2xep2": dict(pp=2, dp=2, ep=2, microbatches=2),
    "cp2xep2": dict(cp=2, ep=2),  # ep borrows the cp ranks: the aux loss's counts summed over cp
    "hsdp2x2xep2": dict(dp=4, dp_replicate=2, ep=2),
    "ep2+ac_full": dict(dp=2, ep=2, ac="full"),  # recomputation neither recounts tokens nor re-adds the aux loss
    "ep2+compile": dict(dp=2, ep=2, compile=True),  # the experts' dispatch stays eager inside the compiled block
    "pp2xdp2xcp2xtp2+sp+ep4": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, ep=4, microbatches=2),
}


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """This file's runs, one spawn per world size (tests/shared_spawns.py): the one-process references
    (softmax routing; sigmoid with a shared expert; bf16 and fp32 with their dtypes) and every selected layout."""
    rows = {
        ("reference", "softmax"): (train_with_records, 1, (small_config(**BASE),)),
        ("reference", "shared"): (train_with_records, 1, (small_config(**SHARED),)),
        ("reference", "bf16"): (train_with_dtypes, 1, (small_config(**BASE, mixed_precision="bf16"),)),
        # the same run re-rounded (2 and 4 microbatches): E of the bf16 rows is measured over all three
        **{
            ("reference", f"bf16-mb{mb}"): (
                train_with_dtypes,
                1,
                (small_config(**BASE, mixed_precision="bf16", microbatches=mb),),
            )
            for mb in (2, 4)
        },
        ("reference", "fp32"): (train_with_dtypes, 1, (small_config(**BASE, mixed_precision="fp32"),)),
    }
    for test, table, fn, base in (
        ("test_moe_layout_trains_like_its_one_process_run", LAYOUTS, train_with_records, BASE),
        (
            "test_sigmoid_routing_with_a_shared_expert_trains_like_one_process",
            SHARED_LAYOUTS,
            train_with_records,
            SHARED,
        ),
        (
            "test_moe_layout_trains_like_one_process_in_bf16",
            BF16_LAYOUTS,
            train_with_dtypes,
            dict(BASE, mixed_precision="bf16"),
        ),
    ):
        for case, layout in table.items():
            config = small_config(**base, **layout)
            rows[(test, case)] = (fn, config.layout.world_size, (config,))
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]) | {k for k in rows if k[0] == "reference"})


@pytest.fixture(scope="module")
def moe_reference(runs):
    return runs.result(("reference", "softmax"))


def test_the_moe_reference_learns_and_reports_its_load(moe_reference):
    losses, norms, grads, records = moe_reference
    assert losses[-1] < losses[0] and all(n > 0 for n in norms)
    assert any(name.endswith("mlp.experts.gate_proj") for name in grads)
    config = small_config(**BASE).model_config
    for r in records:
        moe = r["moe"]
        assert len(moe["tokens_per_expert"]) == config.n_layers
        for counts in moe["tokens_per_expert"]:  # dropless: every token reached its k experts
            assert len(counts) == config.n_experts and sum(counts) == 8 * 32 * config.top_k
        assert moe["max_imbalance"] >= 1.0 and moe["aux_loss"] > 0


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_moe_layout_trains_like_its_one_process_run(moe_reference, runs, case):
    losses, norms, grads, records = runs.result(("test_moe_layout_trains_like_its_one_process_run", case))
    assert_trains_like_one_process(f"moe {case}", (losses, norms, grads), moe_reference[:3])
    for mine, ref in zip(records, moe_reference[3]):  # the same routing, the same auxiliary loss
        assert mine["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"], case
        assert abs(mine["moe"]["aux_loss"] - ref["moe"]["aux_loss"]) <= 1e-5 * ref["moe"]["aux_loss"], case


# the block's other recipe: sigmoid scores, a shared expert (tensor parallel like a dense MLP), the bias on
SHARED = dict(BASE, model="qwen3-moe-shared-debug")
SHARED_LAYOUTS = {
    "ep2xtp2+sp": dict(dp=2, tp=2, ep=2, sequence_parallel=True),
    "pp2xep2": dict(pp=2, dp=2, ep=2, microbatches=2),
    "cp2xep2": dict(cp=2, ep=2),
}


@pytest.fixture(scope="module")
def shared_reference(runs):
    return runs.result(("reference", "shared"))


@pytest.mark.parametrize("case", list(SHARED_LAYOUTS))
def test_sigmoid_routing_with_a_shared_expert_trains_like_one_process(shared_reference, runs, case):
    losses, norms, grads, _ = runs.result(("test_sigmoid_routing_with_a_shared_expert_trains_like_one_process", case))
    assert any(".shared_expert." in name for name in grads)
    assert_trains_like_one_process(f"moe shared {case}", (losses, norms, grads), shared_reference[:3])


# bf16 (tests/test_contract_bf16.py's derived tolerance): the experts' matmuls ran in bf16 too. Only layouts
# that compute each token's router input in the same order as one process: top-k is discontinuous, and under
# tp the hidden states are rounded to bf16 at other points (partial sums over tp), which moves near-tied
# tokens to another expert; measured on tp2 + SP (with or without ep): 3 of the 16 expert counts differ from
# one process at step 1, 10 at step 2, so the gradients differ by whole tokens' contributions there. In fp32
# (above) every layout, tp included, routes every token alike.
BF16_LAYOUTS = {
    "ep2": dict(dp=2, ep=2),
    "dp2xep2": dict(dp=4, ep=2),
    "pp2xep2": dict(pp=2, dp=2, ep=2, microbatches=2),
}


@pytest.fixture(scope="module")
def moe_one_process_bf16_and_fp32(runs):
    return runs.result(("reference", "bf16")), runs.result(("reference", "fp32"))


@pytest.fixture(scope="module")
def moe_rerounded_bf16(runs):
    return tuple(runs.result(("reference", f"bf16-mb{mb}")) for mb in (2, 4))


@pytest.mark.parametrize("case", list(BF16_LAYOUTS))
def test_moe_layout_trains_like_one_process_in_bf16(moe_one_process_bf16_and_fp32, moe_rerounded_bf16, runs, case):
    run = runs.result(("test_moe_layout_trains_like_one_process_in_bf16", case))
    # the fp32 remainder is the CPU attention kernel's, as for the dense models, but beside this model's small
    # experts (top 2 of width 32) it is about 14% of the matmul FLOPs rather than under 10%
    assert_trains_like_one_process_in_bf16(
        f"moe {case}", run, moe_one_process_bf16_and_fp32, bf16_share=0.8, rerounded=moe_rerounded_bf16
    )
