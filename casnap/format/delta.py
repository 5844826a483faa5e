"""The delta frame's payload: a chunk as the runs where it differs from its base.

A delta frame (codec 3, :mod:`casnap.format.frame`) holds the 32-byte digest
of its base chunk (same raw length), then the zstd-compressed delta body
(:func:`delta_body`): the runs of :data:`DELTA_BLOCK`-byte blocks where the
chunk differs from the base, and their XOR with it, byte-grouped by the
frame's group width. Decoding it needs the base's verified bytes
(:func:`undelta`, which :func:`casnap.format.codec.decode` calls for a delta
frame given ``base``). The base is always a whole frame, never another
delta (:class:`casnap.format.entries.ChunkRef` refuses chains). Whether a
chunk is stored as a delta is decided by :mod:`casnap.chunks.delta`; a read
rebuilds it by :mod:`casnap.chunks.rebuild`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from casnap.errors import DeltaBaseError, IntegrityError
from casnap.format import frame
from casnap.format.frame import (
    CODEC_DELTA,
    DELTA_GROUPS,
    DIGEST_SIZE,
    FRAME_VERSION,
    HEADER,
    MAGIC,
    Buffer,
    FrameHeader,
)

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
    return encode_body(delta_body(data, base, group), len(data), digest, base_digest, group, level)


def encode_body(
    body: bytes, size: int, digest: bytes, base_digest: bytes, group: int, level: int = 1
) -> tuple[bytes, bytes]:
    """The delta frame (header, payload) of a chunk of ``size`` bytes whose
    :func:`delta_body` against its base is ``body``."""
    payload = base_digest + frame.compressor(level).compress(body)
    header = HEADER.pack(MAGIC, FRAME_VERSION, CODEC_DELTA, group, size, len(payload), digest)
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
    body = frame.decompress(mv[DIGEST_SIZE:], most, name, exact=False)
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
    """:func:`casnap.format.codec.ungroup_bytes` of a numpy array: one strided write
    per byte position is three times faster than numpy's copy of the transpose."""
    np = _np()
    planes = grouped.reshape(group, -1)
    out = np.empty((planes.shape[1], group), np.uint8)
    for i in range(group):
        out[:, i] = planes[i]
    return out.reshape(-1)


_FEW_RUNS = 32  # runs XORed one by one (see DeltaRuns.xor_into)


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

    def xor_into(self, out: bytearray | memoryview) -> None:
        """XOR the runs into ``out`` (the base's bytes, in place)."""
        np = _np()
        dst = np.frombuffer(out, np.uint8)
        # A few long runs (changed rows of a table): one XOR each costs less than the
        # block arrays below; many short ones (a fine-tuned layer): one gathered XOR.
        blocks = self.blocks() if len(self.starts) > _FEW_RUNS else None
        if blocks is None:
            pos = 0
            for a, length in zip(self.starts.tolist(), self.lengths.tolist(), strict=True):
                dst[a : a + length] ^= self.kept[pos : pos + length]
                pos += length
            return
        full = len(dst) // DELTA_BLOCK
        rows = self.kept_blocks()
        inside = len(blocks) if not len(blocks) or blocks[-1] < full else len(blocks) - 1
        if inside:
            grid = dst[: full * DELTA_BLOCK].reshape(-1, DELTA_BLOCK)
            grid[blocks[:inside]] ^= rows[:inside]
        if inside < len(blocks):  # the chunk's ragged last block
            tail = dst[full * DELTA_BLOCK :]
            tail ^= rows[-1][: len(tail)]

    def kept_blocks(self) -> Any:
        """``kept`` as rows of DELTA_BLOCK bytes, zero-padded after a ragged last run."""
        np = _np()
        kept = self.kept
        pad = -len(kept) % DELTA_BLOCK
        if pad:
            kept = np.concatenate((kept, np.zeros(pad, np.uint8)))
        return kept.reshape(-1, DELTA_BLOCK)


def apply_delta(
    hdr: FrameHeader, payload: Buffer, name: str, base_digest: bytes, out: bytearray | memoryview
) -> None:
    """XOR the runs of delta frame ``payload`` into ``out`` (the base's bytes, in place);
    checked as :func:`delta_runs` says."""
    delta_runs(hdr, payload, name, base_digest).xor_into(out)


def delta_sample_size(data: Buffer, base: Buffer, group: int, level: int = 1) -> int:
    """What a delta of the sample ``data`` against ``base`` compresses to (an estimate)."""
    n = min(len(data), len(base))
    n -= n % group
    body = delta_body(memoryview(data)[:n], memoryview(base)[:n], group)
    return len(frame.compressor(level).compress(body))


def undelta(
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
