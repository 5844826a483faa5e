"""Pointer files: where a training library expects a checkpoint file, the snapshot it names.

A pointer is a small JSON naming the repository (relative to the pointer's
directory when local), the snapshot and its manifest hash; a reader refuses a
snapshot replaced since. It is written atomically after the snapshot's ref,
so it always names a complete snapshot (docs/lightning-hf.md, "How a
checkpoint maps to a snapshot").

:class:`Retirer` deletes snapshots and reclaims what only they used, retrying
a reclaim that had to wait for a take in flight at the next call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from casnap.api.repository import Repository
from casnap.errors import CasnapError, SnapshotExistsError, SnapshotNotFoundError
from casnap.store.local import fsync_dir

if TYPE_CHECKING:
    from casnap.api.snapshot import Snapshot

log = logging.getLogger(__name__)

__all__ = [
    "MAX_POINTER_BYTES",
    "Pointer",
    "Retirer",
    "is_url",
    "read_pointer",
    "replace_file",
    "retire_unpointed",
    "take_versioned",
    "write_pointer",
]

MAX_POINTER_BYTES = 64 * 1024  # a pointer is a few hundred bytes; a checkpoint file is larger
_VERSION = 1
_MAX_VERSIONS = 1000  # name@1 ... name@999 for the re-saves of one path


@dataclass(frozen=True)
class Pointer:
    """A snapshot named by a pointer file: its repository (URL or path), name and manifest."""

    repository: str
    snapshot: str
    manifest: str

    def open_repository(self, storage_options: dict[str, Any] | None = None) -> Repository:
        return Repository(self.repository, storage_options)

    def open_current(self, where: str) -> Repository:
        """:meth:`open_repository`, refusing a snapshot replaced since the pointer at
        ``where`` was written (:class:`casnap.SnapshotNotFoundError`)."""
        repo = self.open_repository()
        if repo.storage.resolve(self.snapshot) != self.manifest:
            raise SnapshotNotFoundError(
                f"{where} names snapshot {self.snapshot!r} of manifest {self.manifest}, but "
                f"{repo.url} holds another snapshot under that name now",
                self.snapshot,
            )
        return repo


def is_url(path: str) -> bool:
    return "://" in path


def _fs(path: str) -> tuple[Any, str]:
    import fsspec

    fs, stripped = fsspec.core.url_to_fs(path)
    return fs, stripped


def read_pointer(path: str, kind: str) -> Pointer | None:
    """The pointer at ``path`` (following a symbolic link), or None if ``path`` is not one.

    None for a file that is not a casnap pointer of ``kind`` (a ``torch.save``
    checkpoint written before switching to casnap); FileNotFoundError if there
    is no file at ``path``.
    """
    if is_url(path):
        fs, stripped = _fs(path)
        with fs.open(stripped, "rb") as f:
            head = f.read(MAX_POINTER_BYTES + 1)
        base = path.rsplit("/", 1)[0]
    else:
        with open(path, "rb") as f:
            head = f.read(MAX_POINTER_BYTES + 1)
        base = os.path.dirname(os.path.realpath(path))
    if len(head) > MAX_POINTER_BYTES or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("casnap") != kind:
        return None
    repo, name, manifest = doc.get("repository"), doc.get("snapshot"), doc.get("manifest")
    if not all(isinstance(v, str) and v for v in (repo, name, manifest)):
        return None
    assert isinstance(repo, str) and isinstance(name, str) and isinstance(manifest, str)
    if not is_url(repo):
        repo = repo if os.path.isabs(repo) else os.path.normpath(os.path.join(base, repo))
    return Pointer(repo, name, manifest)


def write_pointer(path: str, pointer: Pointer, kind: str) -> None:
    """Write the pointer at ``path`` atomically (replacing what is there)."""
    repo = pointer.repository
    if not is_url(path) and not is_url(repo):
        repo = os.path.relpath(repo, os.path.dirname(os.path.abspath(path)))
    body = (
        json.dumps(
            {
                "casnap": kind,
                "version": _VERSION,
                "repository": repo,
                "snapshot": pointer.snapshot,
                "manifest": pointer.manifest,
            },
            indent=1,
        ).encode()
        + b"\n"
    )
    if is_url(path):
        fs, stripped = _fs(path)
        fs.pipe_file(stripped, body)  # one object put: atomic on object stores
        return
    replace_file(path, body)


def replace_file(path: str, body: bytes) -> None:
    """Replace the local file ``path`` by ``body`` atomically and durably: after a power
    cut it holds ``body`` or what it held before. A symbolic link (Lightning's
    last.ckpt) is replaced, never written through."""
    tmp = f"{path}.casnap-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))  # the rename too survives a power cut
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def take_versioned(path: str, app_state: dict[str, Any], **kwargs: Any) -> Snapshot:
    """``Snapshot.take`` at ``path``, or at ``path@1``, ``path@2``, ... if that name is taken.

    Snapshots are immutable, but a library saves again to the same path (Lightning's
    ``last.ckpt``, a resumed run's ``checkpoint-N``): the new snapshot gets the
    first free version, the caller moves its pointer to it and retires the old one.
    In a process group of several ranks (every rank calls it), rank 0 picks the
    version and sends it to the others: a distributed take reports a taken name
    to every rank as a failure of rank 0, not as :class:`SnapshotExistsError`.
    """
    from casnap.api.snapshot import Snapshot  # the torch layer
    from casnap.distributed.group import resolve_group

    group = resolve_group(kwargs.get("pg"))
    if group.distributed:
        return Snapshot.take(_free_version(path, group, kwargs), app_state, **kwargs)
    for version in range(_MAX_VERSIONS):
        target = path if version == 0 else f"{path}@{version}"
        try:
            return Snapshot.take(target, app_state, **kwargs)
        except SnapshotExistsError:
            continue  # an earlier save of this path holds the name: take the next
    raise SnapshotExistsError(f"{path}: {_MAX_VERSIONS} versions exist", path)


def _free_version(path: str, group: Any, kwargs: dict[str, Any]) -> str:
    """The first of ``path``, ``path@1``, ... free in its repository, as rank 0 finds it."""
    import torch.distributed as dist

    from casnap.repo.repository import RepoStorage
    from casnap.take.target import TakeOptions

    choice = [path]
    if group.rank == 0:
        options = TakeOptions.of(
            kwargs.get("storage_options"), kwargs.get("settings"), kwargs.get("repository")
        )
        repo: RepoStorage | None
        try:
            repo, name = options.locate(path, create=False)
        except CasnapError:
            repo, name = None, ""  # no repository yet: the take creates one (or says why not)
        version = 0
        while repo is not None and version < _MAX_VERSIONS - 1:
            if not repo.has_ref(name if version == 0 else f"{name}@{version}"):
                break
            version += 1  # past the last, the take itself fails on every rank
        choice = [path if version == 0 else f"{path}@{version}"]
    dist.broadcast_object_list(choice, src=dist.get_global_rank(group.pg, 0), group=group.pg)
    return str(choice[0])


def retire_unpointed(
    repo: Repository,
    retirer: Retirer,
    kind: str,
    prefix: str,
    pointed: Callable[[str, dict[str, Any]], bool],
) -> list[str]:
    """Retire the snapshots an integration took whose checkpoint no pointer names any more.

    The candidates are the snapshots named ``prefix<name>`` whose metadata holds
    a dict under ``kind`` (what the integration recorded: its tag or folder);
    ``pointed(name, that dict)`` says whether the library's file layout still
    names the snapshot (a folder rotated away, or re-pointed by a re-save, does
    not). Returns the names still pointed at, oldest first.
    """
    live = []
    for line in repo.log():
        name, meta = line.name, line.metadata.get(kind)
        if not name.startswith(prefix) or "/" in name[len(prefix) :]:
            continue
        if not isinstance(meta, dict):
            continue  # not a snapshot of this integration
        if pointed(name, meta):
            live.append(name)
        else:
            retirer.retire(repo, name, None)
    return live


class Retirer:
    """Deletes snapshots and reclaims their space at once, safely beside takes in flight.

    A reclaim waits at most ``wait_seconds`` for takes in flight (another
    thread's save, another process's take); if they stay, it is deferred and
    retried by the next :meth:`retire` or :meth:`flush`, so the space is freed
    one call later. Thread-safe.
    """

    def __init__(self, wait_seconds: float = 1.0) -> None:
        self.wait_seconds = wait_seconds
        self._lock = threading.Lock()
        # url -> (repo, manifests): kept until a reclaim has freed them, so that a
        # save finishing in another thread meanwhile can flush them too.
        self._pending: dict[str, tuple[Repository, set[str]]] = {}
        self.bytes_freed = 0

    def retire(self, repo: Repository, name: str, manifest: str | None) -> None:
        """Delete snapshot ``name`` if it still names ``manifest`` (any, if None); reclaim it."""
        try:
            current = repo.storage.resolve(name)
        except SnapshotNotFoundError:
            current = None
        if current is not None and manifest is not None and current != manifest:
            log.warning("casnap: snapshot %r in %s was replaced since; it is kept", name, repo.url)
            return
        if current is not None:
            repo.delete(name)
            manifest = current
        if manifest is not None:
            # Pending until a reclaim frees it: a save ending in another thread
            # meanwhile flushes it too (ours may be deferred by that very save).
            with self._lock:
                self._pending.setdefault(repo.url, (repo, set()))[1].add(manifest)
        self.flush()

    def flush(self, wait_seconds: float | None = None) -> None:
        """Reclaim what earlier calls retired (each repository once)."""
        with self._lock:
            work = [(url, repo, sorted(ms)) for url, (repo, ms) in self._pending.items() if ms]
        wait = self.wait_seconds if wait_seconds is None else wait_seconds
        for url, repo, manifests in work:
            try:
                result = repo.reclaim(manifests, wait_seconds=wait)
            except CasnapError as exc:
                log.warning("casnap: reclaim in %s failed, retried next time: %s", url, exc)
                continue
            if result.deferred is not None:
                log.info("casnap: reclaim in %s deferred: %s", url, result.deferred)
                continue
            with self._lock:
                self.bytes_freed += result.bytes_freed
                self._pending[url][1].difference_update(manifests)

    @property
    def pending(self) -> int:
        """How many retired manifests still wait for their reclaim."""
        with self._lock:
            return sum(len(m) for _, m in self._pending.values())
