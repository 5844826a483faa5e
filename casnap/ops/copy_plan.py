"""Planning a copy between repositories: what the destination lacks (docs/copy.md).

:func:`copy_needs` resolves each snapshot to its manifest, refuses a name the
destination holds with other content (unless ``force``), and lists the
objects the manifest reaches (:func:`casnap.repo.reach.reached_objects`, the
definition gc marks by) that the destination lacks, by asking the
destination whether each key exists. A manifest already at the destination
needs nothing (every manifest in a store is whole: docs/gc.md), and neither
do the objects of its parents' manifests found there. The plan is a value:
print it for a dry run; :func:`casnap.ops.copy.execute_copy` sends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from casnap.display import format_size
from casnap.errors import (
    CasnapError,
    ObjectNotFoundError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from casnap.format.entries import ChunkRef
from casnap.format.manifest import Manifest
from casnap.format.parse import MAX_MANIFEST_BYTES, parse_manifest
from casnap.repo.reach import reached_objects
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.settings import io_workers_for

State = Literal["new", "present", "replace"]


@dataclass(frozen=True)
class SnapshotCopy:
    """One snapshot in a :class:`CopyNeeds`.

    ``state``: ``new`` (the destination lacks the name), ``present`` (it names
    the same manifest: nothing to do) or ``replace`` (another manifest, and
    ``force`` was given). ``missing`` are the object keys to send.
    """

    name: str
    manifest: str
    state: State
    objects: int  # objects the manifest reaches
    missing: tuple[str, ...] = ()
    manifest_present: bool = False  # the destination has the manifest (so all its objects)
    bytes_to_send: int = 0  # estimated from the chunk references


@dataclass(frozen=True)
class CopyNeeds:
    """What :func:`execute_copy` would send; print it for a dry run."""

    src: str
    dst: str
    snapshots: tuple[SnapshotCopy, ...]
    objects_present: int = 0  # distinct objects the snapshots reach that the destination has
    # Per object key to send: the chunk references read from it (to verify and
    # estimate). Not part of the value people compare or print.
    refs: dict[str, tuple[ChunkRef, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def to_send(self) -> tuple[str, ...]:
        """Every object key to send, once."""
        return tuple(dict.fromkeys(k for s in self.snapshots for k in s.missing))

    @property
    def bytes_to_send(self) -> int:
        return sum(estimate(self.refs[k]) for k in self.to_send)

    def render(self) -> str:
        lines = [f"copy plan {self.src} -> {self.dst}"]
        for s in self.snapshots:
            if s.state == "present":
                lines.append(f"  {s.name}: present (same manifest)")
                continue
            verb = "replace" if s.state == "replace" else "copy"
            lines.append(
                f"  {s.name}: {verb}, {len(s.missing)} of {s.objects} object(s) to send "
                f"(~{format_size(s.bytes_to_send)})"
                + (", manifest present" if s.manifest_present else "")
            )
        lines.append(f"  in all: {len(self.to_send)} object(s), ~{format_size(self.bytes_to_send)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "snapshots": [
                {
                    "name": s.name,
                    "manifest": s.manifest,
                    "state": s.state,
                    "objects": s.objects,
                    "missing": len(s.missing),
                    "bytes_to_send": s.bytes_to_send,
                }
                for s in self.snapshots
            ],
            "objects_to_send": len(self.to_send),
            "bytes_to_send": self.bytes_to_send,
        }


def estimate(refs: Sequence[ChunkRef]) -> int:
    """The stored size of the object holding ``refs``: exact for a loose chunk, the extent
    of its referenced frames for a pack."""
    return max(r.offset + r.length for r in refs)


def read_manifest_bytes(repo: RepoStorage, m: str) -> tuple[bytes, Manifest]:
    try:
        data = repo.store.get(manifest_key(m), limit=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError as exc:
        raise SnapshotNotFoundError(f"manifest {m} is missing from {repo.url}") from exc
    return data, parse_manifest(data, m, repo.parts.load)  # checks the bytes against the name


def _resolve(
    src: RepoStorage, dst: RepoStorage, names: Iterable[str], force: bool
) -> list[tuple[str, str, State]]:
    """(name, manifest, state) per snapshot; refuses every conflict before anything is sent."""
    out: list[tuple[str, str, State]] = []
    conflicts: list[str] = []
    for name in dict.fromkeys(names):
        manifest = src.resolve(name)  # SnapshotNotFoundError names a missing one
        state: State = "new"
        try:
            there = dst.resolve(name)
        except SnapshotNotFoundError:
            there = None
        if there == manifest:
            state = "present"
        elif there is not None:
            state = "replace"
            conflicts.append(name)
        out.append((name, manifest, state))
    if conflicts and not force:
        shown = ", ".join(conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
        raise SnapshotExistsError(
            f"{len(conflicts)} snapshot(s) exist in {dst.url} with other content: {shown}; "
            "nothing was copied (force=True / --force replaces them)",
            conflicts[0],
        )
    return out


def copy_workers(src: RepoStorage, dst: RepoStorage) -> int:
    local = src.root.capabilities.local and dst.root.capabilities.local
    return io_workers_for(local)


def copy_needs(
    src: RepoStorage,
    dst: RepoStorage,
    names: Sequence[str] | None = None,
    *,
    force: bool = False,
) -> CopyNeeds:
    """What copying ``names`` (default: every snapshot of ``src``) to ``dst`` sends.

    Reads refs and manifests and asks ``dst`` whether each object exists; writes
    nothing. Raises :class:`SnapshotExistsError` when ``dst`` holds a name with
    another manifest and ``force`` is false, :class:`SnapshotNotFoundError` for a
    name ``src`` lacks. The answers hold while a lease on ``dst`` is held
    (:func:`copy` plans under one); a dry run's plan may be stale.
    """
    chosen = list(names) if names is not None else src.list_snapshots()
    resolved = _resolve(src, dst, chosen, force)
    present: set[str] = set()  # object keys the destination has
    checked_parents: set[str] = set()
    refs: dict[str, tuple[ChunkRef, ...]] = {}
    plans: list[SnapshotCopy] = []
    reached_all: set[str] = set()
    with ThreadPoolExecutor(
        max(1, copy_workers(src, dst)), thread_name_prefix="casnap-copy"
    ) as pool:
        for name, m, state in resolved:
            if state == "present":
                plans.append(SnapshotCopy(name, m, state, objects=0))
                continue
            _, manifest = read_manifest_bytes(src, m)
            reached = reached_objects(manifest)
            reached_all.update(reached)
            if dst.store.exists(manifest_key(m)):  # whole: every manifest in a store is
                present.update(reached)
                plans.append(SnapshotCopy(name, m, state, len(reached), manifest_present=True))
                continue
            for parent in manifest.parents:  # an earlier copy's objects: no need to ask
                if parent not in checked_parents:
                    checked_parents.add(parent)
                    present.update(_objects_there(dst, parent))
            unknown = [k for k in reached if k not in present and k not in refs]
            found = dict(zip(unknown, pool.map(dst.store.exists, unknown)))
            present.update(k for k, there in found.items() if there)
            missing = tuple(k for k in reached if k not in present)
            for k in missing:
                refs[k] = tuple(reached[k])
            plans.append(
                SnapshotCopy(
                    name,
                    m,
                    state,
                    len(reached),
                    missing,
                    bytes_to_send=sum(estimate(reached[k]) for k in missing),
                )
            )
    return CopyNeeds(src.url, dst.url, tuple(plans), len(reached_all - refs.keys()), refs)


def _objects_there(dst: RepoStorage, m: str) -> set[str]:
    """The objects of manifest ``m`` if ``dst`` has it (then it has them all), else none."""
    try:
        return set(reached_objects(dst.read_manifest(m)))
    except CasnapError:  # absent or unreadable there: learn nothing from it
        return set()
