"""JSON text: the one canonical form casnap writes, and bounded reading of untrusted JSON.

A manifest's or record's bytes are :func:`canonical_json` of its model dump
(sorted keys, no spaces, UTF-8, no NaN): the bytes are the format, and a
manifest's name is their hash. :func:`load_json` reads what a store returned
without letting it make the parser raise a bare error or spend quadratic time.
"""

from __future__ import annotations

import json
from typing import Any

from casnap.errors import ManifestValidationError

# Python's own default bound on int(str) (sys.get_int_max_str_digits), so no
# record a default Python writer can produce is refused, but a reader stays
# bounded whatever that process-wide setting is.
MAX_INT_DIGITS = 4300


def canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (casnap never writes it)")


def load_json(data: bytes, what: str) -> Any:
    """Untrusted JSON of a repository record; every failure is a ManifestValidationError.

    Integers are bounded (``MAX_INT_DIGITS``) and ``NaN``/``Infinity`` refused,
    so no record can make the parser raise a bare ``ValueError`` or spend
    quadratic time converting digits.
    """
    try:
        return json.loads(data, parse_int=_bounded_int, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        raise ManifestValidationError(f"{what}: not valid JSON: {exc}", what) from exc
