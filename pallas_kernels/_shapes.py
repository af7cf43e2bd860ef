"""Static block-size arithmetic shared by the kernels (Triton blocks are powers of two)."""


def next_pow2(x: int, floor: int = 1) -> int:
    """The smallest power of two >= max(x, floor)."""
    return max(floor, 1 << max(0, int(x) - 1).bit_length())
