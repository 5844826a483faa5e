"""Chunk frames: the self-describing encoding of one chunk in the store.

A frame is a fixed 56-byte header followed by the payload::

    offset size  field
    0      4     magic b"CSNF"
    4      1     frame format version (1)
    5      1     codec: 0 raw, 1 zstd
    6      2     reserved, zero
    8      8     raw length (uncompressed bytes), little-endian uint64
    16     8     payload length (stored bytes), little-endian uint64
    24     32    blake3 digest of the raw bytes

The chunk's identity is the digest of its raw bytes, so the codec never
changes a chunk's name. Decoding checks every field before allocating and
verifies the digest before returning.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zstandard

from casnap.errors import IntegrityError, UnsupportedFormatError
from casnap.names import digest_of

MAGIC = b"CSNF"
FRAME_VERSION = 1
HEADER = struct.Struct("<4sBBH QQ 32s")
HEADER_SIZE = HEADER.size
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}
# Try compression on a sample first; skip it unless the sample shrinks this much.
_SAMPLE = 64 * 1024
_WORTH_IT = 0.92

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class FrameHeader:
    codec: int
    raw_length: int
    payload_length: int
    digest: bytes

    @property
    def frame_length(self) -> int:
        return HEADER_SIZE + self.payload_length


def encode(
    data: Buffer, digest: bytes, *, compress: bool = True, level: int = 1
) -> tuple[bytes, Buffer]:
    """Encode ``data`` as a frame; returns (header, payload) so raw data is never copied.

    zstd is used only when it saves space: a sample is tried first, then the
    whole chunk, and the smaller encoding wins.
    """
    raw_len = len(data)
    codec, payload = CODEC_RAW, data
    if compress and raw_len >= 64:
        cctx = zstandard.ZstdCompressor(level=level)
        sample = memoryview(data)[:_SAMPLE]
        if len(cctx.compress(sample)) < len(sample) * _WORTH_IT:
            packed = cctx.compress(data)
            if len(packed) < raw_len:
                codec, payload = CODEC_ZSTD, packed
    header = HEADER.pack(MAGIC, FRAME_VERSION, codec, 0, raw_len, len(payload), digest)
    return header, payload


def parse_header(buf: Buffer, name: str) -> FrameHeader:
    if len(buf) < HEADER_SIZE:
        raise IntegrityError(f"{name}: truncated frame header ({len(buf)} bytes)", name)
    magic, version, codec, _reserved, raw_len, payload_len, digest = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise IntegrityError(f"{name}: not a casnap chunk frame (bad magic)", name)
    if version != FRAME_VERSION:
        raise UnsupportedFormatError(f"{name}: chunk frame version {version} is not supported")
    if codec not in CODEC_NAMES:
        raise IntegrityError(f"{name}: unknown codec {codec}", name)
    if codec == CODEC_RAW and raw_len != payload_len:
        raise IntegrityError(f"{name}: raw frame with mismatched lengths", name)
    return FrameHeader(codec, raw_len, payload_len, bytes(digest))


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
    if hdr.codec == CODEC_ZSTD:
        try:
            data: Buffer = zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=hdr.raw_length
            )
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{name}: corrupt zstd payload: {exc}", name) from exc
        if len(data) != hdr.raw_length:
            raise IntegrityError(f"{name}: decompressed to the wrong size", name)
    else:
        data = payload
    if digest_of(data) != expected_digest:
        raise IntegrityError(f"{name}: blake3 digest mismatch (stored bytes are corrupt)", name)
    return data
