"""Reading a repository over time from manifests alone: log, du, diff.

No tensor data is read here and torch is not imported: every figure comes from
the manifests' chunk references (sizes, hashes, frame lengths).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from casnap.display import natural_key
from casnap.errors import CasnapError
from casnap.format.entries import (
    ChunkRef,
    ContainerEntry,
    Entry,
    ObjectEntry,
    ShardedEntry,
    TensorEntry,
    chunks_of,
)
from casnap.format.manifest import Manifest
from casnap.format.tree import missing_key
from casnap.index import SummaryLine, manifest_summaries, summary_lines
from casnap.ops.unreferenced import Unreferenced, find_unreferenced
from casnap.python_gc import python_gc_paused
from casnap.repo.damage import list_damage
from casnap.repo.leases import scan_leases
from casnap.repo.repository import RepoStorage, chunk_key, pack_key
from casnap.store import ObjectInfo


def _object_of(ref: ChunkRef) -> tuple[str, int, int]:
    """A chunk's identity for space accounting: the object and byte range it occupies."""
    return (ref.pack or ref.hash, ref.offset, ref.length)


def stored_bytes(manifest: Manifest) -> int:
    """Bytes the snapshot's chunks occupy in the store (shared chunks counted once)."""
    return sum(length for _, _, length in {_object_of(r) for r in manifest.stored_refs()})


@dataclass(frozen=True)
class LogLine:
    name: str
    manifest: str
    created_at: str
    step: int | None
    parents: tuple[str, ...]
    logical_bytes: int
    stored_bytes: int
    # Stored bytes the take added to the repository: frames that no earlier snapshot
    # still here (nor any of its parents whose manifest is still stored) references.
    new_bytes: int
    metadata: dict[str, Any]
    # Parents whose manifest this repository does not hold: collected by gc after
    # their snapshot was deleted, or never here (a copy brings no parents along).
    parents_absent: tuple[str, ...] = ()


def _heads(repo: RepoStorage) -> dict[str, str]:
    """Snapshot name -> manifest hash; refs are always read from the store, never cached."""
    heads = {}
    for name in repo.list_snapshots():
        try:
            heads[name] = repo.read_ref(name).manifest
        except FileNotFoundError:
            continue  # deleted while listing
    return heads


@python_gc_paused()  # sets of spans, no cycles: no full collection per summary read
def log(repo: RepoStorage) -> list[LogLine]:
    """Every snapshot, oldest first, with its size and what it added to the repository.

    "Added" is counted from the manifests: the frames a snapshot references
    that no snapshot created before it (nor a parent whose manifest is still
    stored) references. A take that found every chunk already stored, with or
    without a parent (an unchanged re-take, a DCP re-save, an import of the
    same file), added nothing. Manifest summaries come from the local index
    when cached (manifests are immutable), so a second ``log`` of a remote
    repository reads only refs.
    """
    heads = _heads(repo)
    lines = summary_lines(repo, heads.values(), missing_ok=True)
    parents = {p for s in lines.values() for p in s.parents} - lines.keys()
    lines |= summary_lines(repo, parents, missing_ok=True)
    named = sorted(
        ((name, mhash, lines[mhash]) for name, mhash in heads.items() if mhash in lines),
        key=lambda item: item[2].created_at,
    )
    seen = _Seen(repo, lines)
    out = []
    for name, mhash, s in named:
        for p in s.parents:
            if p in lines:
                seen.cover(p)
        out.append(
            LogLine(
                name=name,
                manifest=mhash,
                created_at=s.created_at,
                step=s.step,
                parents=tuple(s.parents),
                logical_bytes=s.logical_bytes,
                stored_bytes=s.stored_bytes,
                new_bytes=sum(x[2] for x in seen.beyond(mhash)),
                metadata=dict(s.metadata),
                parents_absent=tuple(p for p in s.parents if p not in lines),
            )
        )
        seen.cover(mhash)
    return out


