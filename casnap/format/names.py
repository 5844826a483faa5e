"""Object names, ref names and logical keys, validated so none can leave the repository."""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote_to_bytes

import blake3

from casnap.errors import InvalidNameError

HASH_HEX_LEN = 64
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_REF_DEPTH = 16
MAX_SEGMENT_BYTES = 255  # a file name on the common local file systems
MAX_NAME_KEY_BYTES = 255  # one file name on a local disk: the longest flat key ever written
# A flat key at most this long; a local store writes <key>~tmp-<32 hex> first (37 bytes
# more), and both must fit one file name. Versions before hashed keys wrote flat keys
# up to 255 bytes (on stores without that temporary file): those are still read.
MAX_FLAT_KEY_BYTES = 200
# A name whose flat key would be longer is stored under HASHED_PREFIX + blake3 hex of
# its UTF-8 bytes, and its record says the name (name_key). encode_name writes "%" only
# before two hex digits, never "%%", so a hashed key is never another name's flat key
# (and store keys allow only [A-Za-z0-9._+=@,%-], so no other character was free).
HASHED_PREFIX = "%%"
_HASHED_RE = re.compile(r"^%%[0-9a-f]{64}$")
# Bytes a stored name keeps as they are; every other byte becomes %XX (encode_name).
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._+=@,-")


def digest_of(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte blake3 digest of ``data`` (multi-threaded for large buffers)."""
    big = len(data) >= (8 << 20)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if big else blake3.blake3()
    h.update(data)
    return h.digest()


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """The blake3 hex digest of ``data``: the name of a chunk or manifest."""
    return digest_of(data).hex()


def check_hash(value: str, what: str = "object name") -> str:
    if not isinstance(value, str) or not _HASH_RE.match(value):
        raise InvalidNameError(f"{what} {value!r} is not a 64-digit lowercase blake3 hex digest")
    return value


def check_ref_name(name: str, what: str = "snapshot name") -> str:
    """A snapshot or tag name: ``/``-separated segments, each one a file system would accept.

    Refused: an empty name or segment, ``.`` and ``..``, control characters
    (and NUL, and unpaired surrogates, which have no UTF-8 form), a segment
    over 255 bytes of UTF-8 and more than 16 segments. Everything else is
    accepted: spaces, ``#``, non-ASCII letters, ... however long the whole
    name's stored key would be (:func:`name_key`).
    """
    if not isinstance(name, str) or not name:
        raise InvalidNameError(f"a {what} must be a non-empty string")
    segments = name.split("/")
    if len(segments) > MAX_REF_DEPTH:
        raise InvalidNameError(f"{what} {name!r} is nested more than {MAX_REF_DEPTH} deep")
    for seg in segments:
        if seg in ("", ".", ".."):
            part = "an empty segment" if not seg else f"the segment {seg!r}"
            raise InvalidNameError(
                f"{what} {name!r} has {part}; '.', '..' and empty segments are refused"
            )
        bad = next((c for c in seg if unicodedata.category(c) in ("Cc", "Cs")), None)
        if bad is not None:
            raise InvalidNameError(
                f"{what} {name!r} contains the control character {bad!r}; "
                "control characters are refused"
            )
        if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidNameError(
                f"{what} {name!r}: a segment is longer than {MAX_SEGMENT_BYTES} bytes of UTF-8"
            )
    return name


def encode_name(name: str) -> str:
    """A name as one flat key component: ``%XX`` for every UTF-8 byte outside
    ``[A-Za-z0-9._+=@,-]``, ``/`` included.

    One component, so ``a`` and ``a/b`` are two sibling objects (neither is a
    folder of the other); plain ASCII, so it is stored alike on a local disk,
    in memory and in GCS (no Unicode normalization to change it); and a name
    that was valid before this layout and has no ``/`` is its own key, so those refs
    are where they always were. ``encode_name("run 1/é")`` is ``"run%201%2F%C3%A9"``.
    """
    return "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in name.encode("utf-8"))


def hashed_key(name: str) -> str:
    """The fixed-length key of a name too long for a flat key: ``%%`` + blake3 hex of its UTF-8."""
    return HASHED_PREFIX + hash_bytes(name.encode("utf-8"))


def is_hashed_key(key: str) -> bool:
    """Whether a key below ``refs/`` or ``tags/`` is a hashed one (:func:`hashed_key`)."""
    return key.startswith(HASHED_PREFIX) and "/" not in key


def check_hashed_key(key: str) -> bool:
    """Whether a hashed-looking key has the form :func:`hashed_key` writes (``%%`` + 64 hex)."""
    return _HASHED_RE.match(key) is not None


def name_key(name: str) -> str:
    """Where a (valid) ref or tag name is stored below ``refs/`` or ``tags/``.

    Its flat key (:func:`encode_name`) when that is at most 200 bytes, so the
    key and a local store's temporary name for it fit one file name: nearly
    every name valid before hashed keys existed, stored where it always was
    (:func:`casnap.repo.named.named_keys` also looks at a flat key of 201 to
    255 bytes, which older versions wrote). Else :func:`hashed_key`, 66 bytes,
    and the record stored there carries the name itself. ``name_key("a b")`` is ``"a%20b"``;
    ``name_key("é" * 60)`` is ``"%%"`` and 64 hex digits.
    """
    flat = encode_name(name)
    return flat if len(flat) <= MAX_FLAT_KEY_BYTES else hashed_key(name)


def decode_name(key: str) -> str:
    """The name stored under ``key`` (the part below ``refs/`` or ``tags/``).

    Reads both layouts: a flat component (:func:`encode_name`) and the nested
    one of repositories written before (``refs/a/b`` is ``a/b``). A component
    that is not valid percent-encoded UTF-8 (someone else's file) decodes with
    its bad bytes escaped, so a listing still shows it and a read then refuses it.
    """
    parts = [unquote_to_bytes(c).decode("utf-8", "backslashreplace") for c in key.split("/")]
    return "/".join(parts)


def legacy_key(name: str) -> str | None:
    """Where a nested name was stored before the flat layout (``a/b`` -> ``a/b``), if it could be.

    Only names with a ``/`` whose segments are all plain could be stored that
    way; for every other name the flat key is the only place.
    """
    if "/" not in name or encode_name(name.replace("/", "")) != name.replace("/", ""):
        return None
    return name


def escape_key(key: str) -> str:
    """Escape one component of a logical key ('/' separates components)."""
    return key.replace("%", "%25").replace("/", "%2F")


def unescape_key(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")
