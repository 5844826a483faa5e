"""Copy snapshots from one repository to another: only what is missing, verified, resumable.

What the destination lacks (:func:`casnap.ops.copy_plan.copy_needs`), then
:func:`execute_copy`: each
missing object is checked against its name before its create-only put, and a
snapshot's manifest and then its ref (the commit point) are written once its
objects are durable. :func:`copy` holds a lease on the destination throughout,
as a take does. docs/copy.md has the rules. Example::

    result = copy("/ckpt/run1", "gs://bucket/run1")       # every snapshot
    print(result.render())
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from typing import Any

from casnap.chunks.decode import decode_frame
from casnap.chunks.stored import contain, frame_limit
from casnap.display import format_size
from casnap.errors import (
    CopyIntegrityError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
)
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.format.names import hash_bytes
from casnap.ops.copy_plan import (
    CopyNeeds,
    SnapshotCopy,
    copy_needs,
    copy_workers,
    estimate,
    read_manifest_bytes,
)
from casnap.repo.leases import Lease, hold_lease
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.settings import default_memory_budget
from casnap.store import open_store

Progress = Callable[[int, int], None]  # (bytes done, bytes in all), estimated from the manifests

# A pack is read whole to check its name; casnap writes packs of a few MiB
# (pack_target). Refusing anything larger bounds what a planted object costs.
MAX_PACK_BYTES = 2 << 30


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
    plan: CopyNeeds | None = field(default=None, compare=False)  # what was planned
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
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        out["failed"] = dict(self.failed)
        return {**out, "plan": self.plan.to_json() if self.plan else None}


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
    plan: CopyNeeds,
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
    largest = max((estimate(r) for r in plan.refs.values()), default=1)
    workers = max(1, min(copy_workers(src, dst), budget // max(largest, 1)))
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
                data, _ = read_manifest_bytes(src, snap.manifest)
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
    plan: CopyNeeds,
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
        tally.done_estimate += estimate(plan.refs[key])
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
        plan = copy_needs(src, dst, names, force=force)
        return CopyResult(src.url, dst.url, plan=plan, dry_run=True)
    with hold_lease(dst, kind="copy") as lease:
        plan = copy_needs(src, dst, names, force=force)  # under the lease: answers stay true
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
