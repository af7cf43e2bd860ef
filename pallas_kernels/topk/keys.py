"""Keys of the top-k kernels: float32 bits -> int32 whose signed order is the float order (b ^
((b >> 31) & 0x7FFFFFFF)); -inf, NaN and masked lanes get _INVALID, below every valid key. The
sample's layout, shared by the threshold searches of both backends."""

_SIGN = -(1 << 31)  # 0x80000000 as int32
_LOW31 = (1 << 31) - 1
_INVALID = -(1 << 31)  # key given to -inf / NaN / out-of-range lanes: below every valid key
_KEY_NEG_INF = -2139095041  # ordered key of -inf (0x807FFFFF): no valid key equals it
_KEY_LOW = _KEY_NEG_INF + 1  # ordered key of -FLT_MAX, the lowest valid key
_KEY_POS_INF = 2139095040  # ordered key of +inf (0x7F800000), the highest valid key
_KEY_ABOVE = _KEY_POS_INF + 1  # above every valid key
_RUN = 8  # sampled keys are runs of 8 adjacent columns: one 32-byte sector each
_RUN_HASH = -1640531535  # run r of a row's sample starts at r q + ((r * _RUN_HASH >>> 16) % (q / _RUN)) * _RUN
