"""What a manifest reaches: the one definition gc's mark, reclaim and copy share.

A snapshot is readable when its manifest and every store object its chunk
references point into exist: loose chunks ``chunks/<h>`` and packs
``packs/<p>``, and for a delta chunk every base of its chain (the manifest
records them: :meth:`Manifest.stored_refs`). Parents are lineage only (a
reader never needs them), so they are not reached. A format change that makes
a chunk need other objects changes :func:`object_refs` and every user follows:
gc keeps those objects, reclaim counts them, copy sends them.

Example::

    for key, ref in object_refs(repo.read_manifest(m)):
        print(key, ref.hash)
"""

from __future__ import annotations

from collections.abc import Iterator

from casnap.format.entries import ChunkRef
from casnap.format.manifest import Manifest
from casnap.repo.repository import chunk_key, pack_key


def object_key(ref: ChunkRef) -> str:
    """The key of the store object holding ``ref``'s frame (a pack or a loose chunk)."""
    return pack_key(ref.pack) if ref.pack else chunk_key(ref.hash)


def object_refs(manifest: Manifest) -> Iterator[tuple[str, ChunkRef]]:
    """Each stored frame ``manifest`` needs (chunks and delta bases) with the key of
    the object holding it.

    An object holding several referenced frames (a pack) comes once per frame.
    """
    for ref in manifest.stored_refs():
        yield object_key(ref), ref


def reached_objects(manifest: Manifest) -> dict[str, list[ChunkRef]]:
    """The objects ``manifest`` reaches, each with the chunk references read from it."""
    out: dict[str, list[ChunkRef]] = {}
    for key, ref in object_refs(manifest):
        out.setdefault(key, []).append(ref)
    return out
