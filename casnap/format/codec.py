"""Chunk frames: the self-describing encoding of one chunk in the store.

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
changes a chunk's name. A delta frame's payload starts with the 32-byte
digest of its base chunk (same raw length); the rest is the zstd-compressed,
byte-grouped XOR of the chunk with that base, so decoding it needs the
base's verified bytes (:func:`decode` with ``base``). Decoding checks every
field before allocating and verifies the digest before returning.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zstandard

from casnap.errors import DeltaBaseError, IntegrityError
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


def _trial(cctx: zstandard.ZstdCompressor, sample: Buffer, elem_size: int) -> tuple[int, int]:
    """The codec that shrinks ``sample`` most, if to ``_WORTH_IT`` or less, else raw,
    and the bytes that codec stores for the sample (its length when raw).

    With ``elem_size`` in :data:`GROUPABLE` (``sample`` a whole number of
    elements) zstd over byte-grouped elements is tried too.
    """
    best, best_len = CODEC_RAW, len(sample) * _WORTH_IT
    plain = len(cctx.compress(sample))
    if plain < best_len:
        best, best_len = CODEC_ZSTD, plain
    if elem_size in GROUPABLE:
        # Estimate each byte position on its own: in a whole chunk the groups
        # fill separate zstd blocks, each with its own entropy tables.
        raw_sample = bytes(sample[: len(sample) - len(sample) % elem_size])
        grouped = sum(len(cctx.compress(raw_sample[i::elem_size])) for i in range(elem_size))
        if grouped < best_len:
            best, best_len = CODEC_ZSTD_GROUPED, grouped
    return best, (len(sample) if best == CODEC_RAW else int(best_len))


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: one per call costs more than a delta's small body."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


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
        cctx = _compressor(level)
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
    return _trial(_compressor(level), sample, elem_size if whole else 0)[0] != CODEC_RAW


def choose_codec(data: Buffer, level: int = 1, elem_size: int = 0) -> tuple[int, int]:
    """The codec :func:`encode` (compressing) picks for ``data``, by trying a sample, and
    the bytes it stores for that sample with it (the sample's length when raw)."""
    sample = memoryview(data)[:_SAMPLE]
    if len(data) < 64:
        return CODEC_RAW, len(sample)
    group = elem_size in GROUPABLE and len(data) % elem_size == 0
    return _trial(_compressor(level), sample, elem_size if group else 0)


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
        data: Buffer = _undelta(hdr, payload, name, base)
    elif hdr.codec in (CODEC_ZSTD, CODEC_ZSTD_GROUPED):
        data = _decompress(payload, hdr.raw_length, name)
        if hdr.codec == CODEC_ZSTD_GROUPED:
            data = ungroup_bytes(data, hdr.elem_size)
    else:
        data = payload
    if check_digest and digest_of(data) != expected_digest:
        raise IntegrityError(f"{name}: blake3 digest mismatch (stored bytes are corrupt)", name)
    return data


def _undelta(
    hdr: FrameHeader, payload: memoryview, name: str, base: tuple[bytes, Buffer] | None
) -> Buffer:
    """The chunk a delta frame rebuilds from its verified base (digest checked by the caller)."""
    if base is None:
        recorded = bytes(payload[:DIGEST_SIZE]).hex()
        raise DeltaBaseError(
            f"{name}: a delta frame (base {recorded}) read without "
            "its base; the manifest does not name one",
            name,
        )
    base_digest, base_bytes = base
    if len(base_bytes) != hdr.raw_length:
        raise IntegrityError(
            f"{name}: delta base holds {len(base_bytes)} bytes, the frame {hdr.raw_length}", name
        )
    out = bytearray(base_bytes)
    apply_delta(hdr, payload, name, base_digest, out)
    return out


# A delta stores only the runs of 256-byte blocks where the chunk differs from its
# base: a sparse update (1% of an embedding's rows) is then decoded in time
# proportional to what changed, not to the chunk. 256 is a multiple of every
# group width, so grouping never splits an element.
DELTA_BLOCK = 256
_RUNS = struct.Struct("<I")
_RUN = struct.Struct("<II")


def _np() -> Any:
    import numpy as np  # noqa: PLC0415 (torch brings it; only deltas need it)

    return np


def xor_bytes(a: Buffer, b: Buffer) -> bytearray:
    """``a`` XOR ``b`` (equal lengths)."""
    np = _np()
    out = bytearray(len(a))
    np.bitwise_xor(
        np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8), out=np.frombuffer(out, np.uint8)
    )
    return out


