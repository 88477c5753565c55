"""Every step's record says what its host did besides launching it (runtime/metrics/host_account.py): the
garbage collections that ran in it and on CUDA the allocator's driver calls (a training run's records:
tests/test_cli_train.py)."""

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.metrics.host_account import HostAccount, alternation


def test_a_collection_inside_the_block_is_counted_with_its_generation_and_seconds():
    with HostAccount(torch.device("cpu")) as host:
        gc.collect(0)
        gc.collect(2)
    figures = host.figures()
    assert figures["gc_collections"]["gen0"] >= 1 and figures["gc_collections"]["gen2"] >= 1
    assert figures["gc_s"] > 0 and "device_mallocs" not in figures  # no allocator on CPU
    gc.collect()  # outside the block: not counted, and the callback is gone
    assert host.figures() == figures and host._on_gc not in gc.callbacks


@pytest.mark.gpu
def test_on_cuda_the_allocators_driver_calls_are_counted():
    torch.cuda.empty_cache()
    with HostAccount(torch.device("cuda")) as host:
        x = torch.empty(1 << 28, device="cuda")  # 1 GiB: a segment of its own, from the driver
        del x
        torch.cuda.empty_cache()  # and back to it
    figures = host.figures()
    assert figures["device_mallocs"] >= 1 and figures["device_frees"] >= 1 and figures["alloc_retries"] == 0


@settings(max_examples=60, deadline=None)
@given(
    base=st.floats(0.1, 1.0),
    swing=st.floats(0.0, 0.05),
    steps=st.integers(4, 9),
    by=st.sampled_from(["gc_s", "data_s", "device"]),
)
def test_an_alternating_step_is_named_by_the_host_figure_that_alternates_with_it(base, swing, steps, by):
    """Odd steps slower by `swing`: a garbage collection or a batch that costs that on the odd steps is named;
    a slowdown the host's figures do not show (the device's) is named by none."""
    times = [base + (swing if k % 2 == 0 else 0.0) for k in range(steps)]
    hosts = [
        {
            "launch_s": base / 2,
            "data_s": 0.001 + (swing if by == "data_s" and k % 2 == 0 else 0.0),
            "gc_s": swing if by == "gc_s" and k % 2 == 0 else 0.0,
        }
        for k in range(steps)
    ]
    found = alternation(times, hosts)
    assert found["step_time_difference_s"] == pytest.approx(swing, abs=1e-12)
    if swing > 1e-9:
        assert found["host_side"] == (None if by == "device" else by)
    assert alternation(times[:3], hosts[:3]) is None
