"""FSDP2 on the data axes: the numerics contract for each layout and strategy, and measured memory."""

import pytest
import torch

from helpers import measured_model_states, small_config, train_losses_and_grads
from parallel.launch import run_ranks
from topology.memory import model_state_bytes


@pytest.fixture(scope="module")
def reference():
    return run_ranks(train_losses_and_grads, 1, small_config(), timeout=120)[0]


CASES = {
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_trains_like_one_process(reference, case):
    ref_losses, ref_grads = reference
    config = small_config(**CASES[case])
    losses, grads = run_ranks(train_losses_and_grads, config.layout.world_size, config, timeout=180)[0]
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case} step {step}: loss {a} vs one-process {b}"
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("strategy, dp", [("FULL_SHARD", 4), ("SHARD_GRAD_OP", 4), ("NO_SHARD", 2)])
def test_measured_memory_matches_the_model(strategy, dp):
    config = small_config(dp=dp, fsdp=strategy, model="small")
    ranks = run_ranks(measured_model_states, dp, config, timeout=180)
    predicted = model_state_bytes(ranks[0]["num_params"], dp=dp, strategy=strategy, recipe="fp32_adam")
    for rank, measured in enumerate(ranks):
        for component in ("parameters", "gradients", "optimizer"):
            ratio = measured[component] / predicted[component]
            assert abs(ratio - 1) < 0.02, f"rank {rank} {strategy} {component}: {measured[component]} vs {predicted[component]}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "4", "--fsdp", "HYBRID_SHARD"], "HYBRID_SHARD needs replica groups: dp=4 with dp_replicate=1"),
        (["--dp", "2", "--fsdp", "ZERO9"], "unknown FSDP strategy 'ZERO9'"),
        (["--dp", "4", "--dp-replicate", "3"], "--dp-replicate 3 must divide --dp 4"),
        (["--dp", "3", "--global-batch", "8"], "global batch 8 does not split over dp=3"),
        (["--dp", "2", "--ac", "most"], "unknown activation checkpointing 'most'"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    ],
)
def test_bad_data_parallel_input_fails_before_any_rank_starts(args, message):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "parallel.cli", "train", "--steps", "1", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2, tp=2), dict(dp=4, dp_replicate=2), dict(dp=2, ac="full")],
                         ids=["tp2", "dp2xtp2", "hsdp2x2", "dp2+ac"])
def test_meta_built_model_initializes_to_the_one_process_weights(layout):
    from helpers import first_loss, meta_built_first_loss

    reference = run_ranks(first_loss, 1, small_config(), timeout=120)[0]
    config = small_config(**layout)
    loss = run_ranks(meta_built_first_loss, config.layout.world_size, config, timeout=120)[0]
    assert abs(loss - reference) <= 1e-6 * reference
