"""What the kernels' backend choices ask of the device."""

import jax


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x): the Mosaic GPU
    kernels here use its wgmma and TMA."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")