def changed_share(data: Buffer, base: Buffer) -> float:
    """The share of the bytes of ``data`` that differ from ``base`` (same length, not empty):
    one pass, no compression. The XOR of two versions of float weights compresses to
    about this share of their size (fp32 scaled by 1.001: 0.55 changed, 0.57
    compressed; bf16 fine-tuned: 0.25 and 0.24)."""
    np = _np()
    diff = np.frombuffer(data, np.uint8) != np.frombuffer(base, np.uint8)
    return int(np.count_nonzero(diff)) / len(diff)


def _runs_of(diff: Any) -> list[tuple[int, int]]:
    """(start, length) of the runs of non-zero DELTA_BLOCK-byte blocks of ``diff``."""
    np = _np()
    n = len(diff)
    full = n // DELTA_BLOCK * DELTA_BLOCK
    mask = diff[:full].reshape(-1, DELTA_BLOCK).any(axis=1)
    if full < n:
        mask = np.append(mask, bool(diff[full:].any()))
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return [
        (int(a) * DELTA_BLOCK, min(int(b) * DELTA_BLOCK, n) - int(a) * DELTA_BLOCK)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


def delta_body(data: Buffer, base: Buffer, group: int) -> bytes:
    """What a delta frame compresses: the runs that differ, then their XOR, byte-grouped.

    ``u32 count``, ``count`` x ``(u32 start, u32 length)``, then the XOR of
    those runs concatenated and grouped by ``group`` bytes (the element size of
    floats: exponent bytes barely change between two versions of a weight).
    """
    np = _np()
    diff = np.bitwise_xor(np.frombuffer(data, np.uint8), np.frombuffer(base, np.uint8))
    runs = _runs_of(diff)
    kept = np.concatenate([diff[a : a + n] for a, n in runs]) if runs else diff[:0]
    if group > 1 and len(kept):
        kept = kept.reshape(-1, group).T
    head = _RUNS.pack(len(runs)) + b"".join(_RUN.pack(a, n) for a, n in runs)
    body: bytes = kept.tobytes()
    return head + body


def encode_delta(
    data: Buffer,
    digest: bytes,
    base: Buffer,
    base_digest: bytes,
    *,
    group: int,
    level: int = 1,
) -> tuple[bytes, bytes]:
    """``data`` as a delta frame against ``base`` (same length): header and payload.

    The payload is ``base_digest`` then zstd of :func:`delta_body`. The caller
    decides whether it pays (:mod:`casnap.chunks.delta`).
    """
    if len(base) != len(data) or group not in DELTA_GROUPS or len(data) % group:
        raise ValueError("a delta needs a base of the same length and a group width dividing it")
    body = delta_body(data, base, group)
    payload = base_digest + _compressor(level).compress(body)
    header = HEADER.pack(MAGIC, FRAME_VERSION, CODEC_DELTA, group, len(data), len(payload), digest)
    return header, payload


def delta_runs(hdr: FrameHeader, payload: Buffer, name: str, base_digest: bytes) -> DeltaRuns:
    """The runs of delta frame ``payload`` and their XOR bytes, checked.

    Checks that the frame is against ``base_digest`` and that every run lies
    inside the chunk, in order, with as many bytes as the body holds; the
    caller verifies the digest of what the runs rebuild.
    """
    mv = memoryview(payload)
    recorded = bytes(mv[:DIGEST_SIZE])
    if recorded != base_digest:  # the frame's own bytes disagree with its manifest: damage
        raise IntegrityError(
            f"{name}: delta frame is against base {recorded.hex()}, the "
            f"manifest names {base_digest.hex()}",
            name,
        )
    n, group = hdr.raw_length, hdr.elem_size
    most = _RUNS.size + _RUN.size * (n // DELTA_BLOCK + 1) + n
    body = _decompress(mv[DIGEST_SIZE:], most, name, exact=False)
    if len(body) < _RUNS.size:
        raise IntegrityError(f"{name}: truncated delta body", name)
    (count,) = _RUNS.unpack_from(body, 0)
    start = _RUNS.size + _RUN.size * count
    if count > n // DELTA_BLOCK + 1 or start > len(body):
        raise IntegrityError(f"{name}: delta body declares {count} runs", name)
    np = _np()
    # Vectorised: a chunk holds hundreds of runs, and a Python loop over them would cost
    # more than the XOR itself (restoring the newest of a series, benchmarks/delta.py).
    table = np.frombuffer(body, "<u4", 2 * count, _RUNS.size).astype(np.int64).reshape(-1, 2)
    starts, lengths = table[:, 0], table[:, 1]
    ends = starts + lengths
    if count and (
        bool((lengths == 0).any())
        or bool((lengths % group).any())
        or int(ends[-1]) > n
        or bool((starts[1:] < ends[:-1]).any())
    ):
        raise IntegrityError(f"{name}: delta runs out of order or bounds", name)
    kept = np.frombuffer(body, np.uint8, offset=start)
    if len(kept) != int(lengths.sum()):
        raise IntegrityError(f"{name}: delta body holds {len(kept)} bytes, its runs more", name)
    if group > 1 and len(kept):
        kept = _ungroup(kept, group)
    return DeltaRuns(n, starts, lengths, kept)


def _ungroup(grouped: Any, group: int) -> Any:
    """:func:`ungroup_bytes` of a numpy array: one strided write per byte position is
    three times faster than numpy's copy of the transpose."""
    np = _np()
    planes = grouped.reshape(group, -1)
    out = np.empty((planes.shape[1], group), np.uint8)
    for i in range(group):
        out[:, i] = planes[i]
    return out.reshape(-1)


@dataclass(frozen=True)
class DeltaRuns:
    """The checked runs of one delta frame: ``starts[i]``, ``lengths[i]`` (numpy int64
    arrays, in order, disjoint) and ``kept``, their XOR bytes one after another."""

    size: int  # the chunk's raw length
    starts: Any
    lengths: Any
    kept: Any

    def blocks(self) -> Any | None:
        """The DELTA_BLOCK-sized blocks the runs cover, in order (numpy int64), if every run
        starts on a block and only a run ending the chunk ends off one (what a writer of
        :func:`delta_body` makes); else None. ``kept`` is then :meth:`kept_blocks`."""
        np = _np()
        starts, lengths = self.starts, self.lengths
        if not len(starts):
            return np.zeros(0, np.int64)
        ragged = (lengths % DELTA_BLOCK) != 0
        if bool((starts % DELTA_BLOCK).any()) or bool((ragged[:-1]).any()):
            return None
        if bool(ragged[-1]) and int(starts[-1] + lengths[-1]) != self.size:
            return None
        count = (lengths + DELTA_BLOCK - 1) // DELTA_BLOCK
        before = np.cumsum(count) - count  # blocks of the runs before each one
        first = starts // DELTA_BLOCK
        return np.arange(int(count.sum()), dtype=np.int64) + np.repeat(first - before, count)

    def kept_blocks(self) -> Any:
        """``kept`` as rows of DELTA_BLOCK bytes, zero-padded after a ragged last run."""
        np = _np()
        kept = self.kept
        pad = -len(kept) % DELTA_BLOCK
        if pad:
            kept = np.concatenate((kept, np.zeros(pad, np.uint8)))
        return kept.reshape(-1, DELTA_BLOCK)


_FEW_RUNS = 32  # runs XORed one by one (see apply_delta)


def apply_delta(
    hdr: FrameHeader, payload: Buffer, name: str, base_digest: bytes, out: bytearray | memoryview
) -> None:
    """XOR the runs of delta frame ``payload`` into ``out`` (the base's bytes, in place);
    checked as :func:`delta_runs` says."""
    runs = delta_runs(hdr, payload, name, base_digest)
    np = _np()
    dst = np.frombuffer(out, np.uint8)
    # A few long runs (changed rows of a table): one XOR each costs less than the
    # block arrays below; many short ones (a fine-tuned layer): one gathered XOR.
    blocks = runs.blocks() if len(runs.starts) > _FEW_RUNS else None
    if blocks is None:
        pos = 0
        for a, length in zip(runs.starts.tolist(), runs.lengths.tolist(), strict=True):
            dst[a : a + length] ^= runs.kept[pos : pos + length]
            pos += length
        return
    full = len(dst) // DELTA_BLOCK
    rows = runs.kept_blocks()
    inside = len(blocks) if not len(blocks) or blocks[-1] < full else len(blocks) - 1
    if inside:
        grid = dst[: full * DELTA_BLOCK].reshape(-1, DELTA_BLOCK)
        grid[blocks[:inside]] ^= rows[:inside]
    if inside < len(blocks):  # the chunk's ragged last block
        tail = dst[full * DELTA_BLOCK :]
        tail ^= rows[-1][: len(tail)]


def delta_sample_size(data: Buffer, base: Buffer, group: int, level: int = 1) -> int:
    """What a delta of the sample ``data`` against ``base`` compresses to (an estimate)."""
    n = min(len(data), len(base))
    n -= n % group
    body = delta_body(memoryview(data)[:n], memoryview(base)[:n], group)
    return len(_compressor(level).compress(body))


def _decompress(payload: Buffer, raw_length: int, name: str, *, exact: bool = True) -> bytes:
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
        data = _decompressor().decompress(payload, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{name}: corrupt zstd payload: {exc}", name) from exc
    if len(data) != raw_length and (exact or declared != -1):
        raise IntegrityError(f"{name}: decompressed to the wrong size", name)
    return data
