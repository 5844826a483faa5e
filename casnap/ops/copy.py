"""Copy snapshots from one repository to another: only what is missing, verified, resumable.

Plan, then execute (docs/copy.md):

- :func:`plan_copy` resolves each snapshot to its manifest, refuses a name
  the destination holds with other content (unless ``force``), and lists the
  objects the manifest reaches (:func:`casnap.repo.reach.reached_objects`,
  the definition gc marks by) that the destination lacks, by asking the
  destination whether each key exists. A manifest already at the destination
  needs nothing (every manifest in a store is whole: docs/gc.md), and neither
  do the objects of its parents' manifests found there.
- :func:`execute_copy` fetches each missing object from the source, checks
  its bytes against its name (a pack: the blake3 of its bytes; a loose
  chunk: its frame decodes to bytes whose blake3 is the chunk's hash) and
  only then puts it at the destination, create-only. Once a snapshot's
  objects are durable it writes the manifest (the same bytes, so the same
  name) and then the ref: the commit point. A damaged or missing source
  object fails the snapshots needing it, which stay invisible at the
  destination; the others are copied.

:func:`copy` holds a lease on the destination from the first existence
check to the last ref, as a take does, so a gc there cannot delete an object
the copy has found present (or just sent) before the ref that reaches it
lands. An interrupted copy leaves only unreferenced objects; run again, it
finds them present and sends the rest.

Example::

    from casnap.ops.copy import copy

    result = copy("/ckpt/run1", "gs://bucket/run1")       # every snapshot
    print(result.render())
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

from casnap.chunks.decode import decode_frame
from casnap.chunks.stored import contain, frame_limit
from casnap.display import format_size
from casnap.errors import (
    CasnapError,
    CopyIntegrityError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.format.manifest import Manifest
from casnap.format.names import hash_bytes
from casnap.format.parse import MAX_MANIFEST_BYTES, parse_manifest
from casnap.repo.leases import Lease, hold_lease
from casnap.repo.reach import reached_objects
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.settings import default_memory_budget, io_workers_for
from casnap.store import open_store

Progress = Callable[[int, int], None]  # (bytes done, bytes in all), estimated from the manifests
State = Literal["new", "present", "replace"]

# A pack is read whole to check its name; casnap writes packs of a few MiB
# (pack_target). Refusing anything larger bounds what a planted object costs.
MAX_PACK_BYTES = 2 << 30


@dataclass(frozen=True)
class SnapshotCopy:
    """One snapshot in a :class:`CopyPlan`.

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
class CopyPlan:
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
        return sum(_estimate(self.refs[k]) for k in self.to_send)

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


@dataclass(frozen=True)
class CopyResult:
    """What a copy did. ``objects_present``: objects not sent because the destination had them."""

    src: str
    dst: str
    copied: tuple[str, ...] = ()  # snapshots whose ref was written (or replaced)
    present: tuple[str, ...] = ()  # already there with the same manifest
    failed: tuple[tuple[str, str], ...] = ()  # (snapshot, why): not visible at the destination
    objects_sent: int = 0
    bytes_sent: int = 0
    objects_present: int = 0
    manifests_sent: int = 0
    plan: CopyPlan | None = field(default=None, compare=False)  # what was planned
    dry_run: bool = False  # planned only: nothing was sent

    def render(self) -> str:
        if self.dry_run and self.plan is not None:
            return self.plan.render() + "\n(dry run: nothing was sent)"
        lines = [
            f"copied {len(self.copied)} snapshot(s) from {self.src} to {self.dst}"
            + (f", {len(self.present)} already there" if self.present else ""),
            f"  sent {self.objects_sent} object(s), {format_size(self.bytes_sent)}, and "
            f"{self.manifests_sent} manifest(s); {self.objects_present} object(s) skipped as "
            "present",
        ]
        lines += [f"  not copied: {name}: {why}" for name, why in self.failed]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "copied": list(self.copied),
            "present": list(self.present),
            "failed": dict(self.failed),
            "objects_sent": self.objects_sent,
            "bytes_sent": self.bytes_sent,
            "objects_present": self.objects_present,
            "manifests_sent": self.manifests_sent,
            "dry_run": self.dry_run,
            "plan": self.plan.to_json() if self.plan else None,
        }


def _estimate(refs: Sequence[ChunkRef]) -> int:
    """The stored size of the object holding ``refs``: exact for a loose chunk, the extent
    of its referenced frames for a pack."""
    return max(r.offset + r.length for r in refs)


# -- planning ----------------------------------------------------------------


