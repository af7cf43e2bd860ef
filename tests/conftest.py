"""One switch for the whole suite: Pallas kernels interpret on CPU and compile on a GPU."""

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpret():
    """True on CPU (Pallas interpret mode), False on a GPU."""
    return INTERPRET
