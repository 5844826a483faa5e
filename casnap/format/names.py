"""Object names, ref names and logical keys, validated so none can leave the repository."""

from __future__ import annotations

import re

import blake3

from casnap.errors import InvalidNameError

HASH_HEX_LEN = 64
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_REF_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@,-]{0,127}$")
MAX_REF_DEPTH = 16


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


def check_ref_name(name: str) -> str:
    """A ref name: '/'-separated segments of safe characters, no '.', '..' or empty segment."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError("a snapshot name must be a non-empty string")
    segments = name.split("/")
    if len(segments) > MAX_REF_DEPTH:
        raise InvalidNameError(f"snapshot name {name!r} is nested more than {MAX_REF_DEPTH} deep")
    for seg in segments:
        if not _REF_SEGMENT_RE.match(seg) or seg in (".", ".."):
            raise InvalidNameError(
                f"snapshot name {name!r}: segment {seg!r} must start with a letter or digit "
                "and use only letters, digits and . _ + = @ , -"
            )
    return name


def escape_key(key: str) -> str:
    """Escape one component of a logical key ('/' separates components)."""
    return key.replace("%", "%25").replace("/", "%2F")


def unescape_key(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")


def join_key(*components: str) -> str:
    return "/".join(components)
