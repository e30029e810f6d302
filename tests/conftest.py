"""Test set-up: Triton runs in its CPU interpreter when there is no CUDA device (set before any
import of triton), and `gpu`-marked tests skip with a reason."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found); runs on the GPU machine via bench/gpu_suite.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seeds():
    """Every test starts from the same torch and seqpar generator state."""
    import seqpar.random

    torch.manual_seed(0)
    seqpar.random.manual_seed(0)
    yield