class _Seen:
    """Every frame of the manifests covered so far, grown by each one's log line: a
    manifest whose first parent is covered adds only the spans its line adds to it
    (what ``log`` reads per snapshot); another one's whole summary is read."""

    def __init__(self, repo: RepoStorage, lines: dict[str, SummaryLine]) -> None:
        self.repo, self.lines = repo, lines
        self.frames: set[tuple[str, int, int]] = set()
        self.covered: set[str] = set()

    def _spans(self, mhash: str) -> frozenset[tuple[str, int, int]]:
        """Spans of ``mhash`` that hold every one of its frames not covered yet."""
        line = self.lines[mhash]
        if line.base is None or line.base in self.covered:
            return line.added
        return manifest_summaries(self.repo, [mhash])[mhash].spans

    def beyond(self, mhash: str) -> frozenset[tuple[str, int, int]]:
        """The frames of ``mhash`` not covered yet."""
        return self._spans(mhash) - self.frames

    def cover(self, mhash: str) -> None:
        if mhash not in self.covered:
            self.frames |= self._spans(mhash)
            self.covered.add(mhash)


@dataclass(frozen=True)
class SnapshotUsage:
    name: str
    logical_bytes: int
    stored_bytes: int  # bytes of the frames it references, shared frames counted once
    exclusive_bytes: int  # what deleting it (then gc) would free: whole objects only it uses


@dataclass(frozen=True)
class Leftovers:
    """What crashed writers left behind, which gc reclaims (docs/gc.md)."""

    temp_files: int = 0  # temp files of interrupted puts
    temp_bytes: int = 0
    expired_leases: int = 0  # leases of takes that died without releasing them
    live_leases: int = 0  # takes in flight now (not leftovers; gc waits for them)

    def __bool__(self) -> bool:
        return bool(self.temp_files or self.expired_leases)


@dataclass(frozen=True)
class StoreSpace:
    """Where the bytes the store holds go: ``stored`` (the frames the snapshots and
    tags reference) plus what else the store lists (docs/repository.md, "du")."""

    frame_bytes: int = 0  # = Usage.stored_bytes
    # Bytes of the packs in use that no referenced frame occupies: frames only deleted
    # snapshots used. gc deletes whole objects, so they go with a pack's last used frame.
    unused_in_packs: int = 0
    manifest_bytes: int = 0  # the manifests of the snapshots and tags
    unreferenced_bytes: int = 0  # = Usage.unreferenced.bytes: gc's, after its grace period
    temp_bytes: int = 0  # = Usage.leftovers.temp_bytes

    @property
    def total_bytes(self) -> int:
        """Everything below ``manifests/``, ``chunks/`` and ``packs/`` and the temp files,
        as the store lists them (refs, tags and config.json, a few hundred bytes each, aside)."""
        return (
            self.frame_bytes
            + self.unused_in_packs
            + self.manifest_bytes
            + self.unreferenced_bytes
            + self.temp_bytes
        )


@dataclass(frozen=True)
class Usage:
    snapshots: int
    logical_bytes: int  # what the snapshots would take without dedup or compression
    stored_bytes: int  # the frames they (and tags) reference, each counted once, headers included
    per_snapshot: tuple[SnapshotUsage, ...] = ()
    leftovers: Leftovers = Leftovers()
    unreferenced: Unreferenced = Unreferenced()  # what gc would delete after its grace period
    space: StoreSpace = StoreSpace()  # stored, and the rest of what the store holds

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


