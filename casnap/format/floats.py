"""Floats as exact text in a manifest: ``float.hex`` form, or ``nan:<bits>`` for a NaN.

The format's one home for float text: primitives (``float`` and ``complex``)
and quantization scales are written by :func:`encode_float` and read by
:func:`decode_float`, which the manifest models also call to validate, so a
value no reader could decode (``0x1p+99999`` overflows a double) is refused
when the manifest is read, naming the entry, instead of raising a bare
``OverflowError`` in whichever reader meets it first.
"""

from __future__ import annotations

import math
import re
import struct

_CANONICAL_NAN_BITS = 0x7FF8000000000000
_NAN_BITS_RE = re.compile(r"^nan:[0-9a-f]{16}$")


def encode_float(x: float) -> str:
    """Exact text of a float: ``float.hex`` form, or ``nan:<64-bit pattern>`` for a NaN whose
    bits ``float.hex`` would lose (a sign or payload, e.g. ``inf - inf`` is negative NaN)."""
    if math.isnan(x):
        (bits,) = struct.unpack("<Q", struct.pack("<d", x))
        if bits != _CANONICAL_NAN_BITS:
            return f"nan:{bits:016x}"
    return x.hex()


def decode_float(text: str) -> float:
    """Inverse of :func:`encode_float`; raises ValueError on malformed or overflowing text."""
    if text.startswith("nan:"):
        if not _NAN_BITS_RE.match(text):
            raise ValueError(f"malformed NaN bit pattern {text!r}")
        (value,) = struct.unpack("<d", struct.pack("<Q", int(text[4:], 16)))
        if not math.isnan(value):
            raise ValueError(f"{text!r} is not the bit pattern of a NaN")
        return float(value)
    return hex_float(text)


def hex_float(text: str) -> float:
    """``float.fromhex`` that raises ValueError, not OverflowError, on a value too large."""
    try:
        return float.fromhex(text)
    except OverflowError as exc:  # "0x1p+99999": well-formed, but no double holds it
        raise ValueError(f"{text[:40]!r} overflows a 64-bit float") from exc
