"""The local LMDB index: a per-machine cache of what a repository holds (docs/index.md).

It caches chunk locations (a take's dedup) and manifest summaries (``log``,
``du``, a reclaim's mark), is rebuildable from the store (:func:`rebuild`),
and its chunk locations are never trusted by gc, verify or restore. This
module is the API the rest of casnap uses; docs/index.md names the modules
behind it and gives the invalidation protocol, the failure handling and the
measured effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from casnap.errors import CasnapError, SnapshotNotFoundError
from casnap.format.entries import (
    CHUNKLESS,
    ChunkRef,
    TensorEntry,
    chunks_of,
)
from casnap.format.manifest import Manifest
from casnap.index.lmdb_envs import INDEX_FORMAT, close_all, drop, index_path
from casnap.index.lmdb_store import (
    GC_EPOCH_KEY,
    RepoIndex,
    enabled,
    open_index,
    read_epoch_bytes,
)
from casnap.index.summaries import ManifestSummary, SummaryLine, SummaryMemo, line_of, summarize
from casnap.repo.damage import DamageSet
from casnap.repo.leases import hold_lease
from casnap.repo.repository import RepoStorage
from casnap.settings import DEFAULT_INDEX_MAP_SIZE as DEFAULT_MAP_SIZE

__all__ = [
    "DEFAULT_MAP_SIZE",
    "GC_EPOCH_KEY",
    "INDEX_FORMAT",
    "ParentChunks",
    "KnownChunks",
    "ManifestSummary",
    "RebuildStats",
    "RepoIndex",
    "SummaryLine",
    "SummaryMemo",
    "close_all",
    "drop",
    "enabled",
    "index_path",
    "manifest_summaries",
    "manifest_summary",
    "open_index",
    "read_epoch_bytes",
    "rebuild",
    "record_manifest",
    "summarize",
    "summary_lines",
]


# A parent's chunks a take may reference, and its delta bases (parent_chunks).
ParentChunks = tuple[dict[str, ChunkRef], dict[str, tuple[int, Sequence[ChunkRef]]]]


class KnownChunks(dict[str, ChunkRef]):
    """Chunk locations a take may reference without writing, plus the index to ask on a miss.

    ``damaged`` holds the copies a read found damaged (docs/damage.md): no
    location in this dict is one of them, and the writer treats an index
    entry naming one as a miss. ``fresh``: the repository was created by this
    take, so the writer probes the store for no chunk (none can be there).
    """

    def __init__(
        self, index: RepoIndex | None = None, damaged: DamageSet | None = None, fresh: bool = False
    ) -> None:
        super().__init__()
        self.index = index
        self.damaged = damaged if damaged is not None else DamageSet()
        # Per tensor key of the first parent: (chunk size, chunk refs), the bases a
        # changed chunk may be stored as a delta against (casnap.chunks.delta).
        self.bases: dict[str, tuple[int, Sequence[ChunkRef]]] = {}
        self.fresh = fresh

    def add_parent(
        self, manifest: Manifest, gathered: Callable[[], ParentChunks] | None = None
    ) -> None:
        """Add a parent manifest's chunks (the first one's delta bases too); ``gathered``:
        its :func:`parent_chunks` without damage, gathered once (casnap.take.reuse)."""
        if gathered is not None and not self.damaged:
            refs, bases = gathered()
        else:
            refs, bases = parent_chunks(manifest, self.damaged)
        self.update(refs)
        if not self.bases:  # the first parent's: the take's lineage
            self.bases = bases


def parent_chunks(
    manifest: Manifest, damaged: DamageSet
) -> tuple[dict[str, ChunkRef], dict[str, tuple[int, Sequence[ChunkRef]]]]:
    """A parent's chunks a take may reference, and its delta bases.

    Copies a read found damaged are left out (written again, never
    referenced). The bases: each dense tensor's (chunk size, chunks); a
    changed chunk's natural delta base is the chunk at the same offset of the
    same key in the parent snapshot.
    """
    refs: dict[str, ChunkRef] = {}
    bases: dict[str, tuple[int, Sequence[ChunkRef]]] = {}
    # A rank-grouped manifest's entry objects stand under many keys: each is walked once.
    seen: set[int] | None = set() if manifest.world_size > 1 else None
    for key, e in manifest.entries.items():
        if type(e) in CHUNKLESS:
            continue
        if isinstance(e, TensorEntry):
            chunks = e.chunks
            if chunks:
                bases[key] = (e.chunk_size, chunks)  # entries are never changed in place
        else:
            chunks = chunks_of(e)
        if seen is not None:
            if id(e) in seen:
                continue
            seen.add(id(e))
        for c in chunks:
            if not damaged or c not in damaged:  # another copy of the chunk may be whole
                refs[c.hash] = c
    return refs, bases


# -- history -----------------------------------------------------------------


def manifest_summaries(
    repo: RepoStorage, hashes: Iterable[str], *, missing_ok: bool = False
) -> dict[str, ManifestSummary]:
    """Summaries of ``hashes``, from the index where cached, else read from the store.

    A manifest the store does not hold (and the index never saw) raises
    :class:`casnap.SnapshotNotFoundError`, like ``RepoStorage.read_manifest``,
    or with ``missing_ok`` is left out of the result.
    """
    index = open_index(repo, chunks=False)
    out: dict[str, ManifestSummary] = {}
    fresh: list[ManifestSummary] = []
    for h in dict.fromkeys(hashes):
        cached = index.summary(h) if index is not None else None
        if cached is None:
            try:
                cached = summarize(h, repo.read_manifest(h))
            except SnapshotNotFoundError:
                if missing_ok:
                    continue
                raise
            fresh.append(cached)
        out[h] = cached
    if index is not None and fresh:
        index.record_summaries(fresh)
    return out


def summary_lines(
    repo: RepoStorage, hashes: Iterable[str], *, missing_ok: bool = False
) -> dict[str, SummaryLine]:
    """The log lines of ``hashes`` (see :class:`SummaryLine`): from the index where
    cached, else made from their summaries and their first parents' (then cached)."""
    wanted = list(dict.fromkeys(hashes))
    index = open_index(repo, chunks=False)
    out = index.lines(wanted) if index is not None else {}
    todo = [h for h in wanted if h not in out]
    if not todo:
        return out
    sums = manifest_summaries(repo, todo, missing_ok=missing_ok)
    firsts = {s.parents[0] for s in sums.values() if s.parents} - sums.keys()
    sums |= manifest_summaries(repo, firsts, missing_ok=True)
    made = []
    for h in todo:
        if h in sums:
            s = sums[h]
            parent = sums.get(s.parents[0]) if s.parents else None
            made.append(line_of(s, parent.spans if parent is not None else None))
            out[h] = made[-1]
    if index is not None:
        index.record_summaries((), made)
    return out