def _read_manifest_bytes(repo: RepoStorage, m: str) -> tuple[bytes, Manifest]:
    try:
        data = repo.store.get(manifest_key(m), limit=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError as exc:
        raise SnapshotNotFoundError(f"manifest {m} is missing from {repo.url}") from exc
    return data, parse_manifest(data, m)  # checks the bytes against the name


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


def _workers(src: RepoStorage, dst: RepoStorage) -> int:
    local = src.root.capabilities.local and dst.root.capabilities.local
    return io_workers_for(local)


def plan_copy(
    src: RepoStorage,
    dst: RepoStorage,
    names: Sequence[str] | None = None,
    *,
    force: bool = False,
) -> CopyPlan:
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
    with ThreadPoolExecutor(max(1, _workers(src, dst)), thread_name_prefix="casnap-copy") as pool:
        for name, m, state in resolved:
            if state == "present":
                plans.append(SnapshotCopy(name, m, state, objects=0))
                continue
            _, manifest = _read_manifest_bytes(src, m)
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
                    bytes_to_send=sum(_estimate(reached[k]) for k in missing),
                )
            )
    return CopyPlan(src.url, dst.url, tuple(plans), len(reached_all - refs.keys()), refs)


def _objects_there(dst: RepoStorage, m: str) -> set[str]:
    """The objects of manifest ``m`` if ``dst`` has it (then it has them all), else none."""
    try:
        return set(reached_objects(dst.read_manifest(m)))
    except CasnapError:  # absent or unreadable there: learn nothing from it
        return set()


# -- executing ---------------------------------------------------------------


def _fetch_verified(src: RepoStorage, key: str, refs: Sequence[ChunkRef]) -> bytes:
    """The bytes of object ``key`` of ``src``, checked against its name; IntegrityError if not.

    A damaged frame is recorded in ``src`` (docs/damage.md), as any verified read does.
    """
    where = f"{src.url}: {key}"
    try:
        if refs[0].pack is not None:
            data = src.store.get(key, limit=MAX_PACK_BYTES)
            if hash_bytes(data) == refs[0].pack:
                return data
            _contain_pack(src, key, data, refs)
            raise IntegrityError(f"{where}: the pack's bytes do not match its name (damaged)", key)
        ref = refs[0]
        data = src.store.get(key, limit=frame_limit(ref))  # any valid frame of the chunk
        try:
            decode_frame(src, key, ref, data)  # contains what fails its check
        except IntegrityError as exc:
            raise IntegrityError(f"{src.url}: {exc}", key) from exc
        return data
    except ObjectNotFoundError as exc:
        raise IntegrityError(f"{where} is missing from the source", key) from exc


def _contain_pack(src: RepoStorage, key: str, data: bytes, refs: Sequence[ChunkRef]) -> None:
    """Record which referenced frames of a damaged pack fail their check."""
    for ref in refs:
        frame = data[ref.offset : ref.offset + ref.length]
        try:
            codec.decode(frame, key, bytes.fromhex(ref.hash), ref.size)
        except IntegrityError as exc:
            contain(src, ref, exc)


@dataclass
class _Tally:
    sent: set[str] = field(default_factory=set)
    bad: dict[str, str] = field(default_factory=dict)  # key -> why
    bytes_sent: int = 0
    done_estimate: int = 0


def _send(src: RepoStorage, dst: RepoStorage, key: str, refs: Sequence[ChunkRef]) -> int:
    data = _fetch_verified(src, key, refs)
    try:
        dst.store.put(key, data, create_only=True, durable=False)
    except ObjectExistsError:
        pass  # another writer put the same bytes (objects are immutable)
    return len(data)


