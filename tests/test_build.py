"""Pieces of the parallel build: the meta-device build gives every rank its slice of the one-process
initialization; the vocab-parallel loss equals cross-entropy on gathered logits; measured per-rank
memory equals the ZeRO model."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import full_parameters, measured_model_states, small_config
from tessera.launching.launch import run_ranks
from tessera.parallel.loss import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_sum
from tessera.parallel.tensor import shard_range
from tessera.topology.memory import model_state_bytes


@pytest.fixture(scope="module")
def one_process_parameters():
    from tessera.models import build_model

    return {n: p.detach().clone() for n, p in build_model("debug", seed=0).named_parameters()}


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2),
        dict(dp=2, tp=2),
        dict(dp=4, dp_replicate=2),
        dict(dp=2, ac="full"),
        dict(tp=4, sequence_parallel=True),
        dict(pp=2, tp=2, microbatches=2),
    ],
    ids=["tp2", "dp2xtp2", "hsdp2x2", "dp2+ac", "tp4+sp", "pp2xtp2"],
)
def test_meta_built_shards_equal_the_one_process_initialization(one_process_parameters, layout):
    config = small_config(**layout)
    got = run_ranks(full_parameters, config.layout.world_size, config, timeout=120)[0]
    assert sorted(got) == sorted(one_process_parameters)
    for name, value in got.items():
        assert torch.equal(value, one_process_parameters[name]), name


def _vocab_loss_vs_gathered(vocab: int, n: int, seed: int):
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::5] = -100  # ignored positions
    start, stop = shard_range(vocab, rank, size)
    local = logits[:, start:stop].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, start, dist.group.WORLD)
    loss.backward()
    total, count = vocab_parallel_cross_entropy_sum(local.detach(), targets, start, dist.group.WORLD)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, targets, ignore_index=-100)
    ref.backward()
    grad_err = (local.grad - full.grad[:, start:stop]).abs().max().item() if stop > start else 0.0
    return (
        loss.item(),
        ref.item(),
        grad_err,
        total.item(),
        int(count),
        F.cross_entropy(logits, targets, reduction="sum").item(),
    )


@pytest.mark.parametrize("vocab", [258, 7, 3])  # even split, uneven split, a rank with no columns at tp=4
def test_vocab_parallel_loss_equals_cross_entropy_on_gathered_logits(vocab):
    for loss, ref, grad_err, total, count, ref_total in run_ranks(
        _vocab_loss_vs_gathered, 4, vocab, 37, vocab, timeout=60
    ):
        assert loss == pytest.approx(ref, rel=1e-12)
        assert grad_err < 1e-12
        assert total == pytest.approx(ref_total, rel=1e-12) and count == 37 - 8


@pytest.mark.parametrize("strategy, dp", [("FULL_SHARD", 4), ("SHARD_GRAD_OP", 4), ("NO_SHARD", 2)])
def test_measured_memory_matches_the_model(strategy, dp):
    config = small_config(dp=dp, fsdp=strategy, model="small")
    ranks = run_ranks(measured_model_states, dp, config, timeout=180)
    predicted = model_state_bytes(ranks[0]["num_params"], dp=dp, strategy=strategy, recipe="fp32_adam")
    for rank, measured in enumerate(ranks):
        for component in ("parameters", "gradients", "optimizer"):
            ratio = measured[component] / predicted[component]
            assert abs(ratio - 1) < 0.02, (
                f"rank {rank} {strategy} {component}: {measured[component]} vs {predicted[component]}"
            )
