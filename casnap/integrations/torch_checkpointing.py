"""casnap as the storage of torch_checkpointing's ``CheckpointManager``.

docs/torch_checkpointing.md has the lines a user changes.

``CheckpointManager.Config(storage_config=CasnapStorageConfig(root))``: every
checkpoint id ``<root>/<name>`` is one casnap snapshot holding the library's
files (a file is stored as :mod:`casnap.integrations.file_entries` says:
chunks the repository lacks written, every read verified). The library writes
a checkpoint into ``<root>/tmp_<name>`` and renames it onto ``<root>/<name>``
(``Storage.rename``, its commit point); here nothing is visible before that
rename, which writes the manifest, then the ref (create-only: a rename onto
an existing checkpoint raises ``FileExistsError``, as the contract asks).

On several ranks each rank's process stores its own files and posts their
entries to the c10d store (:class:`casnap.distributed.group.Rendezvous`);
rank 0, which renames after the library's barrier, collects every rank's.
Rank 0 holds the save's lease; another rank begins writing only once rank 0's
lease is live, so gc stays out of every rank's dedup until the commit.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from typing_extensions import Buffer

from casnap.distributed.group import Group, Rendezvous, resolve_group
from casnap.errors import ConfigError, SnapshotExistsError, SnapshotNotFoundError
from casnap.format.entries import ContainerEntry, Entry
from casnap.format.manifest import Manifest
from casnap.integrations.dcp_layout import FILES_METADATA, containers, path_key
from casnap.integrations.file_entries import WriteStream, entry_size, open_entry, store_segments
from casnap.repo.lease_record import LEASES
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage, now_iso
from casnap.settings import Settings, dist_timeout
from casnap.take.commit import commit_snapshot
from casnap.take.parent import parent_rule
from casnap.take.session import Session
from casnap.take.target import TakeOptions, take_settings

TORCH_CHECKPOINTING = "torch_checkpointing"  # manifest metadata: which library wrote it
_CACHED_MANIFESTS = 4


@dataclass
class CasnapStorageConfig(StorageConfig):
    """torch_checkpointing's ``StorageConfig`` for a casnap repository at ``root``.

    ``root`` is the folder (or URL) the checkpoint ids live in; ``storage_options``
    are those of a take (``chunk_size``, ``compression``, ``repository``, a store's).
    It pickles as these two fields: the library's writer process opens the
    repository itself. Example::

        from torch_checkpointing import CheckpointManager
        from casnap.integrations.torch_checkpointing import CasnapStorageConfig

        manager = CheckpointManager.Config(storage_config=CasnapStorageConfig("/ckpt/run1")).build()
        manager.save("/ckpt/run1/step_100", {"model": model.state_dict()})
    """

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def create_storage(self) -> CasnapStorage:
        return CasnapStorage(self)


@dataclass
class _Save:
    """One checkpoint being written (``<root>/tmp_<name>``) until its rename."""

    repo: RepoStorage
    settings: Settings
    lease: Lease | None  # rank 0's; None on the other ranks
    parents: list[str]
    group: Group
    exchange: Rendezvous
    files: dict[str, Entry] = field(default_factory=dict)
    failed: bool = False  # a file failed to be stored: this save can no longer commit


class CasnapStorage(Storage):
    """``Storage`` over casnap snapshots: one per checkpoint folder of ``root``."""

    def __init__(self, config: CasnapStorageConfig) -> None:
        self.root = os.fspath(config.root).rstrip("/") or "/"
        self.take_options = TakeOptions.split(dict(config.storage_options))
        self.overrides = self.take_options.settings
        self.session = Session()
        self._saves: dict[str, _Save] = {}
        self._manifests: dict[str, Manifest] = {}  # by hash: immutable
        self._guard = threading.Lock()

    # -- paths -----------------------------------------------------------
    def _split(self, path: Path | str) -> tuple[str, str]:
        """``(checkpoint folder name, file path inside it)``; ``("", "")`` for the root."""
        text = os.fspath(path).rstrip("/")
        if text == self.root:
            return "", ""
        if not text.startswith(self.root.rstrip("/") + "/"):
            raise ConfigError(f"{text} is not inside the casnap storage root {self.root}")
        name, _, rel = text[len(self.root.rstrip("/")) + 1 :].partition("/")
        return name, rel

    def _locate(self, name: str, create: bool) -> tuple[RepoStorage, str]:
        chunk = Settings.from_env().with_overrides(**self.overrides).chunk_size
        where = f"{self.root.rstrip('/')}/{name}"
        if create:
            return self.take_options.locate(where, create=True, chunk_size=chunk)
        return self.take_options.locate(where, create=False, existing=True)

    def _manifest(self, name: str) -> tuple[RepoStorage, Manifest] | None:
        """The committed checkpoint ``name``: its ref read at every call, its manifest
        parsed once (a load asks for it several times per file)."""
        try:
            repo, snap = self._locate(name, create=False)
            digest = repo.resolve(snap)
        except SnapshotNotFoundError:
            return None
        with self._guard:
            manifest = self._manifests.get(digest)
        if manifest is None:
            manifest = repo.read_manifest(digest)
            with self._guard:
                while len(self._manifests) >= _CACHED_MANIFESTS:
                    del self._manifests[next(iter(self._manifests))]
                self._manifests[digest] = manifest
        return repo, manifest

    def _entry(self, path: Path | str) -> tuple[RepoStorage | None, Entry | None]:
        """What ``path`` is: an entry of a committed or pending checkpoint, or nothing."""
        name, rel = self._split(path)
        with self._guard:
            save = self._saves.get(name)
        if save is not None:
            return save.repo, save.files.get(rel)
        found = self._manifest(name)
        if found is None:
            return None, None
        return found[0], found[1].entries.get(path_key(tuple(rel.split("/"))))

    # -- writing ---------------------------------------------------------
    def _begin(self, name: str) -> _Save:
        group = resolve_group(None)
        if not group.distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "a multi-rank save through casnap needs the default process group in the "
                "process that writes (SyncCheckpointSaverConfig, or a subprocess_init_fn "
                "that initializes it): each rank's files reach rank 0 through its store"
            )
        repo, snap = self._locate(name, create=True)
        settings = take_settings(repo, self.overrides)
        fresh, repo.created = repo.created, False
        where = hashlib.sha256(f"{repo.url}\0{snap}".encode()).hexdigest()[:24]
        exchange = Rendezvous(group, f"tcp-{where}")
        lease = None
        if group.rank == 0:
            lease = acquire_lease(repo.store, kind="take")
            exchange.post("lease", 0, lease.id)
        else:
            _wait_for_lease(repo, exchange)  # rank 0's: it keeps gc out until the commit
            exchange.post("files", group.rank, {})
        try:
            rule = parent_rule(repo, None, self.session, settings, fresh, own_session=True)
            parents = rule.choose(repo, snap)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        save = _Save(repo, settings, lease, parents, group, exchange)
        with self._guard:
            self._saves[name] = save
        return save

    def _save_of(self, name: str) -> _Save:
        with self._guard:
            save = self._saves.get(name)
        if save is None:
            return self._begin(name)
        if save.failed:
            raise OSError(errno.EIO, f"the save of {name} failed: an earlier file was not stored")
        return save

    def _abandon(self, name: str) -> None:
        with self._guard:
            save = self._saves.pop(name, None)
        if save is not None and save.lease is not None:
            save.exchange.discard("lease", 0)
            save.lease.release()

    def _stored(self, path: Path | str, segments: list[bytearray]) -> None:
        name, rel = self._split(path)
        if not rel:
            raise IsADirectoryError(errno.EISDIR, "a checkpoint folder is not a file", str(path))
        if self._manifest(name) is not None:
            raise PermissionError(errno.EACCES, "a committed checkpoint is immutable", str(path))
        save = self._save_of(name)
        try:
            entry = store_segments(save.repo, save.settings, save.parents, segments)
        except BaseException:
            save.failed = True  # its lease goes now: gc need not wait for a save that is over
            if save.lease is not None:
                save.lease.release()
            raise
        with self._guard:
            save.files[rel] = entry
            mine = dict(save.files)
        if save.lease is None:  # a rank other than 0: its files so far, for rank 0
            save.exchange.post("files", save.group.rank, mine)

    def stream_write(self, path: Path) -> io.IOBase:
        self._split(path)  # refuse a path outside the root before any byte is taken
        return WriteStream(lambda segments: self._stored(path, segments))

    def write(self, path: Path, data: Buffer) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        name, _ = self._split(path)
        with self._guard:
            failed = name in self._saves and self._saves[name].failed
        if failed:
            self._abandon(name)  # the library starts the save again: afresh
        if name and self._manifest(name) is None:
            self._save_of(name)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        """The commit: a pending checkpoint folder becomes snapshot ``dst_path``."""
        (src, src_rel), (dst, dst_rel) = self._split(src_path), self._split(dst_path)
        with self._guard:
            save = self._saves.get(src)
        if save is None or save.failed:
            raise FileNotFoundError(errno.ENOENT, "no checkpoint being written", str(src_path))
        if src_rel or dst_rel:
            if src != dst or src_rel not in save.files:
                raise OSError(errno.EXDEV, "casnap renames files only inside one checkpoint")
            with self._guard:
                save.files[dst_rel] = save.files.pop(src_rel)
            return
        try:
            self._commit(save, dst)
        finally:
            self._abandon(src)

    def _commit(self, save: _Save, dst: str) -> None:
        if save.lease is None:
            raise ConfigError("a multi-rank casnap checkpoint is committed by rank 0")
        files = dict(save.files)
        others = [r for r in range(save.group.size) if r != save.group.rank]
        got, missing = save.exchange.collect("files", others, dist_timeout())
        if missing:
            raise ConfigError(f"ranks {missing} never handed their files to rank 0")
        for value in got.values():
            files.update(value)
        entries: dict[str, Entry] = {path_key(tuple(r.split("/"))): e for r, e in files.items()}
        entries.update(containers(entries))
        repo, snap = self._locate(dst, create=True)
        manifest = Manifest(
            created_at=now_iso(),
            world_size=save.group.size,
            parents=list(save.parents),
            metadata={FILES_METADATA: {"version": 1}, TORCH_CHECKPOINTING: {"version": 1}},
            entries=entries,
        )
        try:
            commit_snapshot(repo, snap, manifest, lease=save.lease, session=self.session)
        except SnapshotExistsError as exc:
            raise FileExistsError(errno.EEXIST, "the checkpoint exists", dst) from exc
        for r in others:
            save.exchange.discard("files", r)

    def delete(self, path: Path) -> None:
        name, rel = self._split(path)
        with self._guard:
            save = self._saves.get(name)
            if save is not None and rel in save.files:
                del save.files[rel]
                return
        raise PermissionError(errno.EACCES, "files of a committed checkpoint stay", str(path))

    def rmdir(self, path: Path) -> None:
        """A checkpoint folder: its snapshot's ref goes (gc reclaims what only it held)."""
        name, rel = self._split(path)
        if not name or rel:
            raise OSError(errno.EPERM, "casnap removes whole checkpoints", str(path))
        with self._guard:
            pending = name in self._saves
        if pending:
            self._abandon(name)
            return
        repo, snap = self._locate(name, create=False)
        repo.delete_ref(snap)

    # -- reading ---------------------------------------------------------
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        repo, entry = self._entry(path)
        if repo is None or entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        stream = open_entry(repo, entry, str(path))
        if read_args is None or read_args.pre_read_full_file:
            with stream:
                stream = io.BytesIO(stream.read())
        # BytesIO and BufferedReader: readinto and seek, all the library asks of a RawIOBase
        return cast(io.RawIOBase, stream)

    def getsize(self, path: Path) -> int:
        _, entry = self._entry(path)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        return entry_size(entry, str(path))

    def exists(self, path: Path) -> bool:
        return self.isdir(path) or self._entry(path)[1] is not None

    def isdir(self, path: Path) -> bool:
        name, rel = self._split(path)
        if not name:
            return True
        if not rel:
            with self._guard:
                if name in self._saves:
                    return True
            return self._manifest(name) is not None
        return isinstance(self._entry(path)[1], ContainerEntry) or bool(self.ls(path))

    def ls(self, path: Path) -> list[str]:
        name, rel = self._split(path)
        if not name:
            with self._guard:
                pending = list(self._saves)
            try:  # the repository a save would use; a shared one above names them "run1/..."
                repo, probe = self.take_options.locate(f"{self.root.rstrip('/')}/x", create=False)
            except SnapshotNotFoundError:
                return sorted(pending)
            prefix = probe[:-1]
            names = [n[len(prefix) :] for n in repo.list_snapshots() if n.startswith(prefix)]
            return sorted({n for n in names if "/" not in n} | set(pending))
        with self._guard:
            save = self._saves.get(name)
        if save is not None:
            keys = list(save.files)
        else:
            found = self._manifest(name)
            if found is None:
                raise FileNotFoundError(errno.ENOENT, "no such checkpoint", str(path))
            keys = [k.split("/", 1)[1] for k in found[1].entries if k.count("/") >= 1]
        below = f"{rel}/" if rel else ""
        return sorted({k[len(below) :].split("/")[0] for k in keys if k.startswith(below)})

    def remap_path(self, path: Path) -> str:
        return os.fspath(path)


def _wait_for_lease(repo: RepoStorage, exchange: Rendezvous) -> None:
    """(ranks other than 0) Until rank 0's lease for this checkpoint is live."""
    deadline = time.monotonic() + dist_timeout()
    while True:
        got, _ = exchange.collect("lease", [0], max(0.0, deadline - time.monotonic()))
        if 0 in got and repo.store.exists(f"{LEASES}/{got[0]}"):
            return
        if time.monotonic() >= deadline:
            raise ConfigError("rank 0 took no lease for this checkpoint in time")
        time.sleep(0.05)