def execute_copy(
    src: RepoStorage,
    dst: RepoStorage,
    plan: CopyPlan,
    *,
    lease: Lease | None = None,
    progress: Progress | None = None,
) -> CopyResult:
    """Send what ``plan`` lists and commit each snapshot (manifest, then ref) once its
    objects are durable. Call it holding ``lease`` on ``dst`` (as :func:`copy` does).

    A snapshot needing a damaged or missing source object is not committed and
    is listed in ``CopyResult.failed``; a store error stops the copy (what was
    sent stays, unreferenced; a rerun finds it present).
    """
    tally = _Tally()
    total = plan.bytes_to_send
    copied: list[str] = []
    present: list[str] = []
    failed: list[tuple[str, str]] = []
    manifests_sent = 0
    budget = default_memory_budget()
    largest = max((_estimate(r) for r in plan.refs.values()), default=1)
    workers = max(1, min(_workers(src, dst), budget // max(largest, 1)))
    with ThreadPoolExecutor(workers, thread_name_prefix="casnap-copy") as pool:
        for snap in plan.snapshots:
            if snap.state == "present":
                present.append(snap.name)
                continue
            _send_all(src, dst, plan, snap, pool, tally, total, progress)
            broken = [k for k in snap.missing if k in tally.bad]
            if broken:
                failed.append((snap.name, tally.bad[broken[0]]))
                continue
            dst.store.flush()  # the objects are durable before anything names them
            if not snap.manifest_present:
                data, _ = _read_manifest_bytes(src, snap.manifest)
                try:
                    dst.store.put(manifest_key(snap.manifest), data, create_only=True)
                    manifests_sent += 1
                except ObjectExistsError:
                    pass  # same name, same bytes
            if lease is not None:
                lease.check()  # a stalled copy may have been declared dead: no commit
            if snap.state == "replace":
                dst.delete_ref(snap.name)  # --force: the name is absent until the next line
            dst.write_ref(snap.name, snap.manifest)  # the commit point
            copied.append(snap.name)
    return CopyResult(
        plan.src,
        plan.dst,
        tuple(copied),
        tuple(present),
        tuple(failed),
        objects_sent=len(tally.sent),
        bytes_sent=tally.bytes_sent,
        objects_present=plan.objects_present,
        manifests_sent=manifests_sent,
        plan=plan,
    )


def _send_all(
    src: RepoStorage,
    dst: RepoStorage,
    plan: CopyPlan,
    snap: SnapshotCopy,
    pool: ThreadPoolExecutor,
    tally: _Tally,
    total: int,
    progress: Progress | None,
) -> None:
    """Send the objects of ``snap`` not sent yet; damage goes to ``tally.bad``."""
    todo = [k for k in snap.missing if k not in tally.sent and k not in tally.bad]
    futures: dict[Future[int], str] = {
        pool.submit(_send, src, dst, k, plan.refs[k]): k for k in todo
    }
    error: BaseException | None = None
    for fut in _as_done(futures):
        key = futures[fut]
        try:
            tally.bytes_sent += fut.result()
            tally.sent.add(key)
        except IntegrityError as exc:
            tally.bad[key] = str(exc)
        except BaseException as exc:  # a store error: stop, after the others settle
            if error is None:
                error = exc
                for other in futures:
                    other.cancel()
            continue
        tally.done_estimate += _estimate(plan.refs[key])
        if progress is not None:
            progress(tally.done_estimate, total)
    if error is not None:
        raise error


def _as_done(futures: Iterable[Future[int]]) -> Iterable[Future[int]]:
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when="FIRST_COMPLETED")
        yield from done


def copy(
    src: RepoStorage | str,
    dst: RepoStorage | str,
    names: Sequence[str] | None = None,
    *,
    force: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
) -> CopyResult:
    """Copy snapshots ``names`` (default: all) of ``src`` to ``dst``, creating ``dst`` if absent.

    ``src`` and ``dst`` are repositories or URLs (``dst`` is created with the
    source's chunk size; objects are copied as they are, whatever either
    repository's chunk size or codec settings). Only objects ``dst`` lacks are
    sent, each verified first; each snapshot's ref is written last. Raises
    :class:`CopyIntegrityError` (with ``.failed``) after copying the rest when
    some snapshots need a damaged or missing source object, and
    :class:`SnapshotExistsError` before sending anything when ``dst`` has one
    of the names with other content and ``force`` is false. ``dry_run``: plan
    only (``result.plan``), writing nothing anywhere; ``dst`` is not created.

    Example::

        result = copy("/ckpt/run1", "gs://bucket/run1", ["step_100"])
        print(result.objects_sent, result.bytes_sent)
    """
    if not isinstance(src, RepoStorage):
        src = RepoStorage.open(src, storage_options)
    if not isinstance(dst, RepoStorage):
        dst = open_destination(dst, dst_storage_options, src, create=not dry_run)
    if dry_run:
        plan = plan_copy(src, dst, names, force=force)
        return CopyResult(src.url, dst.url, plan=plan, dry_run=True)
    with hold_lease(dst, kind="copy") as lease:
        plan = plan_copy(src, dst, names, force=force)  # under the lease: answers stay true
        result = execute_copy(src, dst, plan, lease=lease, progress=progress)
    if result.failed:
        listed = "; ".join(f"{name}: {why}" for name, why in result.failed)
        raise CopyIntegrityError(
            f"{len(result.failed)} snapshot(s) not copied to {dst.url}, nothing of them is "
            f"visible there ({len(result.copied)} other(s) copied): {listed}",
            dict(result.failed),
            result,
        )
    return result


def open_destination(
    url: str, options: dict[str, Any] | None, src: RepoStorage, *, create: bool
) -> RepoStorage:
    """The repository at ``url``; absent, a new one with ``src``'s chunk size (``create``),
    or an empty view of it to plan against that creates nothing."""
    if create:
        return RepoStorage.open_or_create(url, options, chunk_size=src.config.chunk_size)
    try:
        return RepoStorage.open(url, options)
    except RepositoryNotFoundError:
        return RepoStorage(open_store(url, options), src.config)  # every lookup: absent
