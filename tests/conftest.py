"""One switch for the whole suite: Pallas kernels interpret on CPU and compile on a GPU."""

import os

# Mosaic GPU's interpreter needs a CPU thread per simulated warpgroup (see jax_sparse_mla.kernels.resolve);
# set before jax creates its CPU client, so the dense kernel also runs inside the forward on a 2-core CI box.
os.environ.setdefault("PJRT_NPROC", "4")

import jax  # noqa: E402
import ml_dtypes
import numpy as np
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


def quantize_fp8_blocks(w):
    """float32 [out, in] -> (e4m3 [out, in], fp32 scales [ceil(out/128), ceil(in/128)]), DeepSeek's layout."""
    rows, cols = w.shape
    nb = (-(-rows // 128), -(-cols // 128))
    scale = np.zeros(nb, np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(blk).max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale
