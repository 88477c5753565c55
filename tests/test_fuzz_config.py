"""Fuzzed configuration: any combination of flags either runs or ends with one clear line before any
rank starts (issue 11). Checks run in-process; a sample of the valid combinations is trained for a step."""

import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from helpers import small_config
from tessera.launching.launch import run_ranks

degrees = st.integers(0, 4)
FLAGS = dict(
    pp=degrees,
    dp=degrees,
    dp_replicate=st.integers(0, 3),
    cp=degrees,
    tp=degrees,
    sequence_parallel=st.booleans(),
    fsdp=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "full_shard", "ZERO4"]),
    ac=st.sampled_from(["none", "full", "selective", "some"]),
    schedule=st.sampled_from([None, "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv2"]),
    virtual=st.integers(0, 3),
    pp_layers=st.sampled_from([None, "1,1", "2,2", "3,1", "1,x", "4", ""]),
    cp_method=st.sampled_from([None, "ring", "allgather", "ulysses"]),
    microbatches=st.integers(0, 5),
    seq_len=st.integers(-1, 80),
    global_batch=st.integers(-1, 17),
    n_layers=st.integers(0, 5),
    steps=st.integers(-1, 4),
    lr=st.sampled_from([3e-3, 0.0, -1.0, float("inf"), float("nan")]),
    max_grad_norm=st.sampled_from([1.0, 0.0, float("inf"), -1.0]),
    on_nonfinite=st.sampled_from(["stop", "skip", "ignore"]),
)


def outcome(config_kwargs):
    """None if the config is valid, else its one-line error (anything but a ValueError fails the test)."""
    try:
        config = small_config(**config_kwargs)
        config.check()
    except ValueError as e:
        return str(e)
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries(FLAGS))
def test_every_invalid_combination_ends_with_one_clear_line_quickly(flags):
    started = time.perf_counter()
    message = outcome(flags)
    assert time.perf_counter() - started < 5
    if message is not None:
        assert message and "\n" not in message and "Traceback" not in message, message


def _one_step(config):
    from tessera.trainer import Trainer

    import torch

    trainer = Trainer(config, torch.device("cpu"))
    return trainer.train_step().record()["loss"]


VALID_CHOICES = dict(
    pp=st.integers(1, 2),
    dp=st.integers(1, 2),
    dp_replicate=st.just(1),
    cp=st.integers(1, 2),
    tp=st.integers(1, 2),
    sequence_parallel=st.booleans(),
    fsdp=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP"]),
    ac=st.sampled_from(["none", "full"]),
    schedule=st.sampled_from([None, "gpipe", "1f1b", "interleaved-1f1b"]),
    virtual=st.integers(1, 2),
    pp_layers=st.just(None),
    cp_method=st.sampled_from([None, "ring", "allgather"]),
    microbatches=st.integers(1, 4),
    seq_len=st.sampled_from([16, 32]),
    global_batch=st.sampled_from([4, 8]),
    n_layers=st.integers(2, 4),
    steps=st.just(1),
    lr=st.just(3e-3),
    max_grad_norm=st.just(1.0),
    on_nonfinite=st.sampled_from(["stop", "skip"]),
)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(st.fixed_dictionaries(VALID_CHOICES))
def test_every_valid_small_combination_trains(flags):
    assume(outcome(flags) is None)
    config = small_config(**flags)
    assume(config.layout.world_size <= 8)
    losses = run_ranks(_one_step, config.layout.world_size, config, timeout=120)
    assert all(loss == pytest.approx(losses[0], rel=1e-6) for loss in losses) and 4 < losses[0] < 7
