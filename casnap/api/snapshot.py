"""The torchsnapshot-compatible API: ``Snapshot``, ``PendingSnapshot``.

Code written for torchsnapshot works by changing the import::

    from casnap import Snapshot, StateDict

    app_state = {"model": model, "optim": optimizer, "progress": StateDict(step=0)}
    snapshot = Snapshot.take("/ckpt/run1/step_100", app_state)
    ...
    Snapshot("/ckpt/run1/step_100").restore(app_state)

``/ckpt/run1``, the path's parent, is the repository (created by the first
take) and ``step_100`` the snapshot's name in it; docs/repository.md, "Where
snapshots live", has the rules, the paths refused, and what is checked
before anything is created.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from casnap.api.repository import Repository
from casnap.chunks.frames import WriteStats
from casnap.distributed.group import resolve_group
from casnap.distributed.take import DistributedJob, prepare_distributed_take
from casnap.errors import as_names, as_path, expect_type
from casnap.format.entries import Entry
from casnap.format.manifest import Manifest
from casnap.python_gc import python_gc_paused
from casnap.repo.locate import locate
from casnap.repo.repository import RepoStorage
from casnap.restore.restore import check_app_state, read_entry, restore_state
from casnap.take import at_exit
from casnap.take.commit import remember
from casnap.take.job import ShardedNeedsGroup, TakeJob, TakeResult, prepare_take
from casnap.take.session import Session
from casnap.take.target import TakeOptions, TensorPrepareFunc

Progress = Callable[[int, int], None]  # progress(done_bytes, total_bytes)


def _checked(progress: Progress | None) -> Progress | None:
    if progress is not None and not callable(progress):
        expect_type(progress, type(None), "progress", "a callable progress(done, total) or None")
    return progress


def _prepare(
    path: str,
    app_state: dict[str, Any],
    pg: Any,
    replicated: list[str] | None,
    options: TakeOptions,
    custom_prepare: TensorPrepareFunc | None,
    metadata: dict[str, Any] | None,
    allow_pickle: bool,
    parents: list[str] | None,
    memory_budget_bytes: int | None,
    session: Session | None,
    *,
    stage: bool,
) -> TakeJob | DistributedJob:
    """The prepared take shared by :meth:`Snapshot.take` and :meth:`Snapshot.async_take`.

    With a process group every rank of it calls this (collective planning);
    a single process is a world of one through the same pipeline.
    """
    path = as_path(path)
    expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
    for name, value in (("storage_options", options.storage), ("metadata", metadata)):
        if value is not None:
            expect_type(value, Mapping, name, "a dict or None")
    parents = as_names(parents, "parents")
    replicated = as_names(replicated, "replicated")
    expect_type(allow_pickle, bool, "allow_pickle", "True or False")
    if custom_prepare is not None and not callable(custom_prepare):
        expect_type(custom_prepare, type(None), "_custom_tensor_prepare_func", "a callable")
    if session is not None:
        expect_type(session, Session, "session", "a casnap.Session")
    group = resolve_group(pg)

    def single_process() -> TakeJob:
        return prepare_take(
            path,
            app_state,
            options=options,
            metadata=metadata,
            allow_pickle=allow_pickle,
            parents=parents,
            stage=stage,
            custom_prepare=custom_prepare,
            memory_budget_bytes=memory_budget_bytes,
            session=session,
            replicated=replicated,
        )

    if group.pg is not None and not group.distributed:
        # A group of one rank has nothing to coordinate: the single-process take,
        # which stages without hashing in the caller's thread, unless the state
        # holds sharded values (refused there before anything is created).
        try:
            return single_process()
        except ShardedNeedsGroup:
            pass
    if group.pg is not None:
        return prepare_distributed_take(
            path,
            app_state,
            group=group,
            replicated=replicated,
            options=options,
            metadata=metadata,
            allow_pickle=allow_pickle,
            parents=parents,
            stage=stage,
            custom_prepare=custom_prepare,
            memory_budget_bytes=memory_budget_bytes,
            session=session,
        )
    return single_process()


class Snapshot:
    """A snapshot in a casnap repository (``Snapshot(path)`` refers to an existing one).

    Nothing is read until the snapshot is used; a path that names no snapshot
    raises :class:`casnap.SnapshotNotFoundError` then. :meth:`restore` checks
    ``app_state`` before that: a value without ``state_dict()`` raises a
    ``TypeError`` whether or not the snapshot exists (as torchsnapshot).
    ``repository`` (a URL or an open :class:`casnap.Repository`) names the
    repository the path is in, as for :meth:`take`. A restore through a
    ``session`` (:class:`casnap.Session`) makes this snapshot the parent of
    that session's next take into the repository.
    """

    def __init__(
        self,
        path: str,
        pg: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        session: Session | None = None,
        repository: str | Repository | RepoStorage | None = None,
    ) -> None:
        self.path = as_path(path)
        self.pg = pg
        if storage_options is not None:
            expect_type(storage_options, Mapping, "storage_options", "a dict or None")
        if session is not None:
            expect_type(session, Session, "session", "a casnap.Session")
        self.storage_options = dict(storage_options or {})
        self.session = session
        self._named_repository = repository  # None: found from the path (locate)
        self._repo: RepoStorage | None = None
        self._repository: Repository | None = None
        self._name: str | None = None
        self._manifest_hash: str | None = None
        self._manifest: Manifest | None = None
        # What the take that created this object wrote (None for Snapshot(path)).
        self.last_take_stats: WriteStats | None = None
        # Every rank's writes, in rank order, after a distributed take.
        self.last_take_rank_stats: list[WriteStats] | None = None

    # -- taking ----------------------------------------------------------
    @classmethod
    def take(
        cls,
        path: str,
        app_state: dict[str, Any],
        pg: Any = None,
        replicated: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        _custom_tensor_prepare_func: TensorPrepareFunc | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        parents: list[str] | None = None,
        memory_budget_bytes: int | None = None,
        session: Session | None = None,
        progress: Progress | None = None,
        settings: dict[str, Any] | None = None,
        repository: str | Repository | RepoStorage | None = None,
    ) -> Snapshot:
        """Take a snapshot of ``app_state`` (a dict of stateful objects) at ``path``.

        ``metadata`` (JSON) is stored in the manifest (step, metrics, tags).
        ``allow_pickle`` permits storing values that are neither tensors,
        primitives nor containers. ``parents`` sets the lineage (names or
        manifest hashes; ``[]``: none); by default it is ``session``'s previous
        take or restore into this repository, and without a session the newest
        snapshot committed in the same folder (docs/repository.md, "Parents";
        ``CASNAP_AUTO_PARENT=0`` turns that off). A :class:`casnap.Session`
        also lets the next take reuse this one's plan and staging buffers.
        ``memory_budget_bytes`` bounds the take's in-flight copies (default: a
        quarter of available memory, ``CASNAP_MEMORY_BUDGET``).
        ``storage_options`` are the store's (fsspec's, as in torchsnapshot);
        ``settings`` override this take's settings (``{"chunk_size": "1MiB"}``:
        ``casnap.settings.TAKE_SETTINGS``); ``repository`` (a URL or an open
        :class:`casnap.Repository`) names the repository the path is in.
        ``progress(done_bytes, total_bytes)`` is called from writer threads, in
        order, as each chunk of this rank's tensors and objects is hashed and
        written or found already stored; it ends at ``total_bytes``::

            Snapshot.take(path, app_state, progress=lambda done, total: print(done, total))
        """
        progress = _checked(progress)  # before anything is created
        with python_gc_paused():  # no full collection per ~50,000 objects (casnap.python_gc)
            job = _prepare(
                path,
                app_state,
                pg,
                replicated,
                TakeOptions.of(storage_options, settings, repository),
                _custom_tensor_prepare_func,
                metadata,
                allow_pickle,
                parents,
                memory_budget_bytes,
                session,
                stage=False,
            )
            job.progress = progress
            result = job.run()
        return cls._from_result(path, pg, storage_options, result, session)

    @classmethod
    def async_take(
        cls,
        path: str,
        app_state: dict[str, Any],
        pg: Any = None,
        replicated: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        _custom_tensor_prepare_func: TensorPrepareFunc | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        parents: list[str] | None = None,
        memory_budget_bytes: int | None = None,
        session: Session | None = None,
        progress: Progress | None = None,
        settings: dict[str, Any] | None = None,
        repository: str | Repository | RepoStorage | None = None,
    ) -> PendingSnapshot:
        """Like :meth:`take`, but returns once the state is copied; writing continues
        in the background. Changing the live tensors afterwards never changes the
        snapshot. ``.wait()`` returns the :class:`Snapshot` or raises the failure.

        Staging copies at most ``memory_budget_bytes`` (less the writer's working
        set) into host buffers reused from the previous async take; tensors beyond
        that are written before this returns, so a state larger than the budget
        blocks longer instead of using more memory. ``progress`` as for :meth:`take`
        (called from the background writers too)."""
        progress = _checked(progress)  # before anything is created
        with python_gc_paused():  # per-entry work in the caller's thread (casnap.python_gc)
            job = _prepare(
                path,
                app_state,
                pg,
                replicated,
                TakeOptions.of(storage_options, settings, repository),
                _custom_tensor_prepare_func,
                metadata,
                allow_pickle,
                parents,
                memory_budget_bytes,
                session,
                stage=True,
            )
        job.progress = progress
        pending = PendingSnapshot(path, pg, storage_options, job.run, session)
        job.live_consumed.wait()  # what staging could not copy is consumed: point-in-time
        return pending

    @classmethod
    def _from_result(
        cls,
        path: str,
        pg: Any,
        storage_options: dict[str, Any] | None,
        result: TakeResult,
        session: Session | None,
    ) -> Snapshot:
        snap = cls(path, pg, storage_options, session=session)
        snap._repo, snap._name = result.repo, result.name
        snap._manifest_hash, snap._manifest = result.manifest_hash, result.manifest
        snap.last_take_stats = result.stats
        snap.last_take_rank_stats = result.rank_stats
        return snap

    # -- reading ---------------------------------------------------------
    def _load(self) -> tuple[RepoStorage, Manifest]:
        if self._repo is None or self._name is None:
            self._repo, self._name = locate(
                self.path,
                self.storage_options,
                create=False,
                existing=True,
                repository=self._named_repository,
            )
        if self._manifest is None:
            self._manifest_hash = self._repo.resolve(self._name)
            self._manifest = self._repo.read_manifest(self._manifest_hash)
        return self._repo, self._manifest

    @property
    def name(self) -> str:
        """The snapshot's name in its repository (the path below the repository root)."""
        self._load()
        assert self._name is not None
        return self._name

    @property
    def repository(self) -> Repository:
        """The :class:`casnap.Repository` the snapshot is in::

        Snapshot("/ckpt/run1/step_100").repository.url  # "/ckpt/run1"
        """
        if self._repository is None:
            self._repository = Repository.of(self._load()[0])
        return self._repository

    @property
    def manifest(self) -> Manifest:
        """The full manifest: entries, parents, metadata, format version."""
        return self._load()[1]

    @property
    def manifest_hash(self) -> str:
        self._load()
        assert self._manifest_hash is not None
        return self._manifest_hash

    @property
    def metadata(self) -> SnapshotMetadata:
        """The ``metadata`` given to the take (a dict), with torchsnapshot's
        ``version``, ``world_size`` and ``manifest`` as attributes.

        Example: ``snap.metadata["step"]``, ``snap.metadata.world_size``.
        """
        m = self.manifest
        return SnapshotMetadata(m.metadata, m.format_version, m.world_size, dict(m.entries))

    def get_manifest(self) -> dict[str, Entry]:
        """Entries by logical key (``"0/model/0.weight"``), as torchsnapshot returns them.

        Every entry has torchsnapshot's ``type`` and ``replicated`` (true for a
        tensor written once for every rank); tensors their ``dtype`` and
        ``shape``, pickled objects ``serializer`` and ``obj_type``, floats
        ``readable``. Example: ``snap.get_manifest()["0/model/weight"].shape``.
        """
        return dict(self.manifest.entries)

    def restore(
        self,
        app_state: dict[str, Any],
        strict: bool = False,
        *,
        allow_pickle: bool = False,
        memory_budget_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Load the snapshot into ``app_state``, in place into its existing tensors.

        As in torchsnapshot, each stateful's ``load_state_dict`` receives the
        state dict the snapshot holds for it: members the target lacks are
        materialized (a ``None`` placeholder receives the stored value), a
        tensor of the stored dtype and shape is filled in place and passed
        back as the same object, and ``load_state_dict`` decides (an
        ``nn.Module``'s own strictness applies). Every key of ``app_state``
        must be in the snapshot. ``RNGState`` is loaded last.

        Everything casnap can check is checked before anything is modified:
        shapes and dtypes of in-place tensors, pickled entries (refused unless
        ``allow_pickle``), damaged chunks, and with ``strict=True`` that the
        target's keys and the snapshot's match (:class:`casnap.MissingKeyError`,
        :class:`casnap.UnexpectedKeyError`). A ``load_state_dict`` that raises
        does so after every read (docs/pipeline.md, "A failed restore").

        ``progress(done_bytes, total_bytes)`` is called from reader threads, in
        order, as each chunk is verified and lands; it ends at ``total_bytes``.

        Example::

            model = torch.nn.Linear(4, 2)
            Snapshot("/ckpt/run1/step_100").restore({"model": model})
        """
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        check_app_state(app_state)  # a TypeError before any storage is touched
        rank = resolve_group(self.pg).rank  # not collective: each rank restores its own state
        progress = _checked(progress)
        with python_gc_paused():  # several objects per entry, no cycles (casnap.python_gc)
            repo, manifest = self._load()
            restore_state(
                repo,
                manifest,
                app_state,
                rank=rank,
                strict=strict,
                allow_pickle=allow_pickle,
                memory_budget_bytes=memory_budget_bytes,
                progress=progress,
            )
        remember(repo, self.manifest_hash, manifest, self.session)

    def read_object(
        self,
        path: str,
        obj_out: Any = None,
        memory_budget_bytes: int | None = None,
        *,
        allow_pickle: bool = False,
    ) -> Any:
        """Read one entry (and what is below it) by logical key, fetching only its chunks.

        With ``obj_out`` a tensor of the right shape and dtype, the data lands
        in it in place. Example: ``snap.read_object("0/model/fc.weight")``.
        """
        expect_type(path, str, "path", "a logical key such as '0/model/fc.weight'")
        repo, manifest = self._load()
        return read_entry(
            repo,
            manifest,
            path,
            obj_out,
            allow_pickle=allow_pickle,
            memory_budget_bytes=memory_budget_bytes,
        )

    def __repr__(self) -> str:
        return f"Snapshot({self.path!r})"


class SnapshotMetadata(dict):  # type: ignore[type-arg]
    """What :attr:`Snapshot.metadata` returns: the take's ``metadata`` dict, plus
    torchsnapshot's ``SnapshotMetadata`` fields as attributes.

    ``version`` is the manifest's format version (docs/format.md; torchsnapshot
    stores its package version there), ``world_size`` the number of ranks that
    took the snapshot, ``manifest`` the entries as :meth:`Snapshot.get_manifest`
    returns them.

    Example::

        meta = Snapshot.take(path, app_state, metadata={"step": 100}).metadata
        assert meta == {"step": 100} and meta.world_size == 1
        meta.manifest["0/model/weight"].dtype
    """

    def __init__(
        self, user: dict[str, Any], version: str, world_size: int, manifest: dict[str, Entry]
    ) -> None:
        super().__init__(user)
        self.version = version
        self.world_size = world_size
        self.manifest = manifest


class PendingSnapshot:
    """A take still writing in the background (from :meth:`Snapshot.async_take`)."""

    def __init__(
        self,
        path: str,
        pg: Any,
        storage_options: dict[str, Any] | None,
        commit: Any,
        session: Session | None = None,
    ) -> None:
        self.path = path
        self._session = session
        self._pg = pg
        self._storage_options = storage_options
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="casnap-async")
        # The background part sees the caller's settings overrides (casnap.settings.override).
        context = contextvars.copy_context()
        self._future: Future[TakeResult] = self._executor.submit(context.run, commit)
        self._executor.shutdown(wait=False)
        at_exit.watch(self._future, path)  # a script that ends without wait() keeps it

    def done(self) -> bool:
        """Whether the background part has finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Block until the snapshot is committed; re-raises a background failure as is."""
        try:
            result = self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the failure reached the caller (not a wait timing out)
                at_exit.observed(self._future)
            raise
        return Snapshot._from_result(
            self.path, self._pg, self._storage_options, result, self._session
        )
