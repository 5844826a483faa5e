"""A take's plan: what each rank holds, what it may reference, and the entries it becomes.

Every take, single-process or distributed (a single process is a world of
one), describes its state as :class:`RankPlan` values: keys, entry kinds,
dtypes, shapes and chunk ids, never data. :func:`build_entries` is the one
place where plans and the written chunks' locations become manifest entries.

What a take may reference without writing is its parents' chunks and the
local index's (:func:`known_chunks`); the reuse cache
(:mod:`casnap.take.reuse`) keeps the manifests this process committed, so
the next take of the same structure needs neither to read its parent back
nor to rebuild unchanged entries (docs/pipeline.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from casnap import index
from casnap.errors import CasnapError
from casnap.format.entries import (
    ChunkRef,
    ContainerEntry,
    Entry,
    ObjectEntry,
    PrimitiveEntry,
    Quantization,
    ShardedEntry,
    ShardRecord,
    TensorEntry,
)
from casnap.format.manifest import Dumped
from casnap.format.manifest_bytes import trusted_tensor_entry
from casnap.index import KnownChunks
from casnap.repo.damage import DamageSet, damage_set
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.take.reuse import REUSE


def cached_parent(
    repo: RepoStorage, parents: list[str]
) -> tuple[Mapping[str, Entry], Dumped | None]:
    """The entries of the first parent the reuse cache holds, and its JSON form if it has it.

    A take reuses unchanged entries of that manifest (:func:`build_entries`)
    and their JSON (:meth:`Manifest.to_jsonable`); when none is cached, nothing.
    """
    for parent in parents:
        record = REUSE.get(repo.config.repo_id, parent)
        if record is not None:
            return record.manifest.entries, record.dumped
    return {}, None


def known_chunks(repo: RepoStorage, parents: list[str], fresh: bool = False) -> KnownChunks:
    """Chunks a take may reference without writing: its parents', and the local index's.

    Called inside the take's gc-exclusion window: opening the index reads the
    store's gc epoch, and index entries are trusted only while no gc has
    swept since (docs/index.md). The parents' chunk locations come from their
    manifests (one get each); every other chunk is looked up in the index by
    the ChunkWriter, so a take in a fresh process probes no chunk the index
    knows. A parent in the reuse cache (casnap.take.reuse) is not read back.
    Without the index (``CASNAP_INDEX=0``) this is the parents' chunks only.
    Copies a read found damaged (``.casnap/damaged/``, docs/damage.md) are left
    out, whoever vouches for them, so the writer stores those chunks again.
    ``fresh`` (the take created the repository): no damage listing, and the
    writer probes for no chunk.
    """
    damaged = DamageSet() if fresh else damage_set(repo)  # one listing, normally empty
    known = KnownChunks(index.open_index(repo), damaged, fresh)
    summaries = []
    for parent in parents:
        record = REUSE.get(repo.config.repo_id, parent)
        if record is not None and repo.store.exists(manifest_key(parent)):
            # Cached, and still stored: gc deletes a manifest before its chunks and
            # cannot run while this take's lease is held, so its chunks are all
            # there, exactly as if it had been read back (docs/gc.md).
            known.add_parent(record.manifest, record.chunks)
            continue
        try:
            manifest = repo.read_manifest(parent)
        except CasnapError:
            continue  # a parent that is gone only costs dedup, never correctness
        known.add_parent(manifest)
        summaries.append(index.summarize(parent, manifest))
    if known.index is not None and summaries:
        known.index.record_summaries(summaries)  # free for log/du: already read
    return known


ChunkIds = tuple[tuple[str, int], ...]  # (hash, raw size) per chunk, in order


@dataclass(frozen=True)
class TensorPlan:
    dtype: str
    shape: tuple[int, ...]
    replicated: bool
    chunks: ChunkIds
    quantized: Quantization | None = None


@dataclass(frozen=True)
class ObjectPlan:
    type_name: str
    size: int
    chunks: ChunkIds


@dataclass(frozen=True)
class ShardPlan:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: ChunkIds
    quantized: Quantization | None = None


@dataclass(frozen=True)
class ShardedPlan:
    layout: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardPlan, ...]


EntryPlan = TensorPlan | ObjectPlan | ShardedPlan | ContainerEntry | PrimitiveEntry


@dataclass(frozen=True)
class RankPlan:
    """What one rank sends in the planning exchange."""

    rank: int
    chunk_size: int
    entries: dict[str, EntryPlan]


def logical(key: str) -> str:
    """A key without its rank component: ``"3/model/w"`` -> ``"model/w"``."""
    return key.split("/", 1)[1] if "/" in key else ""


def is_replicated(key: str, patterns: list[str]) -> bool:
    """Whether ``key``'s logical path matches one of the ``replicated`` fnmatch patterns."""
    if not patterns:
        return False
    path = logical(key)
    return any(fnmatchcase(path, p) for p in patterns)


def chunks_of(plan: EntryPlan) -> list[tuple[str, int]]:
    if isinstance(plan, (TensorPlan, ObjectPlan)):
        return list(plan.chunks)
    if isinstance(plan, ShardedPlan):
        return [c for s in plan.shards for c in s.chunks]
    return []


