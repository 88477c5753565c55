"""The numerics contract for the families whose attention is not grouped-query attention's: DeepSeek-V3
(multi-head latent attention, a value head dim apart from the query/key one, dense first layers, then
group-limited sigmoid routing with shared experts) and gpt-oss (attention sinks, layers alternating between a
sliding window and full causal attention, experts with biases and the clamped SwiGLU). Each on tp2 + SP,
dp2, cp2 (ring and all-gather), pp2, ep2, ep4 and pp2 x dp2 x cp2 x tp2 with ep, against its own one-process
run at the fp32 tolerances of tests/test_contract.py (losses and grad norms within 1e-5, every gradient by
name within 1e-4), and the same layouts in bf16 at tests/test_contract_bf16.py's derived tolerance.

Nothing in parallel/ knows either family: every axis reads its spec. The sequence is 64 tokens so that
gpt-oss-debug's window falls inside one cp rank's zigzag chunk on some layers' rows and across chunks on
others (the ring skips the steps wholly outside it).
"""

import sys

import pytest

from helpers import small_config, train_with_dtypes, train_with_records
from shared_spawns import SharedSpawns, selected_keys
from test_contract import assert_trains_like_one_process
from test_contract_bf16 import assert_trains_like_one_process_in_bf16, rerounded_kinds, rerounded_rows

from tessera.training.run import train

FAMILIES = {
    "deepseek_v3": dict(model="deepseek-v3-debug", seq_len=64, global_batch=8, moe_aux_loss=0.1, moe_bias_rate=0.01),
    "gpt_oss": dict(model="gpt-oss-debug", seq_len=64, global_batch=8, moe_aux_loss=0.1),
}

LAYOUTS = {
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "dp2": dict(dp=2),
    "cp2-ring": dict(cp=2),
    "cp2-allgather": dict(cp=2, cp_method="allgather"),
    "pp2": dict(pp=2, microbatches=2),
    "ep2": dict(dp=2, ep=2),
    "ep4": dict(dp=4, ep=4),
    "pp2xdp2xcp2xtp2+sp+ep4": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, ep=4, microbatches=2),
}

# bf16 on every layout (tests/test_contract_bf16.py's derived tolerance). Top-k routing is discontinuous, so a
# layout that rounds the router's input at other points could move a near-tied token to another expert (as
# Qwen3-MoE's tp2 + SP does, tests/test_contract_moe.py); these two families' debug models route alike on all
# of them, tp2 + SP and the 4D row included
BF16_LAYOUTS = LAYOUTS

FP32_TEST = "test_the_family_trains_like_its_one_process_run"
BF16_TEST = "test_the_family_trains_like_one_process_in_bf16"


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """This file's runs, one spawn per world size (tests/shared_spawns.py)."""
    rows = {}
    for family, base in FAMILIES.items():
        rows[("reference", family)] = (train_with_records, 1, (small_config(**base),))
        rows[("reference-bf16", family)] = (train_with_dtypes, 1, (small_config(**base, mixed_precision="bf16"),))
        rows[("reference-fp32", family)] = (train_with_dtypes, 1, (small_config(**base, mixed_precision="fp32"),))
        # the bf16 reference re-rounded on 2 and 4 microbatches (tests/test_contract_bf16.py); not rounded as on tp
        # ranks: helpers.round_like_tp rounds bias-free linear layers, and these families' experts are grouped GEMMs
        # and gpt-oss's projections carry biases
        rows |= {(f"reference-{kind}", family): row for kind, row in rerounded_rows(base).items()}
        for case, layout in LAYOUTS.items():
            config = small_config(**base, **layout)
            rows[(FP32_TEST, f"{family}-{case}")] = (train_with_records, config.layout.world_size, (config,))
        for case, layout in BF16_LAYOUTS.items():
            config = small_config(**base, **layout, mixed_precision="bf16")
            rows[(BF16_TEST, f"{family}-{case}")] = (train_with_dtypes, config.layout.world_size, (config,))
    selected = selected_keys(session, sys.modules[__name__])
    by_family = selected_keys(session, sys.modules[__name__], "family")
    families = {key[1].split("-")[0] for key in selected} | {family for _, family in by_family}
    references = {k for k in rows if k[0].startswith("reference") and k[1] in families}
    return SharedSpawns(rows, selected | references)


def _cases(table: dict) -> list[str]:
    return [f"{family}-{case}" for family in FAMILIES for case in table]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_families_reference_learns_and_routes_every_token(runs, family):
    losses, norms, grads, records = runs.result(("reference", family))
    assert losses[-1] < losses[0] and all(n > 0 for n in norms)
    config = small_config(**FAMILIES[family]).model_config
    dense = getattr(config, "first_k_dense_replace", 0)  # DeepSeek-V3's dense first layers route nothing
    for r in records:
        counts = r["moe"]["tokens_per_expert"]
        assert len(counts) == config.n_layers and all(sum(c) == 0 for c in counts[:dense])
        assert all(sum(c) == 8 * 64 * config.top_k for c in counts[dense:])  # dropless: every token, k experts


@pytest.mark.parametrize("case", _cases(LAYOUTS))
def test_the_family_trains_like_its_one_process_run(runs, case):
    family = case.split("-")[0]
    reference = runs.result(("reference", family))
    losses, norms, grads, records = runs.result((FP32_TEST, case))
    assert_trains_like_one_process(case, (losses, norms, grads), reference[:3])
    for mine, ref in zip(records, reference[3]):  # every layout routes every token alike in fp32
        assert mine["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"], case


@pytest.mark.parametrize("case", _cases(BF16_LAYOUTS))
def test_the_family_trains_like_one_process_in_bf16(runs, case):
    family = case.split("-")[0]
    one = runs.result(("reference-bf16", family)), runs.result(("reference-fp32", family))
    # the fp32 remainder is exactly the CPU attention kernel's FLOPs (gpt-oss-debug on ep2: 3 x 4 layers x 4 rows
    # x 4 heads x 2 x 2 x 64^2 x 16 = 50,331,648), which at seq 64 beside these small blocks is 21-25% of them
    more = tuple(runs.result((f"reference-{kind}", family)) for kind in rerounded_kinds({}, tp_rounded=False))
    assert_trains_like_one_process_in_bf16(case, runs.result((BF16_TEST, case)), one, bf16_share=0.7, rerounded=more)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_ep2_checkpoint_resumes_on_ep4_and_one_process(tmp_path, family):
    """Checkpoints reshard between expert-parallel degrees: saved on dp2 x ep2 after 2 of 4 steps, resumed on
    ep4 and on one process with the uninterrupted run's losses, grad norms and routing."""
    base = dict(FAMILIES[family], steps=4)
    history = train(small_config(**base, dp=2, ep=2, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    for layout in (dict(dp=4, ep=4), dict()):
        resumed = train(small_config(**base, resume=str(tmp_path / "step_00000002"), **layout))
        assert [m["step"] for m in resumed] == [3, 4], layout
        for m, ref in zip(resumed, history[2:]):
            assert abs(m["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (layout, m["loss"], ref["loss"])
            assert abs(m["grad_norm"] - ref["grad_norm"]) <= 1e-5 * abs(ref["grad_norm"]), layout
            assert m["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"], layout
