"""Delta chunks: whether a changed chunk pays as a delta against its parent's whole, and the frame.

A take hands the :class:`~casnap.chunks.write.ChunkWriter` each new chunk
together with a *base*: the whole frame a read of the chunk at the same
index of the same tensor in the parent snapshot decodes (that chunk, or its
own base if it is a delta: :attr:`ChunkRef.whole`). Every delta is against a
whole chunk, so a read decodes one whole frame and one delta; a chunk that
keeps drifting from that whole makes a growing delta, until it no longer
pays and the chunk is written whole, the base of the deltas after it.
:meth:`DeltaEncoder.encode` decides, per chunk, by the test and back-off
docs/chunking.md ("Delta chunks") lists, each step costing a small fraction
of writing the chunk; the frame is docs/format.md's.

The margins keep deltas from costing a take time on a local disk, where a
byte written costs about as little as a byte compressed: when the plain codec
stores the chunk raw (fp32 weights), a delta must shrink the chunk to a
quarter, which sparse updates do (1% of rows changed: about 0.01) and a
dense update does not (every fp32 weight scaled: 0.53), so an update of all
parameters is written exactly as without deltas; when the plain codec
compresses anyway (bf16 weights, about 0.68), the delta costs one more read
and must save 15% of the plain frame. On a remote store, where bytes cost
more than CPU, any delta that saves 10% is taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from casnap.chunks.decode import base_bytes
from casnap.errors import CasnapError
from casnap.format import codec
from casnap.format.delta import changed_share, delta_body, delta_sample_size, encode_body
from casnap.format.entries import ChunkRef
from casnap.repo.repository import RepoStorage, chunk_key, pack_key

Buffer = codec.Buffer
SAMPLE = 64 * 1024
# A delta's stored size over the plain codec's, at most (see the module docstring).
LOCAL_OVER_RAW = 0.25
LOCAL_OVER_COMPRESSED = 0.85
REMOTE_OVER_PLAIN = 0.90
# A sample whose changed share exceeds the margin this many times over is not tried.
DENSE_SLACK = 1.5
# A delta is decoded on every read of its chunk. Where the plain codec stores the chunk
# raw on a local disk, a read is a mapping and a digest pass, and decoding a delta adds
# about 7% of that per 1% of the chunk in its body (the changed blocks): a body of at
# most a sixteenth of the chunk keeps a read within about 1.5x a whole chunk's. A chunk
# drifted further from its base is written whole, the base of the deltas after it; a
# sparse series (1% of rows a step) then writes one whole chunk every seventh snapshot
# or so, about the bytes of the chains it replaced (benchmarks/delta.py, series).
LOCAL_MOST_BODY = 1 / 16
# After this many chunks of a tensor in a row that did not pay, one in this many is tested.
BACK_OFF = 4


@dataclass
class DeltaChoice:
    """What :meth:`DeltaEncoder.encode` decided: the delta frame (header, payload), or
    None (write the chunk whole, with ``plain``: the codec the sample chose, if known)."""

    frame: tuple[bytes, bytes] | None = None
    plain: int | None = None


class DeltaEncoder:
    """Encodes a chunk as a delta against its base when that pays; one per take."""

    def __init__(self, repo: RepoStorage, level: int = 1) -> None:
        self.repo = repo
        self.level = level
        self.local = bool(repo.root.capabilities.local)
        self._lock = threading.Lock()
        self._misses: dict[str, int] = {}  # by tensor: chunks in a row that did not pay
        self._skipped: dict[str, int] = {}  # by tensor: chunks not tested since the last test

    def encode(
        self, data: Buffer, digest: bytes, elem_size: int, base: ChunkRef, tensor: str = ""
    ) -> DeltaChoice:
        """The delta frame of ``data`` against ``base`` (a whole chunk) if it pays; else the
        plain codec.

        ``tensor`` names the tensor the chunk belongs to (see BACK_OFF).

        Never raises for a base it cannot read: a delta is an optimisation,
        and the chunk is then written whole.
        """
        size = len(data)
        if base.size != size or base.base is not None or not self._try(tensor):
            return DeltaChoice()
        sample = memoryview(data)[:SAMPLE]
        plain_codec, plain = codec.choose_codec(data, self.level, elem_size)
        whole_plain = DeltaChoice(plain=plain_codec)
        ratio = self._ratio(plain, len(sample))
        drift = self.local and plain >= len(sample)  # stored raw: LOCAL_MOST_BODY bounds it
        group = elem_size if elem_size in codec.GROUPABLE and size % elem_size == 0 else 1
        user = chunk_key(digest.hex())
        try:
            whole: Buffer | None = None
            sample_base: Buffer | None = self._sample_of_raw(base)
            if sample_base is None:
                whole = base_bytes(self.repo, base, user)
                sample_base = memoryview(whole)[:SAMPLE]
            if len(sample_base) != len(sample):
                return self._missed(tensor, whole_plain)  # a base shorter than it says: whole
            changed = changed_share(sample, sample_base) * len(sample)
            if changed > plain * ratio * DENSE_SLACK:
                return self._missed(tensor, whole_plain)  # a dense change: no delta can pay
            delta = delta_sample_size(sample, sample_base, group, self.level)
            if delta > plain * ratio:
                return self._missed(tensor, whole_plain)
            if whole is None:
                whole = base_bytes(self.repo, base, user)
        except CasnapError:
            return whole_plain  # the base is missing or damaged: write the chunk whole
        body = delta_body(data, whole, group)
        if drift and len(body) > size * LOCAL_MOST_BODY:
            return whole_plain  # drifted too far from its base; not dense: no back-off
        head, payload = encode_body(body, size, digest, bytes.fromhex(base.hash), group, self.level)
        expected_plain = plain / len(sample) * size
        if len(payload) > min(expected_plain * ratio, size):
            return self._missed(tensor, whole_plain)
        with self._lock:
            self._misses.pop(tensor, None)
        return DeltaChoice(frame=(head, payload))

    def _try(self, tensor: str) -> bool:
        """Whether to test a chunk of ``tensor``: yes, unless BACK_OFF of its chunks in a
        row did not pay; then one in BACK_OFF."""
        with self._lock:
            if self._misses.get(tensor, 0) < BACK_OFF:
                return True
            skipped = self._skipped[tensor] = self._skipped.get(tensor, 0) + 1
            if skipped < BACK_OFF:
                return False
            self._skipped[tensor] = 0
            return True

    def _missed(self, tensor: str, choice: DeltaChoice) -> DeltaChoice:
        with self._lock:
            self._misses[tensor] = self._misses.get(tensor, 0) + 1
        return choice

    def _ratio(self, plain: int, sample: int) -> float:
        if not self.local:
            return REMOTE_OVER_PLAIN
        return LOCAL_OVER_RAW if plain >= sample else LOCAL_OVER_COMPRESSED

    def _sample_of_raw(self, base: ChunkRef) -> bytes | None:
        """The first bytes of a base stored whole and raw, by one ranged read; else None.

        Unverified: it only sizes the estimate. The delta itself is built on
        the verified whole base.
        """
        if base.length != codec.HEADER_SIZE + base.size:
            return None
        if base.pack is None:
            key, start = chunk_key(base.hash), codec.HEADER_SIZE
        else:
            key, start = pack_key(base.pack), base.offset + codec.HEADER_SIZE
        return self.repo.store.get_range(key, start, start + min(SAMPLE, base.size))
