"""How values meet people: sizes (parsed and printed), times, floats, name order.

One module so that every command, every ``render()`` and every setting agrees:
a size typed as ``2GiB`` anywhere is parsed by :func:`parse_size` and shown as
``1.5 MiB`` by :func:`format_size` (both through :class:`pydantic.ByteSize`,
binary units); a time is shown in the local time zone with its offset
(:func:`format_time`); a float as the shortest decimal that reads back to it
(:func:`format_float`, never ``float.hex``); names in natural order
(:func:`natural_key`: ``step_2`` before ``step_10``).

Machine-readable output (``--json``) keeps raw values: bytes as integers,
times as ISO 8601 with their offset, floats as JSON numbers.

Example::

    from casnap.display import format_size, natural_key, parse_size

    parse_size("4MiB")                        # 4194304
    format_size(1572864)                      # '1.5 MiB'
    sorted(["step_10", "step_2"], key=natural_key)   # ['step_2', 'step_10']
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

__all__ = ["format_float", "format_size", "format_time", "natural_key", "parse_size"]

_UNIT_GAP = re.compile(r"(?<=\d)(?=[A-Za-z])")
_DIGITS = re.compile(r"(\d+)")


def parse_size(text: str | int | float) -> int:
    """Bytes from ``4194304``, ``4MiB``, ``4 MiB``, ``1.5GB`` or ``512k``; ValueError if not a size.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB) of 1000, as :class:`pydantic.ByteSize` reads them. Bounds (a negative
    number, say) are the caller's to check.
    """
    from pydantic import ByteSize, TypeAdapter, ValidationError

    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"{text!r} is not a size")
    try:
        return int(
            TypeAdapter(ByteSize).validate_python(text.strip() if isinstance(text, str) else text)
        )
    except ValidationError as exc:
        raise ValueError(f"{text!r} is not a size like 4194304, 4MiB or 1.5GB") from exc


def format_size(n: float) -> str:
    """``n`` bytes for people, in binary units with one decimal: ``'1.5 MiB'``, ``'512 B'``."""
    from pydantic import ByteSize

    sign = "-" if n < 0 else ""
    return sign + _UNIT_GAP.sub(" ", ByteSize(int(abs(n))).human_readable(), count=1)


def format_time(iso: str) -> str:
    """An ISO 8601 time in the local time zone, with its offset: ``'2026-11-24 19:40:12 +0100'``.

    The local zone is the process's (``TZ`` honoured). Text that is not a time
    is returned as it is; a time without an offset is taken to be UTC (what
    every casnap record holds).
    """
    try:
        t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return iso
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S %z")


def format_float(x: float, digits: int | None = None) -> str:
    """A float in decimal: the shortest text that reads back to it (``repr``), or rounded
    to ``digits`` significant digits for a table of figures (``format_float(1.0, 3)`` is
    ``'1.00'``: the zeros say it is a measurement, not an integer).
    """
    if math.isnan(x) or math.isinf(x):
        return repr(x)
    if digits is None:
        return repr(float(x))
    text = f"{x:#.{digits}g}"
    return text[:-1] if text.endswith(".") else text


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders digit runs by value: ``step_2`` < ``step_10`` < ``step_100``.

    Ties between equal values written differently (``step_01``, ``step_1``)
    fall back to the text, so the order is total and stable.
    """
    key: list[tuple[int, int, str]] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            # By length, then digits: the value's order without int() (no digit limit).
            digits = part.lstrip("0")
            key.append((0, len(digits), digits))
        elif part:
            key.append((1, 0, part))
    key.append((-1, 0, name))  # ends first: "a" before "a9"; then the text breaks ties
    return tuple(key)
