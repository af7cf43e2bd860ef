"""Device facts and constants the kernels share: what they ask of the GPU and size themselves by."""

import jax

HOPPER_SMS = 132  # SMs of an H100 / H200 SXM: the static program targets are sized by it
SMEM_BYTES = 227 * 1024  # Hopper's dynamic shared memory per block
MAX_SWIZZLE = 128  # bytes: the widest shared-memory swizzle of TMA and wgmma
LOG2E = 1.4426950408889634  # log2(e): softmax scores kept in log2 units, so exp2 does
LN2 = 0.6931471805599453  # ln(2): log2-unit log-sum-exps back to natural log


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x): the Mosaic GPU
    kernels here use its wgmma and TMA."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def num_sms() -> int:
    """The default device's SM count (HOPPER_SMS where the device does not say)."""
    return getattr(jax.devices()[0], "core_count", None) or HOPPER_SMS


def next_pow2(x: int, floor: int = 1) -> int:
    """The smallest power of two >= max(x, floor)."""
    return max(floor, 1 << max(0, int(x) - 1).bit_length())
