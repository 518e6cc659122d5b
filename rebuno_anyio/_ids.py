"""New ids: UUIDv7 (RFC 9562), time-ordered so that listing by id is listing by
creation, and monotonic within this process even inside one millisecond."""

from __future__ import annotations

import os
import time

__all__ = ["uuid7"]

_last_ms = 0
_seq = 0


def uuid7() -> str:
    """A new lowercase hyphenated UUIDv7 string."""
    global _last_ms, _seq
    ms = time.time_ns() // 1_000_000
    if ms <= _last_ms:
        ms = _last_ms
        _seq += 1
        if _seq > 0xFFF:  # 4096 ids in one millisecond: borrow the next one
            ms += 1
            _seq = 0
    else:
        _seq = int.from_bytes(os.urandom(2), "big") & 0x3FF
    _last_ms = ms
    rand_b = int.from_bytes(os.urandom(8), "big") & 0x3FFF_FFFF_FFFF_FFFF
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | _seq << 64 | 0b10 << 62 | rand_b
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