@python_gc_paused()  # as log
def du(repo: RepoStorage, pinned: dict[str, str] | None = None) -> Usage:
    """Space used, overall and per snapshot. ``pinned`` maps extra roots (tags) to manifests.

    "Stored" counts frames (each with its header), a frame shared by several
    snapshots once. An object (a loose chunk or a whole pack) counts toward a
    snapshot's "freed if deleted" only if no other snapshot or pinned root
    uses it, because gc frees whole objects. One listing of the store gives
    the objects' sizes and what no root reaches (:class:`StoreSpace`).
    """
    heads = _heads(repo)
    roots = [(n, h, True) for n, h in heads.items()]
    roots += [(f"tag:{t}", m, False) for t, m in (pinned or {}).items()]
    sums = summary_lines(repo, [h for _, h, _ in roots], missing_ok=True)
    named = Counter(h for _, h, _ in roots if h in sums)  # roots per manifest
    seen = _Seen(repo, sums)
    for mhash in sorted(named, key=lambda h: sums[h].created_at):
        seen.cover(mhash)
    frames = seen.frames
    extents: dict[str, int] = {}
    for obj, offset, length in frames:
        extents[obj] = max(extents.get(obj, 0), offset + length)
    owners, only = _owners(repo, sums, named)
    listed = [i for kind in ("chunks", "packs") for i in repo.store.list_info(kind)]
    manifests = list(repo.store.list_info("manifests"))
    sizes = _object_sizes(listed, extents)
    exclusive = Counter[str]()
    for obj, n in owners.items():
        if n == 1:
            exclusive[only[obj]] += sizes[obj]
    per = [
        SnapshotUsage(name, sums[h].logical_bytes, sums[h].stored_bytes, exclusive[h])
        for name, h, is_ref in roots
        if is_ref and h in sums
    ]
    frame_bytes = sum(length for _, _, length in frames)
    left = leftovers(repo)
    junk = _unreferenced(repo, set(sums), set(extents), listed, manifests)
    return Usage(
        snapshots=len(per),
        logical_bytes=sum(u.logical_bytes for u in per),
        stored_bytes=frame_bytes,
        per_snapshot=tuple(per),
        leftovers=left,
        unreferenced=junk,
        space=StoreSpace(
            frame_bytes=frame_bytes,
            unused_in_packs=max(sum(sizes.values()) - frame_bytes, 0),
            manifest_bytes=sum(i.size or 0 for i in manifests if i.key.rpartition("/")[2] in sums),
            unreferenced_bytes=junk.bytes,
            temp_bytes=left.temp_bytes,
        ),
    )


def _owners(
    repo: RepoStorage, lines: dict[str, SummaryLine], named: Counter[str]
) -> tuple[dict[str, int], dict[str, str]]:
    """How many roots use each object (``named``: roots per manifest), from the lines.

    The manifests form a forest, each under its first parent where that is one of
    them. An object is in a manifest when it is in its parent and not ``lost``, or
    ``gained``: the roots using it add up, over the manifests where it comes in
    (+) or goes (-), to that manifest's roots and all below it. Where an object has
    one user, the one manifest it comes in at is that user (``only``).
    """
    up = {m: b for m in named if (b := lines[m].base) is not None and b in named}
    children: dict[str, list[str]] = {}
    for m, b in up.items():
        children.setdefault(b, []).append(m)
    order = [m for m in named if m not in up]  # parents before children
    for m in order:
        order.extend(children.get(m, ()))
    below = dict(named)  # roots at a manifest and under it
    for m in reversed(order):
        if m in up:
            below[up[m]] += below[m]
    owners: dict[str, int] = {}
    only: dict[str, str] = {}
    for m in named:
        line = lines[m]
        if m in up:
            gained, lost = line.gained, line.lost
        elif line.base is None:
            gained, lost = line.gained, frozenset()
        else:  # its base is no root: every object it uses comes in here
            gained = frozenset(o for o, _, _ in manifest_summaries(repo, [m])[m].spans)
            lost = frozenset()
        for obj in gained:
            owners[obj] = owners.get(obj, 0) + below[m]
            only[obj] = m
        for obj in lost:
            owners[obj] = owners.get(obj, 0) - below[m]
    return owners, only


