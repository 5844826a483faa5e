"""Reading a repository over time from manifests alone: log, du, diff.

No tensor data is read here and torch is not imported: every figure comes from
the manifests' chunk references (sizes, hashes, frame lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from casnap.manifest import ChunkRef, Manifest, ObjectEntry, TensorEntry
from casnap.repository import Repository


def _object_of(ref: ChunkRef) -> tuple[str, int, int]:
    """A chunk's identity for space accounting: the object and byte range it occupies."""
    return (ref.pack or ref.hash, ref.offset, ref.length)


def stored_bytes(manifest: Manifest) -> int:
    """Bytes the snapshot's chunks occupy in the store (shared chunks counted once)."""
    return sum(length for _, _, length in {_object_of(r) for r in manifest.chunk_refs()})


def logical_bytes(manifest: Manifest) -> int:
    return sum(r.size for r in manifest.chunk_refs())


@dataclass(frozen=True)
class LogLine:
    name: str
    manifest: str
    created_at: str
    step: int | None
    parents: tuple[str, ...]
    logical_bytes: int
    stored_bytes: int
    new_bytes: int  # stored bytes not shared with any parent


def log(repo: Repository) -> list[LogLine]:
    """Every snapshot, oldest first, with its size and what it added over its parents."""
    lines = []
    cache: dict[str, Manifest] = {}

    def manifest(h: str) -> Manifest | None:
        if h not in cache:
            try:
                cache[h] = repo.read_manifest(h)
            except FileNotFoundError:
                return None
        return cache[h]

    for name in repo.list_snapshots():
        ref = repo.read_ref(name)
        m = manifest(ref.manifest)
        if m is None:
            continue
        inherited: set[tuple[str, int, int]] = set()
        for p in m.parents:
            pm = manifest(p)
            if pm is not None:
                inherited |= {_object_of(r) for r in pm.chunk_refs()}
        mine = {_object_of(r) for r in m.chunk_refs()}
        step = m.metadata.get("step")
        lines.append(LogLine(
            name=name, manifest=ref.manifest, created_at=m.created_at,
            step=step if isinstance(step, int) else None, parents=tuple(m.parents),
            logical_bytes=logical_bytes(m), stored_bytes=sum(x[2] for x in mine),
            new_bytes=sum(x[2] for x in mine - inherited),
        ))  # fmt: skip
    lines.sort(key=lambda line: line.created_at)
    return lines


@dataclass(frozen=True)
class Usage:
    snapshots: int
    logical_bytes: int  # what the snapshots would take without dedup or compression
    stored_bytes: int  # the unique chunk bytes they reference

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def du(repo: Repository) -> Usage:
    objects: set[tuple[str, int, int]] = set()
    logical = 0
    names = repo.list_snapshots()
    for name in names:
        m = repo.read_manifest(repo.resolve(name))
        logical += logical_bytes(m)
        objects |= {_object_of(r) for r in m.chunk_refs()}
    return Usage(len(names), logical, sum(x[2] for x in objects))


Status = Literal["added", "removed", "changed", "unchanged"]


@dataclass(frozen=True)
class EntryDiff:
    key: str
    status: Status
    changed_bytes: int  # raw bytes in chunks that differ
    changed_chunks: int


def diff(a: Manifest, b: Manifest) -> list[EntryDiff]:
    """Per entry of ``a`` and ``b``: added, removed, changed or unchanged, from chunk hashes."""
    out = []
    for key in sorted(set(a.entries) | set(b.entries)):
        ea, eb = a.entries.get(key), b.entries.get(key)
        if ea is None or eb is None:
            e = eb if ea is None else ea
            chunks = e.chunks if isinstance(e, (TensorEntry, ObjectEntry)) else []
            out.append(EntryDiff(key, "added" if ea is None else "removed",
                                 sum(c.size for c in chunks), len(chunks)))  # fmt: skip
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
        else:
            same = ea.model_dump() == eb.model_dump()
            out.append(EntryDiff(key, "unchanged" if same else "changed", 0, 0))
    return out


def _same_layout(a: TensorEntry | ObjectEntry, b: TensorEntry | ObjectEntry) -> bool:
    if isinstance(a, TensorEntry) and isinstance(b, TensorEntry):
        return a.dtype == b.dtype and a.shape == b.shape and a.chunk_size == b.chunk_size
    return a.chunk_size == b.chunk_size and len(a.chunks) == len(b.chunks)
