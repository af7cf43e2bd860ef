"""One switch for the whole suite: Pallas kernels interpret on CPU and compile on a GPU.

Shared helpers live in the `tests.support` package (importing it sets PJRT_NPROC before jax
creates its CPU client); tests import them from there, never from conftest or another test module.
"""

import pytest

from tests.support import INTERPRET, ON_GPU


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
