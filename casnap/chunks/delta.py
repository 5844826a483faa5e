"""Delta chunks: whether a changed chunk pays as a delta against its parent's, and the frame.

A take hands the :class:`~casnap.chunks.io.ChunkWriter` each new chunk
together with a *base*: the chunk at the same index of the same tensor in
the parent snapshot. :meth:`DeltaEncoder.encode` then decides, per chunk,
with a test that costs a small fraction of writing the chunk:

1. the base must be another chunk of the same size whose chain is shorter
   than ``delta_max_chain`` (so a read follows at most that many deltas);
2. on a 64 KiB sample, the XOR with the base, byte-grouped by the element
   size and zstd-compressed, must beat what the plain codec stores for the
   same sample by the margin below. The sample of a base stored raw and
   whole is one ranged read; any other base is read whole (it is needed for
   the delta anyway);
3. the whole delta frame must still be that much smaller than the plain
   frame the sample predicts.

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

from dataclasses import dataclass

from casnap.chunks.damage import base_bytes
from casnap.errors import CasnapError
from casnap.format import codec
from casnap.format.manifest import ChunkRef
from casnap.repo.repository import RepoStorage, chunk_key, pack_key

Buffer = codec.Buffer
SAMPLE = 64 * 1024
# A delta's stored size over the plain codec's, at most (see the module docstring).
LOCAL_OVER_RAW = 0.25
LOCAL_OVER_COMPRESSED = 0.85
REMOTE_OVER_PLAIN = 0.90


@dataclass(frozen=True)
class DeltaEncoder:
    """Encodes a chunk as a delta against its base when that pays; one per take."""

    repo: RepoStorage
    max_chain: int
    level: int = 1

    @property
    def local(self) -> bool:
        return bool(self.repo.root.capabilities.local)

    def encode(
        self, data: Buffer, digest: bytes, elem_size: int, base: ChunkRef
    ) -> tuple[bytes, bytes] | None:
        """The delta frame (header, payload) of ``data`` against ``base``, or None: write whole.

        Never raises for a base it cannot read: a delta is an optimisation,
        and the chunk is then written whole.
        """
        size = len(data)
        if base.size != size or base.depth + 1 > self.max_chain:
            return None
        group = elem_size if elem_size in codec.GROUPABLE and size % elem_size == 0 else 1
        user = chunk_key(digest.hex())
        try:
            whole: Buffer | None = None
            sample_base: Buffer | None = self._sample_of_raw(base)
            if sample_base is None:
                whole = base_bytes(self.repo, base, user)
                sample_base = memoryview(whole)[:SAMPLE]
            sample = memoryview(data)[:SAMPLE]
            plain = codec.plain_sample_size(sample, elem_size, self.level)
            delta = codec.delta_sample_size(sample, sample_base, group, self.level)
            ratio = self._ratio(plain, len(sample))
            if delta > plain * ratio:
                return None
            if whole is None:
                whole = base_bytes(self.repo, base, user)
        except CasnapError:
            return None  # the base is missing or damaged: write the chunk whole
        head, payload = codec.encode_delta(
            data, digest, whole, bytes.fromhex(base.hash), group=group, level=self.level
        )
        expected_plain = plain / len(sample) * size
        if len(payload) > min(expected_plain * ratio, size):
            return None
        return head, payload

    def _ratio(self, plain: int, sample: int) -> float:
        if not self.local:
            return REMOTE_OVER_PLAIN
        return LOCAL_OVER_RAW if plain >= sample else LOCAL_OVER_COMPRESSED

    def _sample_of_raw(self, base: ChunkRef) -> bytes | None:
        """The first bytes of a base stored whole and raw, by one ranged read; else None.

        Unverified: it only sizes the estimate. The delta itself is built on
        the verified whole base.
        """
        if base.base is not None or base.length != codec.HEADER_SIZE + base.size:
            return None
        if base.pack is None:
            key, start = chunk_key(base.hash), codec.HEADER_SIZE
        else:
            key, start = pack_key(base.pack), base.offset + codec.HEADER_SIZE
        return self.repo.store.get_range(key, start, start + min(SAMPLE, base.size))
