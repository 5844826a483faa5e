"""Whether the index knows every chunk of a manifest: what lets a take skip reading its parent.

A take without a session descends from a parent read from the store
(:mod:`casnap.take.parent`); reading and validating a manifest of 20,000
entries costs more than the whole take of an unchanged state. The index
already knows where the chunks are, but not, by itself, whether it knows
*all* of a manifest's: a gc empties the chunk entries, and a manifest
written on another machine was never seen. So each take that commits with a
usable index records one more fact, "every whole frame of manifest M is in
the chunk entries", once they are:

- a **cover entry** lives among the chunk entries, under a digest no chunk
  has (blake3 of a fixed prefix and M's hash, raw size 0), so it is dropped
  with them whenever a gc changes the epoch (docs/index.md) and recorded
  only under the epoch the take checked;
- a take's parent that is covered is not read up front: its chunks are found
  in the index, and its manifest is read only if a chunk the index does not
  know might be the parent's (a large one: a delta frame, which the index
  never holds, or a changed chunk that needs its delta base).

Delta frames are never cover-relevant: the index leaves them out (their
base is not in an entry), and a take finds them by reading the parent.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3

from casnap.format.codec import HEADER_SIZE
from casnap.format.entries import ChunkRef
from casnap.format.manifest_bytes import trusted_chunk_ref
from casnap.index.lmdb_store import RepoIndex

_PREFIX = b"casnap index cover of manifest "


def _cover_hash(manifest_hash: str) -> str:
    return blake3.blake3(_PREFIX + bytes.fromhex(manifest_hash)).hexdigest()


def covers(index: RepoIndex | None, manifest_hash: str) -> bool:
    """Whether ``index`` (opened for chunks) knows every whole frame of ``manifest_hash``."""
    if index is None:
        return False
    return index.lookup_chunk(_cover_hash(manifest_hash), 0) is not None


def record_cover(index: RepoIndex | None, manifest_hash: str, refs: Iterable[ChunkRef]) -> None:
    """Record ``refs`` (each known to exist, under the epoch ``index`` checked) and that
    they are every chunk of ``manifest_hash``; refused with them after a gc, like every
    chunk entry. Delta frames are left out (docs/index.md)."""
    if index is None:
        return
    marker = trusted_chunk_ref(_cover_hash(manifest_hash), 0, None, 0, HEADER_SIZE)
    index.record_chunks([*(r for r in refs if r.base is None), marker])
