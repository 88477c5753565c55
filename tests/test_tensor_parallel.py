"""Numerics contract for tensor and sequence parallel: every layout trains like one process."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import small_config, train_losses_and_grads
from parallel.launch import run_ranks
from parallel.tensor import shard_range, vocab_parallel_cross_entropy


@pytest.fixture(scope="module")
def reference():
    return run_ranks(train_losses_and_grads, 1, small_config(), timeout=120)[0]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_trains_like_one_process(reference, tp, sp):
    ref_losses, ref_grads = reference
    losses, grads = run_ranks(train_losses_and_grads, tp, small_config(tp=tp, sequence_parallel=sp), timeout=120)[0]
    assert len(losses) == 3
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs one-process {b}"
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        assert g.shape == ref_grads[name].shape, name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ref_losses[-1] < ref_losses[0]


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
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, targets, ignore_index=-100)
    ref.backward()
    return loss.item(), ref.item(), (local.grad - full.grad[:, start:stop]).abs().max().item() if stop > start else 0.0


@pytest.mark.parametrize("vocab", [258, 7, 3])  # even split, uneven split, a rank with no columns at tp=4
def test_vocab_parallel_loss_equals_cross_entropy_on_gathered_logits(vocab):
    for loss, ref, grad_err in run_ranks(_vocab_loss_vs_gathered, 4, vocab, 37, vocab, timeout=60):
        assert loss == pytest.approx(ref, rel=1e-12)
        assert grad_err < 1e-12


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3"], "tp=3 does not divide the 4 attention heads"),
        (["--tp", "2", "--sequence-parallel", "--seq-len", "33"], "seq_len=33, tp=2; use --seq-len 32"),
        (["--model", "llama9"], "unknown model preset 'llama9'"),
        (["--pp", "2"], "pp=2: the pp axis is not available yet"),
        (["--tp", "0"], "tp=0 must be a positive integer"),
    ],
)
def test_bad_input_fails_before_any_rank_starts(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "parallel.cli", "train", "--steps", "1", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "step" not in out.stdout  # nothing ran
