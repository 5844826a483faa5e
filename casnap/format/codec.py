"""Chunk frames: the self-describing encoding of one chunk in the store.

A frame is a fixed 56-byte header followed by the payload::

    offset size  field
    0      4     magic b"CSNF"
    4      1     frame format version (1)
    5      1     codec: 0 raw, 1 zstd, 2 zstd over byte-grouped elements
    6      2     element size for codec 2 (2, 4 or 8), else zero
    8      8     raw length (uncompressed bytes), little-endian uint64
    16     8     payload length (stored bytes), little-endian uint64
    24     32    blake3 digest of the raw bytes

The chunk's identity is the digest of its raw bytes, so the codec never
changes a chunk's name. Decoding checks every field before allocating and
verifies the digest before returning.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import zstandard

from casnap.errors import IntegrityError
from casnap.format.names import digest_of

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
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_GROUPED: "zstd-grouped"}
GROUPABLE = (2, 4, 8)
# Compression is tried on a sample first and used only when the sample shrinks
# to this fraction or less: below that, the CPU it costs is worth more than the
# bytes it saves (fp32 weights shrink only to ~0.84 even byte-grouped, bf16 to
# ~0.68; benchmarks/suite.py measures both).
_SAMPLE = 64 * 1024
_WORTH_IT = 0.80

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


def group_bytes(data: Buffer, elem: int) -> bytes:
    """Byte ``i`` of every element, for each ``i`` in turn: exponents end up together."""
    raw = bytes(data)
    return b"".join(raw[i::elem] for i in range(elem))


def ungroup_bytes(data: Buffer, elem: int) -> bytearray:
    raw = bytes(data)
    n = len(raw) // elem
    out = bytearray(len(raw))
    for i in range(elem):
        out[i::elem] = raw[i * n : (i + 1) * n]
    return out


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``: making one costs more than compressing
    a small chunk, and a one-shot ``compress`` gives the same bytes from a reused one."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level)
    return cctx


def encode(
    data: Buffer,
    digest: bytes,
    *,
    compress: bool = True,
    level: int = 1,
    elem_size: int = 0,
) -> tuple[bytes, Buffer]:
    """Encode ``data`` as a frame; returns (header, payload) so raw data is never copied.

    zstd is used only when a sample shows it pays; with ``elem_size`` (2, 4 or
    8 for float tensors) zstd over byte-grouped elements is tried too and the
    smaller wins. Incompressible data is stored raw.
    """
    raw_len = len(data)
    codec, payload, elem = CODEC_RAW, data, 0
    if compress and raw_len >= 64:
        cctx = _compressor(level)
        sample = memoryview(data)[:_SAMPLE]
        best, best_len = CODEC_RAW, len(sample) * _WORTH_IT
        plain = len(cctx.compress(sample))
        if plain < best_len:
            best, best_len = CODEC_ZSTD, plain
        group = elem_size in GROUPABLE and raw_len % elem_size == 0
        if group:
            # Estimate each byte position on its own: in a whole chunk the groups
            # fill separate zstd blocks, each with its own entropy tables.
            raw_sample = bytes(sample[: len(sample) - len(sample) % elem_size])
            grouped = sum(len(cctx.compress(raw_sample[i::elem_size])) for i in range(elem_size))
            if grouped < best_len:
                best, best_len = CODEC_ZSTD_GROUPED, grouped
        if best == CODEC_ZSTD:
            packed = cctx.compress(data)
        elif best == CODEC_ZSTD_GROUPED:
            packed = cctx.compress(group_bytes(data, elem_size))
            elem = elem_size
        if best != CODEC_RAW and len(packed) < raw_len:
            codec, payload = best, packed
        else:
            elem = 0
    header = HEADER.pack(MAGIC, FRAME_VERSION, codec, elem, raw_len, len(payload), digest)
    return header, payload


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
    elif elem != 0:
        raise IntegrityError(f"{name}: element size set on a {CODEC_NAMES[codec]} frame", name)
    return FrameHeader(codec, elem, raw_len, payload_len, bytes(digest))


def decode(frame: Buffer, name: str, expected_digest: bytes, expected_size: int) -> Buffer:
    """Decode one frame and verify it is the chunk the caller asked for.

    Raises IntegrityError naming ``name`` on any mismatch: header fields, the
    declared size, truncation, the decompressed size, or the blake3 digest.
    """
    mv = memoryview(frame)
    hdr = parse_header(mv, name)
    if hdr.raw_length != expected_size:
        raise IntegrityError(
            f"{name}: frame holds {hdr.raw_length} bytes, manifest expects {expected_size}", name
        )
    if hdr.digest != expected_digest:
        raise IntegrityError(f"{name}: frame is for a different chunk", name)
    if len(mv) != hdr.frame_length:
        raise IntegrityError(
            f"{name}: frame is {len(mv)} bytes, header declares {hdr.frame_length}", name
        )
    payload = mv[HEADER_SIZE:]
    if hdr.codec in (CODEC_ZSTD, CODEC_ZSTD_GROUPED):
        data: Buffer = _decompress(payload, hdr.raw_length, name)
        if hdr.codec == CODEC_ZSTD_GROUPED:
            data = ungroup_bytes(data, hdr.elem_size)
    else:
        data = payload
    if digest_of(data) != expected_digest:
        raise IntegrityError(f"{name}: blake3 digest mismatch (stored bytes are corrupt)", name)
    return data


def _decompress(payload: Buffer, raw_length: int, name: str) -> bytes:
    """Decompress a zstd payload into exactly ``raw_length`` bytes, allocating no more.

    python-zstandard sizes its output by the content size the zstd frame
    declares, whatever ``max_output_size`` says: a few bytes declaring 3 GiB
    of zeros would allocate 3 GiB. So a declared content size must be the
    frame header's raw length (already checked against the manifest); an
    undeclared one is bounded by ``max_output_size``.
    """
    try:
        declared = zstandard.frame_content_size(payload)
        if declared not in (-1, raw_length):
            raise IntegrityError(
                f"{name}: zstd payload declares {declared} bytes, the frame {raw_length}", name
            )
        data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{name}: corrupt zstd payload: {exc}", name) from exc
    if len(data) != raw_length:
        raise IntegrityError(f"{name}: decompressed to the wrong size", name)
    return data


def verify_raw_in_place(
    head: Buffer, data: Buffer, received: int, name: str, expected_digest: bytes, expected_size: int
) -> None:
    """Check a raw frame that was read as ``head`` + ``data`` (``received`` bytes in all)."""
    hdr = parse_header(head, name)
    if hdr.codec != CODEC_RAW:
        raise IntegrityError(f"{name}: expected a raw frame, found {CODEC_NAMES[hdr.codec]}", name)
    if hdr.raw_length != expected_size or hdr.digest != expected_digest:
        raise IntegrityError(f"{name}: frame is for a different chunk", name)
    if received != HEADER_SIZE + expected_size:
        raise IntegrityError(
            f"{name}: frame is {received} bytes, header declares {hdr.frame_length}", name
        )
    if digest_of(data) != expected_digest:
        raise IntegrityError(f"{name}: blake3 digest mismatch (stored bytes are corrupt)", name)
