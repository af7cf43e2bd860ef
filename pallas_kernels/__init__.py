"""GPU kernels of DeepSeek-V3.2 sparse attention, each beside its pure-jnp reference.

The kernels know nothing of layers: they take arrays and static sizes. The references are the
XLA path (CPU, and the baseline on GPU) and the oracles the kernels are tested against.
"""
