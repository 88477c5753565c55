"""Every step's record says what its host did besides launching it (runtime/metrics/host_account.py): the
garbage collections that ran in it and on CUDA the allocator's driver calls (a training run's records:
tests/test_cli_train.py)."""

import gc

import pytest
import torch

from tessera.metrics.host_account import HostAccount


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
