import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run on CPU tensors through the interpreter. Triton reads this when a
# kernel is decorated, so it is set before any test imports kernels.triton_* (torch does not import triton).
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