def _object_sizes(listed: list[ObjectInfo], extents: dict[str, int]) -> dict[str, int]:
    """Each object the roots use (by digest): its size as listed, else the end of its last
    referenced frame (a store that lists no sizes, or an object missing from the listing)."""
    sizes = dict(extents)
    for info in listed:
        digest = info.key.rpartition("/")[2]
        if digest in sizes and info.size is not None:
            sizes[digest] = max(sizes[digest], info.size)
    return sizes


def _unreferenced(
    repo: RepoStorage,
    manifests: set[str],
    digests: set[str],
    listed: list[ObjectInfo],
    listed_manifests: list[ObjectInfo],
) -> Unreferenced:
    """Objects no root reaches; ``digests`` are the packs and loose chunks the roots use.

    A summary does not say whether a digest names a pack or a loose chunk, so
    both keys count as referenced; a damaged pack frame's replacement
    ``chunks/<h>`` counts too, as gc keeps it (docs/damage.md).
    """
    keys = {k for d in digests for k in (chunk_key(d), pack_key(d))}
    try:
        keys |= {chunk_key(c.chunk) for c in list_damage(repo) if c.pack in digests}
    except CasnapError:
        pass  # a replacement then counts as unreferenced: du only reports
    return find_unreferenced(repo, manifests, keys, listed, listed_manifests)


def leftovers(repo: RepoStorage) -> Leftovers:
    """Temp files of interrupted puts and leases of dead takes, as gc would find them."""
    temps = list(repo.store.list_temporary())  # every folder, and the top (gc-epoch, gc.lock)
    leases = scan_leases(repo.store)
    return Leftovers(
        temp_files=len(temps),
        temp_bytes=sum(t.size or 0 for t in temps),
        expired_leases=len(leases.dead),
        live_leases=len(leases.blocking),
    )


def graph_lanes(lines: list[LogLine]) -> list[str]:
    """A git-log-like lane prefix per line (oldest first) that shows branches.

    A snapshot continues its parent's lane when it is the parent's first
    child; a second child of the same parent opens a new lane to the right.
    A snapshot whose parents are all gone (deleted by retention) reuses the
    first lane whose tip will have no more children.
    """
    known = {line.manifest for line in lines}
    lanes: list[str | None] = []  # manifest hash at the tip of each lane
    out = []
    for i, line in enumerate(lines):
        lane = next(
            (j for j, tip in enumerate(lanes) if tip is not None and tip in line.parents), None
        )
        if lane is None:
            if any(p in known for p in line.parents):  # a branch off a listed snapshot
                free = [j for j, tip in enumerate(lanes) if tip is None]
            else:  # a root, or its ancestors are gone: reuse a lane nobody continues
                later = {p for other in lines[i:] for p in other.parents}
                free = [j for j, tip in enumerate(lanes) if tip is None or tip not in later]
            lane = free[0] if free else len(lanes)
            if lane == len(lanes):
                lanes.append(None)
        lanes[lane] = line.manifest
        out.append(
            " ".join(
                "*" if j == lane else ("|" if t else " ") for j, t in enumerate(lanes)
            ).rstrip()
        )
    return out


Status = Literal["added", "removed", "changed", "unchanged"]


@dataclass(frozen=True)
class EntryDiff:
    """One entry of a diff. The drift figures are filled in only by a diff with
    stats (``casnap.Repository.diff(..., stats=True)``), for changed tensors of
    equal dtype, shape and chunking; they stay ``None`` otherwise.

    A container (``container=True``: a dict, list or object holding other
    entries) is ``changed`` when its own members or anything below it changed;
    counts of what changed (:func:`value_counts`) leave containers out."""

    key: str
    status: Status
    changed_bytes: int  # raw bytes in chunks that differ
    changed_chunks: int
    max_abs_diff: float | None = None  # max |b - a| over the changed chunks
    rel_l2: float | None = None  # ||b - a|| / ||a|| over the changed chunks
    container: bool = False


