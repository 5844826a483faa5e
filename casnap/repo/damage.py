"""Damage records: which stored copies of chunks a read found damaged (docs/damage.md).

A read whose frame fails its check records the damaged copy at
``.casnap/damaged/<chunk hash>/<pack id>`` (a frame inside a pack) or
``.casnap/damaged/<chunk hash>/chunk`` (the loose object); the key alone names
it, so a take learns every record with one listing and stops trusting those
copies. Recording is always safe, even when wrong, and deletes nothing; where
it cannot write (a read-only mount) the damage is logged and the read carries on.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from casnap.errors import CasnapError
from casnap.format.entries import ChunkRef
from casnap.format.json_text import canonical_json
from casnap.format.records import DamageRecord
from casnap.repo.repository import RepoStorage, now_iso

DAMAGED = "damaged"
LOOSE = "chunk"  # the last key segment of a loose object's record

_log = logging.getLogger("casnap.damage")
_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class DamagedCopy:
    """One damaged copy of a chunk: the loose object (``pack`` None) or a frame in ``pack``."""

    chunk: str
    pack: str | None

    @property
    def key(self) -> str:
        return f"{DAMAGED}/{self.chunk}/{self.pack or LOOSE}"

    @classmethod
    def of(cls, ref: ChunkRef) -> DamagedCopy:
        return cls(ref.hash, ref.pack)

    def order(self) -> tuple[str, str]:
        """A sort key: by chunk, the loose object's record first (``pack`` None
        cannot be compared with a pack id, and a chunk may have both records)."""
        return self.chunk, self.pack or ""


class DamageSet:
    """The damaged copies a take must not reference."""

    def __init__(self, copies: Iterable[DamagedCopy] = ()) -> None:
        self._copies = frozenset(copies)
        self.chunks = frozenset(c.chunk for c in self._copies)
        self.packs = frozenset(c.pack for c in self._copies if c.pack is not None)

    def __contains__(self, item: object) -> bool:
        """Whether ``item`` names a damaged copy: a :class:`DamagedCopy`, or a
        :class:`ChunkRef` any link of whose delta chain is one (a delta rebuilt on a
        damaged base cannot be read, however sound its own frame)."""
        if isinstance(item, ChunkRef):
            ref: ChunkRef | None = item
            while ref is not None:
                if ref.hash in self.chunks and DamagedCopy.of(ref) in self._copies:
                    return True
                ref = ref.base  # the common case: one set lookup per link
            return False
        return item in self._copies

    def __bool__(self) -> bool:
        return bool(self._copies)

    def __len__(self) -> int:
        return len(self._copies)

    def in_pack(self, pack: str) -> list[DamagedCopy]:
        """The recorded damaged frames of pack ``pack``."""
        return sorted((c for c in self._copies if c.pack == pack), key=DamagedCopy.order)


def list_damage(repo: RepoStorage) -> list[DamagedCopy]:
    """Every recorded damaged copy (one listing; keys casnap did not write are ignored)."""
    out = []
    for key in repo.store.list(DAMAGED):
        parts = key.split("/")
        if len(parts) != 3 or not _HASH.match(parts[1]):
            continue
        where = parts[2]
        if where == LOOSE:
            out.append(DamagedCopy(parts[1], None))
        elif _HASH.match(where):
            out.append(DamagedCopy(parts[1], where))
    return sorted(out, key=DamagedCopy.order)


def damage_set(repo: RepoStorage) -> DamageSet:
    """What a take consults: :func:`list_damage` as a set; empty if the store cannot list."""
    try:
        return DamageSet(list_damage(repo))
    except CasnapError as exc:
        _log.warning("cannot list damage records of %s (%s); trusting every copy", repo.url, exc)
        return DamageSet()


def record_damage(repo: RepoStorage, ref: ChunkRef, detail: str) -> bool:
    """Record that the copy of ``ref`` is damaged; False (with a warning) if it cannot be written.

    Idempotent: a second record of the same copy replaces the first.
    """
    copy = DamagedCopy.of(ref)
    body = DamageRecord(chunk=ref.hash, pack=ref.pack, detected_at=now_iso(), detail=detail)
    try:
        repo.store.put(copy.key, canonical_json(body.model_dump(mode="json")))
    except CasnapError as exc:
        _log.warning(
            "chunk %s in %s is damaged, but casnap could not record it (%s); takes on other "
            "machines may still reference it: run `casnap verify --read-data` with write access",
            ref.hash,
            ref.pack or "its loose object",
            exc,
        )
        return False
    _log.warning(
        "chunk %s in %s is damaged; recorded in %s: the next take writes it again",
        ref.hash,
        ref.pack or "its loose object",
        copy.key,
    )
    return True


def clear_damage(repo: RepoStorage, copies: Iterable[DamagedCopy]) -> int:
    """Delete the records of ``copies`` (rewritten, or gone with their object); returns how many."""
    cleared = 0
    for copy in copies:
        try:
            repo.store.delete(copy.key)
            cleared += 1
        except CasnapError as exc:
            _log.warning("cannot delete damage record %s (%s)", copy.key, exc)
    return cleared
