"""``casnap://``: the fsspec protocol that ``dcp.save(sd, checkpoint_id="casnap://...")`` reaches.

DCP picks its writer from a fixed list (``_storage_setup``: ``FileSystemWriter``,
then ``FsspecWriter`` for any id fsspec resolves), so an id alone can only
reach casnap as a file system: ``FsspecWriter`` writes its files here and each
save becomes one casnap snapshot holding them (docs/dcp.md, "By checkpoint id
alone", says why not a routed ``CasnapWriter``). What each call does:

- ``mkdir(<id>)`` (DCP's ``prepare_local_plan``): locate or create the
  repository, take the save's lease (gc sweeps nothing until the ref is
  written) and choose the parents, as ``CasnapWriter`` does;
- a file opened for writing is stored at its close as
  :mod:`casnap.integrations.file_entries` says: cut into segments at every
  ``tell()``, so each of DCP's items keeps its chunks when the items before
  it change size; only chunks the repository lacks are written;
- ``rename(<id>/.metadata.tmp, <id>/.metadata)`` (DCP's last step) writes the
  manifest, then the ref: the commit point. ``rm(<id>/.metadata)`` (DCP's
  step before it) does nothing: the ref is replaced in one atomic step, the
  previous version kept as ``<name>@<12 hex>``;
- reads open the snapshot the id names when ``.metadata`` is opened and serve
  every later file of that load from the same manifest, each chunk verified.

The state of a save lives in the process that makes it (the fsspec instance
pickles as its options only). On several ranks each rank's process stores
its own files; global rank 0 (DCP's coordinator in the default group) holds
the lease from its ``mkdir``, before any rank writes, and at the rename
collects the entries of the files DCP's metadata names from the other ranks
through the c10d store (:class:`casnap.distributed.group.Rendezvous`), each
posted there when its file closed, before DCP gathered the ranks' results.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from casnap.distributed.group import Group, Rendezvous, resolve_group
from casnap.errors import ConfigError, SnapshotNotFoundError
from casnap.format.entries import (
    ContainerEntry,
    Entry,
)
from casnap.format.manifest import Manifest
from casnap.integrations.dcp_layout import FILES_METADATA, containers, path_key
from casnap.integrations.dcp_writer import _commit_replacing
from casnap.integrations.file_entries import WriteStream, entry_size, open_entry, store_segments
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage, now_iso
from casnap.settings import Settings, dist_timeout
from casnap.take.parent import parent_rule
from casnap.take.session import Session
from casnap.take.target import TakeOptions, take_settings
from casnap.torch_io.flatten import encode_primitive

PROTOCOL = "casnap"
METADATA = ".metadata"  # DCP's metadata file: its rename is the commit
# DCP's metadata up to this size is kept in the manifest (a bytes primitive), not as chunks:
# it names the save's uuid, so it differs every time, and an unchanged re-save then writes
# no chunk or pack at all, only its manifest and ref.
INLINE_METADATA = 1 << 20


def strip(path: str | os.PathLike[str]) -> str:
    """The snapshot path (or one of its files) a ``casnap://`` URL names."""
    text = os.fspath(path)
    if text.startswith(f"{PROTOCOL}://"):
        text = text[len(PROTOCOL) + 3 :]
    return text.rstrip("/") or "/"


@dataclass
class _Save:
    """One save in flight: from ``mkdir`` of its id to the rename of its metadata."""

    repo: RepoStorage
    name: str
    settings: Settings
    lease: Lease | None  # global rank 0's (it covers every rank's writes); None on the others
    parents: list[str]
    replaces: str | None
    group: Group
    files: dict[str, Entry] = field(default_factory=dict)
    metadata: bytes = b""  # DCP's .metadata.tmp as written (the coordinator's)
    failed: bool = False  # a file failed to be stored: the save can no longer commit

    def exchange(self) -> Rendezvous:
        """Where the other ranks' file entries reach the coordinator: keyed by the id."""
        where = hashlib.sha256(f"{self.repo.url}\0{self.name}".encode()).hexdigest()[:24]
        return Rendezvous(self.group, f"dcpfs-{where}")


@dataclass
class _Load:
    repo: RepoStorage
    manifest: Manifest


class CasnapFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """``casnap://<snapshot path>/<file>``: DCP's files as a casnap snapshot (docs/dcp.md).

    Its constructor keywords (DCP's ``storage_options``, given to fsspec) are a
    take's three in one dict: its settings (``chunk_size``, ``compression``, ...),
    ``repository``, and the rest the store's options.
    """

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, *args: Any, **storage_options: Any) -> None:
        super().__init__(*args, **storage_options)
        options = dict(storage_options)
        for key in ("skip_instance_cache", "use_listings_cache", "listings_expiry_time"):
            options.pop(key, None)
        self.take_options = TakeOptions.split(options)
        self.session = Session()
        self._saves: dict[str, _Save] = {}
        self._loads: dict[str, _Load] = {}
        self._guard = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return strip(path)

    # -- saving ----------------------------------------------------------
    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._begin(strip(path))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._begin(strip(path))

    def _begin(self, ckpt: str) -> _Save:
        """Start a save to ``ckpt``: the repository, the lease, the parents (every rank)."""
        group = resolve_group(None)
        self._abandon(ckpt)  # an earlier save to it that failed before its commit
        overrides = self.take_options.settings
        new_repo_chunk = Settings.from_env().with_overrides(**overrides).chunk_size
        repo, name = self.take_options.locate(ckpt, create=True, chunk_size=new_repo_chunk)
        settings = take_settings(repo, overrides)
        fresh, repo.created = repo.created, False
        replaces = repo.resolve(name) if repo.has_ref(name) else None
        # Rank 0's mkdir precedes every rank's first write (DCP plans before it writes),
        # so its lease alone keeps gc out of all of them, as CasnapWriter's coordinator's.
        lease = acquire_lease(repo.store, kind="take") if group.rank == 0 else None
        try:
            given = [replaces] if replaces is not None else None
            rule = parent_rule(repo, given, self.session, settings, fresh, own_session=True)
            parents = rule.choose(repo, name)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        save = _Save(repo, name, settings, lease, parents, replaces, group)
        with self._guard:
            if lease is None:  # a rank's earlier saves ended when it handed its files over
                for done in [k for k, v in self._saves.items() if v.lease is None]:
                    del self._saves[done]
            self._saves[ckpt] = save
        return save

    def _abandon(self, ckpt: str) -> None:
        with self._guard:
            save = self._saves.pop(ckpt, None)
        if save is not None and save.lease is not None:
            save.lease.release()

    def _save_of(self, ckpt: str) -> _Save:
        with self._guard:
            save = self._saves.get(ckpt)
        if save is None:
            return self._begin(ckpt)
        if save.failed:
            raise ConfigError(f"the save to {ckpt!r} failed: an earlier file was not stored")
        return save

    def _stored(self, path: str, segments: list[bytearray]) -> None:
        """A written file, closed: its segments' chunks written, its entry staged.

        If it fails, so does the save: its lease is released at once (the
        next save to the id starts afresh) and nothing of it can commit.
        """
        ckpt, file = os.path.split(path)
        save = self._save_of(ckpt)
        try:
            self._store(save, file, segments)
        except BaseException:
            save.failed = True
            if save.lease is not None:
                save.lease.release()
            raise
        if save.lease is None and not file.startswith(METADATA):  # a rank other than 0
            with self._guard:
                entry = save.files[file]
            save.exchange().post(file, 0, entry)  # one rank writes each file: slot 0

    def _store(self, save: _Save, file: str, segments: list[bytearray]) -> None:
        settings, repo = save.settings, save.repo
        segments = [s for s in segments if s]
        if file.startswith(METADATA):
            save.metadata = b"".join(segments)
        if file.startswith(METADATA) and len(save.metadata) <= INLINE_METADATA:
            inline = encode_primitive(b"".join(segments))
            assert inline is not None  # bytes always are a primitive
            with self._guard:
                save.files[file] = inline
            return
        entry = store_segments(repo, settings, save.parents, segments)
        with self._guard:
            save.files[file] = entry

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        src, dst = strip(path1), strip(path2)
        ckpt, file = os.path.split(dst)
        if file != METADATA or os.path.dirname(src) != ckpt:
            raise ConfigError(f"casnap:// renames only {METADATA}.tmp to {METADATA}, not {src}")
        with self._guard:
            save = self._saves.get(ckpt)
            staged = save.files.pop(os.path.basename(src), None) if save else None
        if save is None or staged is None or save.failed:
            raise FileNotFoundError(src)
        save.files[METADATA] = staged
        gathered: list[str] = []
        try:
            if save.group.distributed:
                gathered = self._gather(save)
            self._commit(save)
        finally:
            self._abandon(ckpt)
            for file in gathered:
                save.exchange().discard(file, 0)

    def _gather(self, save: _Save) -> list[str]:
        """(the coordinator, at the rename) The other ranks' entries of the files DCP's
        metadata names; each was posted when its file closed, before DCP's gather."""
        if save.lease is None:
            raise ConfigError(
                "a multi-rank casnap:// save is committed by global rank 0, DCP's coordinator "
                "in the default group; with another process group pass "
                "storage_writer=casnap.integrations.dcp.CasnapWriter(path)"
            )
        # The bytes DCP pickled in this process a moment ago (its own Metadata), not a load.
        metadata = pickle.loads(save.metadata)
        files = sorted({info.relative_path for info in metadata.storage_data.values()})
        theirs = [f for f in files if f not in save.files]
        exchange = save.exchange()
        for file in theirs:
            got, missing = exchange.collect(file, [0], dist_timeout())
            if missing:
                raise ConfigError(f"{file} of checkpoint {save.name!r} never reached rank 0")
            save.files[file] = got[0]
        return theirs

    rename = mv

    def _commit(self, save: _Save) -> None:
        """The manifest of the staged files, then the ref (as ``CasnapWriter.finish``)."""
        entries: dict[str, Entry] = {path_key((f,)): e for f, e in save.files.items()}
        entries.update(containers(entries))
        assert save.lease is not None  # _gather refused a commit on a rank without one
        manifest = Manifest(
            created_at=now_iso(),
            world_size=save.group.size,
            parents=list(save.parents),
            metadata={FILES_METADATA: {"version": 1}},
            entries=entries,
        )
        _commit_replacing(save.repo, save.name, manifest, save.replaces, save.lease, self.session)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        ckpt, file = os.path.split(strip(path))
        if file == METADATA:
            return  # DCP's step before the rename: the commit replaces the ref atomically
        with self._guard:
            save = self._saves.get(ckpt)
            if save is not None:
                save.files.pop(file, None)  # a write that failed: DCP cleans it up

    def rm_file(self, path: Any) -> None:
        self.rm(path)

    # -- loading ---------------------------------------------------------
    def _load(self, ckpt: str, fresh: bool) -> _Load:
        with self._guard:
            load = self._loads.get(ckpt)
        if load is None or fresh:
            repo, name = self.take_options.locate(ckpt, create=False, existing=True)
            manifest = repo.read_manifest(repo.resolve(name))
            if FILES_METADATA not in manifest.metadata:
                raise ConfigError(
                    f"snapshot {ckpt!r} was not saved through casnap://; read it with "
                    "storage_reader=casnap.integrations.dcp.CasnapReader(path)"
                )
            load = _Load(repo, manifest)
            with self._guard:
                self._loads[ckpt] = load
        return load

    def _entry(self, path: str, fresh: bool = False) -> tuple[_Load, Entry]:
        ckpt, file = os.path.split(path)
        load = self._load(ckpt, fresh)
        entry = load.manifest.entries.get(path_key((file,)))
        if entry is None or isinstance(entry, ContainerEntry):
            raise FileNotFoundError(path)
        return load, entry

    def exists(self, path: Any, **kwargs: Any) -> bool:
        try:
            self._entry(strip(path), fresh=True)
        except (FileNotFoundError, SnapshotNotFoundError, ConfigError):
            return False
        return True

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        ckpt = strip(path)
        load = self._load(ckpt, fresh=True)
        names = [
            k.split("/", 1)[1]
            for k, e in load.manifest.entries.items()
            if k.count("/") == 1 and not isinstance(e, ContainerEntry)
        ]
        out = [self.info(f"{ckpt}/{n}") for n in names]
        return out if detail else [o["name"] for o in out]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        _, entry = self._entry(strip(path))
        return {"name": strip(path), "size": entry_size(entry, path), "type": "file"}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.IOBase:
        path = strip(path)
        if "w" in mode:
            return WriteStream(lambda segments: self._stored(path, segments))
        if mode != "rb":
            raise ConfigError(f"casnap:// files open as 'rb' or 'wb', not {mode!r}")
        load, entry = self._entry(path, fresh=os.path.basename(path) == METADATA)
        return open_entry(load.repo, entry, path)
