"""What a take reuses from its parent: one cache, keyed by the parent manifest's hash.

A take's parent (:mod:`casnap.take.parent`) is most often the manifest this
process committed last, and reading it back costs more than an unchanged
re-take itself (20,000 small tensors: parsing and validating the parent is
most of the time). :data:`REUSE` keeps, per repository id and manifest
hash, a manifest this process committed (through a session or without one)
or restored through a session, with what a child take reuses from it:

- its validated entries: unchanged entries are the child's own
  (:func:`casnap.take.plan.build_entries`), and a parent still stored is not
  read back (:func:`casnap.take.plan.known_chunks`);
- its JSON form per key, when it was serialized here: an unchanged child's
  manifest is not serialized again (:func:`casnap.format.manifest_bytes.entry_texts`);
- its chunks and delta bases (:func:`casnap.index.parent_chunks`), gathered once;
- its summary's parts (:class:`~casnap.index.summaries.SummaryMemo`): the
  child's summary walks only the entries that changed.

A manifest's hash names its bytes, so whoever put a record, every take whose
parent has that hash may use it: it changes no result, only what a take must
rebuild. A record moves on with its lineage: the child of a cached manifest
replaces it, and inherits its gathered chunks when the child's entries with
chunks are the parent's very objects (an unchanged re-take) and its summary
parts always (they are reused per entry object, never for an equal one). At
most :data:`CAPACITY` records are kept, the least recently used dropped first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from casnap import index
from casnap.format.entries import Entry, with_chunks
from casnap.format.manifest import Dumped, Manifest, same_entries
from casnap.index import ParentChunks
from casnap.index.summaries import SummaryMemo
from casnap.repo.damage import DamageSet

# Lineages kept at once: a few sessions, Checkpointers or session-less loops per
# process, each into its own repository or folder.
CAPACITY = 4


class Reusable:
    """One cached manifest and what a child take reuses from it (see the module docstring)."""

    def __init__(self, manifest: Manifest, dumped: Dumped | None, summary: SummaryMemo) -> None:
        self.manifest = manifest
        self.dumped = dumped  # with its JSON form, when it was serialized in this process
        self.summary = summary
        self._held: dict[str, Entry] | None = None
        self._chunks: ParentChunks | None = None

    def held(self) -> dict[str, Entry]:
        """The entries with chunks (:func:`~casnap.format.entries.with_chunks`)."""
        if self._held is None:
            self._held = with_chunks(self.manifest.entries)
        return self._held

    def chunks(self) -> ParentChunks:
        """:func:`~casnap.index.parent_chunks` of the manifest, no copy damaged: read-only
        for the caller, as :class:`~casnap.index.KnownChunks` treats them."""
        if self._chunks is None:  # two takes at once may both gather: the same result
            self._chunks = index.parent_chunks(self.manifest, DamageSet())
        return self._chunks

    def inherit(self, parent: Reusable) -> None:
        """Take over what ``parent`` gathered that holds for this manifest too."""
        self.summary = parent.summary
        if parent._chunks is not None and same_entries(self.held(), parent.held()):
            self._chunks = parent._chunks


class ReuseCache:
    """Per (repository id, manifest hash): a :class:`Reusable`, for at most ``capacity``."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._records: OrderedDict[tuple[str, str], Reusable] = OrderedDict()

    def get(self, repo_id: str, manifest_hash: str) -> Reusable | None:
        with self._lock:
            record = self._records.get((repo_id, manifest_hash))
            if record is not None:
                self._records.move_to_end((repo_id, manifest_hash))
            return record

    def put(
        self,
        repo_id: str,
        manifest_hash: str,
        manifest: Manifest,
        dumped: Dumped | None = None,
    ) -> Reusable:
        """Remember ``manifest``; the record of its first parent, if cached, passes to it."""
        record = Reusable(manifest, dumped, SummaryMemo())
        with self._lock:
            first = manifest.parents[0] if manifest.parents else None
            parent = self._records.pop((repo_id, first), None) if first else None
            self._records.pop((repo_id, manifest_hash), None)
            self._records[(repo_id, manifest_hash)] = record
            while len(self._records) > self._capacity:
                self._records.popitem(last=False)
        if parent is not None and first != manifest_hash:
            record.inherit(parent)
        return record

    def clear(self) -> None:
        """Forget every record (as a new process would start)."""
        with self._lock:
            self._records.clear()

    def _forked(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork


REUSE = ReuseCache()
os.register_at_fork(after_in_child=REUSE._forked)
