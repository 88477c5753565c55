import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run on CPU tensors through the interpreter. Triton reads this when a
# kernel is decorated, so it is set before any test imports tessera.kernels.triton_* (torch does not import triton).
import torch  # noqa: E402


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def reference():
    """The one-process run every layout is compared with: (losses, grad norms, gradients of step 1)."""
    from helpers import small_config, train_losses_and_grads
    from tessera.parallel.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(), timeout=120)[0]


@pytest.fixture(scope="session")
def masked_reference():
    """The one-process run on targets masked unevenly across rows."""
    from helpers import small_config, train_losses_and_grads
    from tessera.parallel.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(), True, timeout=120)[0]


PIPELINE_BASE = dict(n_layers=8, global_batch=8)  # deep enough for 8 virtual stages, rows for dp4 x 2 microbatches


@pytest.fixture(scope="session")
def deep_reference():
    """The one-process run the pipeline layouts are compared with (8 layers, 8 rows per step)."""
    from helpers import small_config, train_losses_and_grads
    from tessera.parallel.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(**PIPELINE_BASE), timeout=120)[0]
