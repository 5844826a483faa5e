"""Chunk frames: the self-describing encoding of one chunk in the store.

A frame is a fixed 56-byte header (:mod:`casnap.format.frame`) followed by
the payload; the header's codec byte says how the payload holds the raw
bytes: 0 raw, 1 zstd, 2 zstd over byte-grouped elements, 3 a delta against
a base chunk (:mod:`casnap.format.delta`). This module chooses and applies
the codecs: :func:`encode` (the whole-chunk codecs, tried on a sample),
and :func:`decode` of any frame, which checks every field before
allocating and verifies the digest before returning. It is the one import
a frame's readers and writers need: the header's names are here too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from casnap.errors import IntegrityError
from casnap.format import frame as _frame
from casnap.format.delta import undelta
from casnap.format.frame import (
    CODEC_DELTA,
    CODEC_NAMES,
    CODEC_RAW,
    CODEC_ZSTD,
    CODEC_ZSTD_GROUPED,
    DELTA_GROUPS,
    DIGEST_SIZE,
    FRAME_VERSION,
    GROUPABLE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CHUNK_SIZE,
    Buffer,
    FrameHeader,
    parse_header,
)
from casnap.format.names import digest_of

# The header's names are re-exported: ``codec`` is the one import of a frame's users.
__all__ = [
    "Buffer",
    "CODEC_DELTA",
    "CODEC_NAMES",
    "CODEC_RAW",
    "CODEC_ZSTD",
    "CODEC_ZSTD_GROUPED",
    "DELTA_GROUPS",
    "DIGEST_SIZE",
    "FRAME_VERSION",
    "FrameHeader",
    "GROUPABLE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CHUNK_SIZE",
    "choose_codec",
    "decode",
    "encode",
    "group_bytes",
    "may_pay",
    "parse_header",
    "ungroup_bytes",
]

# Compression is tried on a sample first and used only when the sample shrinks
# to this fraction or less: above it, the CPU it costs is worth more than the
# bytes it saves. Trained fp32 weights shrink only to ~0.84 even byte-grouped,
# bf16 to ~0.68 (benchmarks/suite.py measures both). Freshly initialized fp32
# weights (nn.Linear's uniform init) shrink to ~0.79: grouping and zstd cost
# ~15-20 ms per 4 MiB chunk on one core, and at 0.80 a take of 256 MiB of them
# took 0.64 s against 0.23 s raw, for 21% fewer bytes (benchmarks/README.md).
_SAMPLE = 64 * 1024
_WORTH_IT = 0.75


def _planes(raw: bytes, elem: int) -> Iterator[bytes]:
    """Byte ``i`` of every element, for each ``i`` in turn: exponents end up together."""
    return (raw[i::elem] for i in range(elem))


def group_bytes(data: Buffer, elem: int) -> bytes:
    """The byte-grouped layout of ``data`` (:func:`_planes`, joined)."""
    return b"".join(_planes(bytes(data), elem))


def _compress_grouped(level: int, data: Buffer, elem: int) -> bytes:
    """One zstd frame of :func:`group_bytes` of ``data``, fed to zstd one plane at a
    time: the grouped bytes are never joined into one copy (a seventh less time
    for a 4 MiB chunk)."""
    raw = bytes(data)
    cctx = _frame.compressor(level, grouped=True)
    stream = cctx.compressobj(size=len(raw))  # the frame declares its size, as compress() does
    parts = [stream.compress(plane) for plane in _planes(raw, elem)]
    parts.append(stream.flush())
    return b"".join(parts)


def ungroup_bytes(data: Buffer, elem: int) -> bytearray:
    raw = bytes(data)
    n = len(raw) // elem
    out = bytearray(len(raw))
    for i in range(elem):
        out[i::elem] = raw[i * n : (i + 1) * n]
    return out


def _trial(level: int, sample: Buffer, elem_size: int) -> tuple[int, int]:
    """The codec that shrinks ``sample`` most, if to ``_WORTH_IT`` or less, else raw,
    and the bytes that codec stores for the sample (its length when raw).

    With ``elem_size`` in :data:`GROUPABLE` (``sample`` a whole number of
    elements) zstd over byte-grouped elements is tried too.
    """
    best, best_len = CODEC_RAW, len(sample) * _WORTH_IT
    plain = len(_frame.compressor(level).compress(sample))
    if plain < best_len:
        best, best_len = CODEC_ZSTD, plain
    if elem_size in GROUPABLE:
        # Estimate each byte position on its own: in a whole chunk the groups
        # fill separate zstd blocks, each with its own entropy tables.
        raw_sample = bytes(sample[: len(sample) - len(sample) % elem_size])
        cctx = _frame.compressor(level, grouped=True)
        grouped = sum(len(cctx.compress(raw_sample[i::elem_size])) for i in range(elem_size))
        if grouped < best_len:
            best, best_len = CODEC_ZSTD_GROUPED, grouped
    return best, (len(sample) if best == CODEC_RAW else int(best_len))


def encode(
    data: Buffer,
    digest: bytes,
    *,
    compress: bool = True,
    level: int = 1,
    elem_size: int = 0,
    choice: int | None = None,
) -> tuple[bytes, Buffer]:
    """Encode ``data`` as a frame; returns (header, payload) so raw data is never copied.

    zstd is used only when a sample shows it pays; with ``elem_size`` (2, 4 or
    8 for float tensors) zstd over byte-grouped elements is tried too and the
    smaller wins. Incompressible data is stored raw. ``choice``: the codec
    :func:`choose_codec` gave for the same arguments (its sample is not tried again).
    """
    raw_len = len(data)
    codec, payload, elem = CODEC_RAW, data, 0
    if compress and raw_len >= 64:
        best = choice if choice is not None else choose_codec(data, level, elem_size)[0]
        if best == CODEC_ZSTD:
            packed = _frame.compressor(level).compress(data)
        elif best == CODEC_ZSTD_GROUPED:
            packed = _compress_grouped(level, data, elem_size)
            elem = elem_size
        if best != CODEC_RAW and len(packed) < raw_len:
            codec, payload = best, packed
        else:
            elem = 0
    header = HEADER.pack(MAGIC, FRAME_VERSION, codec, elem, raw_len, len(payload), digest)
    return header, payload


def may_pay(chunks: Sequence[Buffer], elem_size: int = 0, level: int = 1) -> bool:
    """Whether zstd may pay for any of ``chunks``, small chunks of one element size.

    :func:`encode` tries zstd up to five times per chunk, which for a chunk of
    a few hundred bytes costs more than hashing and packing it. Small chunks
    are judged together instead: chunks spread over the list, concatenated
    into one sample, are tried as :func:`encode` tries one chunk's sample. If
    even they do not shrink to ``_WORTH_IT`` (concatenated, chunks share
    zstd's overhead and tables, so they shrink more than alone), every one is
    stored raw; otherwise each is tried on its own. What a mixed list loses is
    bounded as for one chunk judged by its sample: at most the fifth a sample
    just above ``_WORTH_IT`` would have saved.
    """
    total = sum(len(c) for c in chunks)
    if total == 0:
        return False
    step = -(-total // _SAMPLE)  # every step-th chunk: about _SAMPLE bytes, spread out
    picked = chunks[::step]
    sample = memoryview(b"".join(picked))[:_SAMPLE]
    whole = elem_size in GROUPABLE and all(len(c) % elem_size == 0 for c in picked)
    return _trial(level, sample, elem_size if whole else 0)[0] != CODEC_RAW


def choose_codec(data: Buffer, level: int = 1, elem_size: int = 0) -> tuple[int, int]:
    """The codec :func:`encode` (compressing) picks for ``data``, by trying a sample, and
    the bytes it stores for that sample with it (the sample's length when raw)."""
    sample = memoryview(data)[:_SAMPLE]
    if len(data) < 64:
        return CODEC_RAW, len(sample)
    group = elem_size in GROUPABLE and len(data) % elem_size == 0
    return _trial(level, sample, elem_size if group else 0)


def decode(
    frame: Buffer,
    name: str,
    expected_digest: bytes,
    expected_size: int,
    base: tuple[bytes, Buffer] | None = None,
    *,
    check_digest: bool = True,
) -> Buffer:
    """Decode one frame and verify it is the chunk the caller asked for.

    Raises IntegrityError naming ``name`` on any mismatch: header fields, the
    declared size, truncation, the decompressed size, or the blake3 digest.
    A delta frame needs ``base``: the (digest, verified bytes) of the base
    chunk the manifest names; a delta frame without it is refused
    (:class:`DeltaBaseError`). ``check_digest=False`` leaves the final
    digest check to a caller that checks a result built from these bytes.
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
    if hdr.codec == CODEC_DELTA:  # a whole frame where a delta was expected is fine
        data: Buffer = undelta(hdr, payload, name, base)
    elif hdr.codec in (CODEC_ZSTD, CODEC_ZSTD_GROUPED):
        data = _frame.decompress(payload, hdr.raw_length, name)
        if hdr.codec == CODEC_ZSTD_GROUPED:
            data = ungroup_bytes(data, hdr.elem_size)
    else:
        data = payload
    if check_digest and digest_of(data) != expected_digest:
        raise IntegrityError(f"{name}: blake3 digest mismatch (stored bytes are corrupt)", name)
    return data