def tensor_entry(
    dtype: str,
    shape: list[int],
    chunk_size: int,
    chunks: list[ChunkRef],
    replicated: bool,
    quantized: Quantization | None,
    previous: Entry | None,
) -> TensorEntry:
    """The entry of one tensor; the previous take's own object when nothing changed."""
    if (
        isinstance(previous, TensorEntry)
        and previous.chunks == chunks  # the very same ChunkRefs when unchanged: cheap
        and previous.dtype == dtype
        and previous.shape == shape
        and previous.chunk_size == chunk_size
        and previous.replicated == replicated
        and previous.quantized == quantized
    ):
        return previous
    # Built from what this process flattened and hashed: the validators would
    # only re-derive it (a manifest read back is validated: parse_manifest).
    return trusted_tensor_entry(dtype, shape, chunk_size, chunks, replicated, quantized)


def _tensor_entry(
    plan: TensorPlan, chunk_size: int, chunks: list[ChunkRef], previous: Entry | None
) -> TensorEntry:
    return tensor_entry(
        plan.dtype, list(plan.shape), chunk_size, chunks, plan.replicated, plan.quantized, previous
    )


def _refs(ids: ChunkIds, refs: dict[str, ChunkRef]) -> list[ChunkRef]:
    return [refs[h] for h, _ in ids]


Boxes = dict[tuple[int, ...], ShardPlan]


def _sharded_entry(
    head: ShardedPlan, boxes: Boxes, cs: int, refs: dict[str, ChunkRef]
) -> ShardedEntry:
    shards = [
        ShardRecord(
            offsets=list(s.offsets),
            sizes=list(s.sizes),
            chunk_size=cs,
            chunks=_refs(s.chunks, refs),
            quantized=s.quantized,
        )
        for _, s in sorted(boxes.items())
    ]
    return ShardedEntry(
        layout=head.layout,  # type: ignore[arg-type]
        dtype=head.dtype,
        shape=list(head.shape),
        shards=shards,
    )


def _sharded_entries(
    plans: list[RankPlan], refs: dict[str, ChunkRef]
) -> tuple[dict[str, ShardedEntry], dict[str, Boxes], dict[str, ShardedPlan]]:
    """One entry per logical key, holding the union of every rank's shards.

    A box held by several ranks is taken from the lowest; also returned, the
    boxes and heads that a rank whose own copy of a box differs (a replica
    that diverged, kept with a warning: docs/distributed.md) builds its entry from.
    """
    boxes: dict[str, Boxes] = {}
    heads: dict[str, ShardedPlan] = {}
    for p in plans:
        for key, entry in p.entries.items():
            if isinstance(entry, ShardedPlan):
                heads.setdefault(logical(key), entry)
                for s in entry.shards:
                    boxes.setdefault(logical(key), {}).setdefault(s.offsets, s)
    cs = plans[0].chunk_size
    out = {
        path: _sharded_entry(head, boxes.get(path, {}), cs, refs) for path, head in heads.items()
    }
    return out, boxes, heads


def _own_sharded(
    key: str,
    plan: ShardedPlan,
    union: tuple[dict[str, ShardedEntry], dict[str, Boxes], dict[str, ShardedPlan]],
    cs: int,
    refs: dict[str, ChunkRef],
) -> ShardedEntry:
    """A rank's sharded entry: the shared one, unless its own copy of a box differs."""
    entries, boxes, heads = union
    path = logical(key)
    shared = boxes.get(path, {})
    if all(shared.get(s.offsets) == s for s in plan.shards):
        return entries[path]
    own = {**shared, **{s.offsets: s for s in plan.shards}}
    return _sharded_entry(heads[path], own, cs, refs)


def build_entries(
    plans: list[RankPlan], refs: dict[str, ChunkRef], previous: Mapping[str, Entry] | None = None
) -> dict[str, Entry]:
    """Every rank's manifest entries, from the plans and where their chunks were written.

    The one place entries are built, for every take (a single process is a
    world of one); the committing rank calls it once every chunk is durable.
    An entry equal to ``previous``'s (the parent's, when the session holds
    it) is that very object: validated when it was built, frozen, and its
    JSON is reused by the serializer.
    """
    sharded = _sharded_entries(plans, refs)
    entries: dict[str, Entry] = {}
    old = previous or {}
    for p in plans:
        cs = p.chunk_size
        for key, e in p.entries.items():
            if isinstance(e, TensorPlan):
                entries[key] = _tensor_entry(e, cs, _refs(e.chunks, refs), old.get(key))
            elif isinstance(e, ObjectPlan):
                built = ObjectEntry(
                    serializer="pickle",
                    type_name=e.type_name,
                    size=e.size,
                    chunk_size=cs,
                    chunks=_refs(e.chunks, refs),
                )
                entries[key] = _same_or(built, old.get(key))
            elif isinstance(e, ShardedPlan):
                entries[key] = _own_sharded(key, e, sharded, cs, refs)
            else:  # a container or primitive: a new object each take, equal when unchanged
                entries[key] = _same_or(e, old.get(key))
    return entries


def _same_or(entry: Entry, previous: Entry | None) -> Entry:
    """``previous`` when it equals ``entry`` (so an unchanged take's entries are all the
    parent's objects, casnap.format.manifest.same_entries), else ``entry``.

    A primitive's value must have the same type too: ``True == 1``, and a parent
    read from a store may hold ``{"type": "int", "value": true}`` (parsed, refused
    only when restored); its object must not stand in for a correct one.
    """
    if previous is None or type(previous) is not type(entry) or previous != entry:
        return entry
    if (
        isinstance(entry, PrimitiveEntry)
        and isinstance(previous, PrimitiveEntry)
        and type(previous.value) is not type(entry.value)
    ):
        return entry
    return previous