def manifest_summary(repo: RepoStorage, manifest_hash: str) -> ManifestSummary:
    """The summary of one manifest (see :func:`manifest_summaries`).

    Example::

        for name in repo.list_snapshots():
            s = manifest_summary(repo, repo.resolve(name))
            print(name, s.step, s.logical_bytes, s.stored_bytes)
    """
    return manifest_summaries(repo, [manifest_hash])[manifest_hash]


def record_manifest(
    repo: RepoStorage, manifest_hash: str, manifest: Manifest, memo: SummaryMemo | None = None
) -> None:
    """Cache the summary of a manifest just written or read (a no-op when disabled);
    ``memo``: the reuse cache's (casnap.take.reuse), which reuses what the parent's
    entries cost to summarize."""
    index = open_index(repo, chunks=False)
    if index is None:
        return
    first = manifest.parents[0] if manifest.parents else None
    base = memo.spans_of(first) if memo is not None and first is not None else None
    if base is None and first is not None:
        cached = index.summary(first)  # a parent this process did not summarize last
        base = cached.spans if cached is not None else None
    summary = summarize(manifest_hash, manifest, memo)
    index.record_summaries([summary], [line_of(summary, base)])


@dataclass(frozen=True)
class RebuildStats:
    manifests: int
    chunks: int


def rebuild(repo: RepoStorage) -> RebuildStats:
    """Fill the index from the store: every manifest a ref names, and its chunks.

    One get per ref and per manifest. Like a take, it holds a lease (so no gc
    sweeps meanwhile) from before it reads the gc epoch until it has recorded
    the last chunk, and stops early if the lease was lost.
    """
    manifests = chunks = 0
    with hold_lease(repo, kind="index") as lease:
        index = open_index(repo)
        if index is None:
            return RebuildStats(0, 0)
        for name in repo.list_snapshots():
            try:
                h = repo.resolve(name)
                m = repo.read_manifest(h)
            except CasnapError:
                continue  # deleted meanwhile
            index.record_summaries([summarize(h, m)])
            if not lease.valid():
                break  # a gc may sweep from now on: learn nothing more about chunks
            # Whole frames only: a delta frame is no location of its chunk without its
            # base, and the index stores none (a take would reference it whole).
            whole = {r.chain()[-1].hash: r.chain()[-1] for r in m.distinct_refs()}
            chunks += index.record_chunks(whole.values())
            manifests += 1
    return RebuildStats(manifests, chunks)
