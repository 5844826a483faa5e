"""``SnapshotView``: one snapshot as :meth:`casnap.Repository.show` returns it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from casnap.format.entries import Entry
from casnap.format.manifest import Manifest
from casnap.format.tree import entries_under


@dataclass(frozen=True)
class SnapshotView:
    """One snapshot as :meth:`Repository.show` sees it: its manifest's header and entries."""

    name: str
    manifest: str  # the manifest hash the ref named when read
    created_at: str
    world_size: int
    metadata: dict[str, Any]
    parents: tuple[str, ...]  # parent manifest hashes
    entries: dict[str, Entry]  # key -> entry, in manifest order (containers included)

    @classmethod
    def of(cls, name: str, mhash: str, m: Manifest, key: str | None) -> SnapshotView:
        """The view of manifest ``m`` (hash ``mhash``) of snapshot ``name``, only ``key``
        and below if given (:class:`casnap.errors.MissingKeyError`, naming the nearest
        keys, if nothing is there)."""
        entries = entries_under(m.entries, key)
        return cls(
            name, mhash, m.created_at, m.world_size, dict(m.metadata), tuple(m.parents), entries
        )
