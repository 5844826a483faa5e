"""A chunk frame's fixed header, and the zstd contexts every codec shares.

A frame is a fixed 56-byte header followed by the payload::

    offset size  field
    0      4     magic b"CSNF"
    4      1     frame format version (1)
    5      1     codec: 0 raw, 1 zstd, 2 zstd over byte-grouped elements,
                 3 delta (format 2: zstd over the byte-grouped XOR with a base chunk)
    6      2     element size for codec 2 (2, 4 or 8), group width for codec 3
                 (1, 2, 4 or 8), else zero
    8      8     raw length (uncompressed bytes), little-endian uint64
    16     8     payload length (stored bytes), little-endian uint64
    24     32    blake3 digest of the raw bytes

The chunk's identity is the digest of its raw bytes, so the codec never
changes a chunk's name. :func:`parse_header` checks every field before a
payload is allocated. The codecs themselves are :mod:`casnap.format.codec`
(raw and zstd, and :func:`~casnap.format.codec.decode` of any frame) and
:mod:`casnap.format.delta` (the delta frame's payload); callers reach these
names through ``codec``.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import zstandard

from casnap.errors import IntegrityError

MAGIC = b"CSNF"
# The largest chunk a format-1 repository holds (docs/format.md, Limits): a frame
# declaring more raw bytes is damage, refused before anything is allocated.
MAX_CHUNK_SIZE = 1 << 30
FRAME_VERSION = 1
HEADER = struct.Struct("<4sBBH QQ 32s")
HEADER_SIZE = HEADER.size
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_ZSTD_GROUPED = 2
CODEC_DELTA = 3
CODEC_NAMES = {
    CODEC_RAW: "raw",
    CODEC_ZSTD: "zstd",
    CODEC_ZSTD_GROUPED: "zstd-grouped",
    CODEC_DELTA: "delta",
}
GROUPABLE = (2, 4, 8)
DELTA_GROUPS = (1, 2, 4, 8)
DIGEST_SIZE = 32

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class FrameHeader:
    codec: int
    elem_size: int
    raw_length: int
    payload_length: int
    digest: bytes

    @property
    def frame_length(self) -> int:
        return HEADER_SIZE + self.payload_length


def parse_header(buf: Buffer, name: str) -> FrameHeader:
    if len(buf) < HEADER_SIZE:
        raise IntegrityError(f"{name}: truncated frame header ({len(buf)} bytes)", name)
    magic, version, codec, elem, raw_len, payload_len, digest = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise IntegrityError(f"{name}: not a casnap chunk frame (bad magic)", name)
    if version != FRAME_VERSION:
        # Format 1 repositories hold version-1 frames only (a new frame version
        # comes with a new major format, refused at the config), so another
        # byte here is damage, not a newer writer.
        raise IntegrityError(
            f"{name}: damaged frame header (version byte {version}; format 1 frames are "
            f"version {FRAME_VERSION})",
            name,
        )
    if codec not in CODEC_NAMES:
        raise IntegrityError(f"{name}: unknown codec {codec}", name)
    if codec == CODEC_RAW and raw_len != payload_len:
        raise IntegrityError(f"{name}: raw frame with mismatched lengths", name)
    if raw_len > MAX_CHUNK_SIZE:
        raise IntegrityError(
            f"{name}: frame declares {raw_len} raw bytes, more than the largest chunk "
            f"({MAX_CHUNK_SIZE})",
            name,
        )
    if payload_len > raw_len:
        # A writer stores a chunk raw unless compression makes it smaller.
        raise IntegrityError(
            f"{name}: frame payload of {payload_len} bytes is larger than its {raw_len} raw bytes",
            name,
        )
    if codec == CODEC_ZSTD_GROUPED:
        if elem not in GROUPABLE or raw_len % elem:
            raise IntegrityError(f"{name}: bad element size {elem} for a grouped frame", name)
    elif codec == CODEC_DELTA:
        if elem not in DELTA_GROUPS or raw_len % elem:
            raise IntegrityError(f"{name}: bad group width {elem} for a delta frame", name)
        if payload_len < DIGEST_SIZE:
            raise IntegrityError(f"{name}: delta frame too short for its base digest", name)
    elif elem != 0:
        raise IntegrityError(f"{name}: element size set on a {CODEC_NAMES[codec]} frame", name)
    return FrameHeader(codec, elem, raw_len, payload_len, bytes(digest))


_local = threading.local()


# Byte-grouped float planes are noise (mantissas) or short runs (exponents): with the
# hash table zstd sizes for text, most of a grouped chunk's time went to looking up
# matches that do not pay. zstd's smallest table (64 entries) compresses them 1.2-2.1x
# faster, to the same size or smaller; it misses matches far back, such as rows repeated
# within a chunk (benchmarks/README.md, "zstd's hash table for grouped planes").
_GROUPED_HASH_LOG = 6


def compressor(level: int, grouped: bool = False) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``: making one costs more than compressing
    a small chunk, and a one-shot ``compress`` gives the same bytes from a reused one.
    ``grouped``: for byte-grouped elements (at levels 1-3, a small hash table)."""
    cache: dict[tuple[int, bool], zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get((level, grouped))
    if cctx is None:
        if grouped and 1 <= level <= 3:
            params = zstandard.ZstdCompressionParameters.from_level(
                level, hash_log=_GROUPED_HASH_LOG
            )
            cctx = zstandard.ZstdCompressor(compression_params=params)
        else:
            cctx = zstandard.ZstdCompressor(level=level)
        cache[(level, grouped)] = cctx
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: one per call costs more than a delta's small body."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def decompress(payload: Buffer, raw_length: int, name: str, *, exact: bool = True) -> bytes:
    """Decompress a zstd payload into exactly ``raw_length`` bytes, allocating no more.

    python-zstandard sizes its output by the content size the zstd frame
    declares, whatever ``max_output_size`` says: a few bytes declaring 3 GiB
    of zeros would allocate 3 GiB. So a declared content size must be the
    frame header's raw length (already checked against the manifest); an
    undeclared one is bounded by ``max_output_size``.
    """
    try:
        declared = zstandard.frame_content_size(payload)
        if not exact and 0 <= declared <= raw_length:
            raw_length = declared  # a delta body: at most ``raw_length``, exactly what it says
        if declared not in (-1, raw_length):
            raise IntegrityError(
                f"{name}: zstd payload declares {declared} bytes, the frame {raw_length}", name
            )
        data = decompressor().decompress(payload, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{name}: corrupt zstd payload: {exc}", name) from exc
    if len(data) != raw_length and (exact or declared != -1):
        raise IntegrityError(f"{name}: decompressed to the wrong size", name)
    return data
