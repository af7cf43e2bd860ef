"""The top-k kernels' keys, shared by both backends: float32 bits b -> the int32 b ^ ((b >> 31) &
_LOW31), whose signed order is the float order; -inf, NaN and masked lanes get _INVALID."""

_SIGN = -(1 << 31)  # 0x80000000 as int32: key ^ _SIGN orders as an unsigned int
_LOW31 = (1 << 31) - 1
_INVALID = -(1 << 31)  # key given to -inf / NaN / out-of-range lanes: below every valid key
_KEY_NEG_INF = -2139095041  # ordered key of -inf (0x807FFFFF): no valid key equals it
_KEY_LOW = _KEY_NEG_INF + 1  # ordered key of -FLT_MAX, the lowest valid key
_KEY_POS_INF = 2139095040  # ordered key of +inf (0x7F800000), the highest valid key
_KEY_ABOVE = _KEY_POS_INF + 1  # above every valid key