def diff(a: Manifest, b: Manifest, key: str | None = None) -> list[EntryDiff]:
    """Per entry of ``a`` and ``b`` (only ``key`` and below, when given), in natural key
    order (``layer2`` before ``layer10``): added, removed, changed or unchanged, from chunk
    hashes. A ``key`` neither holds raises MissingKeyError naming the nearest keys."""
    entries_a, entries_b = a.entries, b.entries
    if key is not None:
        entries_a, entries_b = _under(entries_a, key), _under(entries_b, key)
        if not entries_a and not entries_b:
            raise missing_key(key, {*a.entries, *b.entries})
    out = []
    for key in sorted(set(entries_a) | set(entries_b), key=natural_key):
        ea, eb = entries_a.get(key), entries_b.get(key)
        is_container = all(isinstance(e, ContainerEntry) for e in (ea, eb) if e is not None)
        if ea is None or eb is None:
            e = eb if ea is None else ea
            assert e is not None  # the key comes from one of the two
            chunks = chunks_of(e)
            out.append(
                EntryDiff(
                    key,
                    "added" if ea is None else "removed",
                    sum(c.size for c in chunks),
                    len(chunks),
                    container=is_container,
                )
            )
            continue
        if isinstance(ea, (TensorEntry, ObjectEntry)) and isinstance(
            eb, (TensorEntry, ObjectEntry)
        ):
            if type(ea) is type(eb) and _same_layout(ea, eb):
                changed = [cb for ca, cb in zip(ea.chunks, eb.chunks) if ca.hash != cb.hash]
            else:
                changed = list(eb.chunks)
            status: Status = "changed" if changed or not _same_layout(ea, eb) else "unchanged"
            out.append(EntryDiff(key, status, sum(c.size for c in changed), len(changed)))
        elif isinstance(ea, ShardedEntry) or isinstance(eb, ShardedEntry):
            # Shards may be cut differently (another world size): compare by content.
            before = {c.hash for c in chunks_of(ea)}
            changed = [c for c in chunks_of(eb) if c.hash not in before]
            same = ea.model_dump() == eb.model_dump()
            out.append(
                EntryDiff(
                    key,
                    "unchanged" if same else "changed",
                    sum(c.size for c in changed),
                    len(changed),
                )
            )
        else:
            same = ea.model_dump() == eb.model_dump()
            out.append(
                EntryDiff(key, "unchanged" if same else "changed", 0, 0, container=is_container)
            )
    return _containers_follow_their_members(out)


def _under(entries: Mapping[str, Entry], key: str) -> dict[str, Entry]:
    return {k: e for k, e in entries.items() if k == key or k.startswith(key + "/")}


def _containers_follow_their_members(rows: list[EntryDiff]) -> list[EntryDiff]:
    """Mark ``changed`` every container with an entry below it that is not unchanged."""
    moved: set[str] = set()
    for r in rows:
        if r.status != "unchanged":
            parent = r.key.rpartition("/")[0]
            while parent and parent not in moved:
                moved.add(parent)
                parent = parent.rpartition("/")[0]
    return [
        replace(r, status="changed")
        if r.container and r.status == "unchanged" and r.key in moved
        else r
        for r in rows
    ]


def value_counts(rows: list[EntryDiff]) -> dict[str, int]:
    """How many values (tensors, primitives, objects; not containers) have each status,
    in the order added, removed, changed, unchanged (statuses none has left out)."""
    counts = {s: 0 for s in ("added", "removed", "changed", "unchanged")}
    for r in rows:
        if not r.container:
            counts[r.status] += 1
    return {s: n for s, n in counts.items() if n}


def _same_layout(a: TensorEntry | ObjectEntry, b: TensorEntry | ObjectEntry) -> bool:
    if isinstance(a, TensorEntry) and isinstance(b, TensorEntry):
        return a.dtype == b.dtype and a.shape == b.shape and a.chunk_size == b.chunk_size
    return a.chunk_size == b.chunk_size and len(a.chunks) == len(b.chunks)
