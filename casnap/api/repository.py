"""``casnap.Repository``: the public face of a repository.

Example::

    import casnap

    repo = casnap.Repository("/ckpt/run1")
    for line in repo.log():
        print(line.name, line.step, line.new_bytes)
    print(repo.du().dedup_ratio)
    repo.retain(casnap.RetentionPolicy(casnap.KeepLast(3)))
    repo.gc(grace_seconds=3600)

Wherever a method reads a snapshot by name (``resolve``, ``show``, ``diff``,
``snapshot``, ``export``), the name may also be a tag or ``latest``, resolved as
the command line does (:mod:`casnap.ops.naming`)::

    repo.snapshot("latest").restore(app_state)

Listing, ``locate``, ``show``, ``log``, ``du``, ``diff``, ``verify``, ``retain``, ``gc``,
tags and ``repair`` from snapshots never import torch; ``take``, ``snapshot``,
``export``, ``diff(..., stats=True)`` and ``repair`` from live state load the
torch layers when called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casnap.api.repair_inputs import repair_sources
from casnap.api.snapshot_view import SnapshotView
from casnap.errors import ConfigError
from casnap.format.names import check_ref_name
from casnap.gc.collect import DEFAULT_GRACE_SECONDS, DEFAULT_WAIT_SECONDS, GcResult, gc
from casnap.gc.reclaim import ReclaimResult, reclaim
from casnap.ops.copy import CopyResult
from casnap.ops.copy import copy as copy_snapshots
from casnap.ops.history import EntryDiff, LogLine, Usage, diff, du, log
from casnap.ops.naming import resolve_name
from casnap.ops.repair import RepairResult, repair
from casnap.ops.retention import (
    RetentionDecision,
    RetentionPolicy,
    RetentionResult,
    RetentionRule,
    decide_retention,
    execute_retention,
)
from casnap.ops.verify import VerifyReport, verify
from casnap.repo.gc_lock import break_gc_lock
from casnap.repo.locate import locate
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import TagInfo, add_tag, list_tags, remove_tag
from casnap.settings import DEFAULT_CHUNK_SIZE
from casnap.store import ObjectStore

if TYPE_CHECKING:
    from casnap.api.snapshot import Snapshot
    from casnap.export.stream import ExportResult
    from casnap.take.session import Session

Progress = Callable[[int, int], None]  # (done, total), for a progress bar


class Repository:
    """An existing casnap repository at ``url`` (a directory or an fsspec URL).

    ``Repository(url)`` opens it (:class:`casnap.RepositoryNotFoundError` if
    there is none); :meth:`init` creates one. Takes through one Repository
    object share a :class:`casnap.Session`: each descends from the previous.

    ``storage`` is the :class:`~casnap.repo.repository.RepoStorage` underneath
    (objects, manifests, refs: the commit point), for casnap's own layers and
    tools; a Repository is not one, and writes refs only through its methods.
    ``Snapshot.take(path, app_state, repository=repo)`` takes and reads through it.
    """

    storage: RepoStorage

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage = RepoStorage.open(url, storage_options)  # RepositoryNotFoundError if none
        self._session: Session | None = None

    @classmethod
    def of(cls, storage: RepoStorage) -> Repository:
        """The Repository over an open ``storage`` (casnap's own layers and tools)."""
        repo = cls.__new__(cls)
        repo.storage, repo._session = storage, None
        return repo

    @classmethod
    def on_store(
        cls, store: ObjectStore, *, chunk_size: int = DEFAULT_CHUNK_SIZE, shared: bool = False
    ) -> Repository:
        """The repository rooted at an already-open ``store`` (a wrapped or custom
        :class:`casnap.store.ObjectStore`), created there if absent."""
        return cls.of(RepoStorage.on_store(store, chunk_size=chunk_size, shared=shared))

    @property
    def url(self) -> str:
        """Where the repository is (its root, as opened)."""
        return self.storage.url

    @classmethod
    def init(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_size: int | None = None,
    ) -> Repository:
        """Create the repository at ``url`` to be shared by the runs below it (or open it).

        A repository created here holds every snapshot path below ``url`` that
        has no nearer repository: ``Snapshot.take(url + "/run1/step_100", ...)``
        is snapshot ``run1/step_100`` in it. One a take created (which holds
        only the snapshots directly in it) is marked shared from now on.
        ``chunk_size`` applies to a new repository only::

            repo = Repository.init("/ckpt")                # then takes into /ckpt/<run>/<step>
        """
        size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
        storage = RepoStorage.open_or_create(url, storage_options, chunk_size=size, shared=True)
        storage.share()
        return cls.of(storage)

    @classmethod
    def locate(
        cls,
        path: str,
        storage_options: dict[str, Any] | None = None,
        *,
        must_exist: bool = True,
    ) -> tuple[Repository, str]:
        """The repository holding the snapshot at ``path``, and the snapshot's name in it.

        The repository is the path's parent, or a shared repository further
        up (:meth:`init`), or the first one further up that holds the name (an
        older casnap put deeper snapshots there), by the rules of
        docs/repository.md, "Where snapshots live"
        (:class:`casnap.SnapshotNotFoundError`, naming where it looked, if none holds it)::

            repo, name = Repository.locate("/ckpt/run1/step_100")  # (Repository, "step_100")

        ``must_exist=False`` returns the repository a take to ``path`` would use
        even when it holds no such snapshot (the CLI then resolves ``latest``
        and tag names in it).
        """
        storage, name = locate(path, storage_options, create=False, existing=must_exist)
        return cls.of(storage), name

    # -- reading the graph -----------------------------------------------
    def snapshots(self) -> list[str]:
        """Snapshot names in natural order: ``step_2`` before ``step_10`` and ``step_100``."""
        return self.storage.list_snapshots()

    def resolve(self, name: str) -> str:
        """The manifest hash snapshot ``name`` names now; ``name`` may also be a tag or
        ``latest`` (the newest snapshot; ``run1/latest``: the newest below ``run1/``),
        looked up as the command line does (:mod:`casnap.ops.naming`;
        :class:`casnap.SnapshotNotFoundError`, with the closest names, if none)::

            repo.resolve("latest")  # the newest snapshot's manifest hash (by step, then time)
        """
        return self.storage.resolve(resolve_name(self.storage, name))

    def log(self) -> list[LogLine]:
        """Every snapshot, oldest first, with lineage, step, size and the bytes it added."""
        return log(self.storage)

    def show(self, name: str, *, key: str | None = None) -> SnapshotView:
        """Snapshot ``name``'s manifest: header and entries (only ``key`` and below, if given).

        Reads the manifest only, never tensor data::

            view = repo.show("step_3", key="0/model")
            {k: e.kind for k, e in view.entries.items()}
        """
        found = resolve_name(self.storage, name)
        mhash = self.storage.resolve(found)
        return SnapshotView.of(found, mhash, self.storage.read_manifest(mhash), key)

    def du(self) -> Usage:
        """Logical and stored bytes, dedup ratio, and per snapshot what deleting it frees.

        Tags count as roots: an object a tag still reaches is never "freed"."""
        return du(self.storage, {t: info.manifest for t, info in self.tags().items()})

    def diff(
        self,
        a: str,
        b: str,
        *,
        stats: bool = False,
        other: Repository | None = None,
        memory_budget_bytes: int | None = None,
        key: str | None = None,
    ) -> list[EntryDiff]:
        """Per entry, natural key order: added, removed, changed or unchanged from a to b.

        Only ``key`` and below, when given. From the manifests alone, unless ``stats=True``:
        then the changed chunks of each changed tensor are read (and only those), filling in
        ``max_abs_diff`` and ``rel_l2``; that path loads torch. ``b`` is looked up
        in ``other`` when given (another repository), else in this one::

            [d.key for d in repo.diff("step_2", "step_3") if d.status != "unchanged"]
        """
        repo_b = other if other is not None else self
        ma = self.storage.read_manifest(self.resolve(a))
        mb = repo_b.storage.read_manifest(repo_b.resolve(b))
        rows = diff(ma, mb, key=key)
        if not stats:
            return rows
        from casnap.restore.drift import drift  # the torch layer: only when asked

        found = {
            d.key: d for d in drift(self.storage, ma, repo_b.storage, mb, rows, memory_budget_bytes)
        }
        return [
            replace(r, max_abs_diff=found[r.key].max_abs_diff, rel_l2=found[r.key].rel_l2)
            if r.key in found
            else r
            for r in rows
        ]

    def verify(
        self,
        *,
        read_data: bool = False,
        part: tuple[int, int] | None = None,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Check every ref, manifest and chunk; writes nothing and repairs nothing.

        ``read_data`` re-hashes every chunk's bytes; ``part=(k, n)`` re-hashes
        only part ``k`` of ``n`` of them (and implies ``read_data``)::

            report = repo.verify(part=(0, 7))  # a seventh of the chunks, e.g. one per day
            report.ok, [p.kind for p in report.problems]
        """
        return verify(
            self.storage, read_data=read_data or part is not None, part=part, progress=progress
        )

    # -- maintenance -----------------------------------------------------
    def repair(
        self,
        *,
        from_snapshots: Sequence[str] = (),
        from_files: Sequence[str | Path] = (),
        from_states: Sequence[Any] = (),
        read_data: bool = False,
        dry_run: bool = False,
        progress: Progress | None = None,
    ) -> RepairResult:
        """Write good copies of damaged or missing chunks; report what stays unrecoverable.

        Good bytes come from this repository's other copies, then the snapshots
        in ``from_snapshots`` (names here, or snapshot paths in any repository),
        then live state: ``torch.save`` files in ``from_files`` and objects in
        ``from_states`` (a state dict you still hold), cut the way takes cut
        tensors. ``read_data`` first re-hashes every chunk (as ``verify``) to
        find damage no read has met yet. ``dry_run`` writes no chunk. Every
        write is verified and atomic, and nothing else is rewritten
        (docs/damage.md, "Repair")::

            result = repo.repair(from_states=[{"model": model.state_dict()}])
            result.ok, result.unrecoverable
        """
        sources = repair_sources(self.storage, from_snapshots, from_files, from_states)
        return repair(
            self.storage, sources, read_data=read_data, dry_run=dry_run, progress=progress
        )

    def retain(
        self,
        policy: RetentionPolicy | RetentionRule | RetentionDecision,
        *,
        dry_run: bool = False,
        now: datetime | None = None,
        allow_delete_all: bool = False,
        prune: bool = False,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
    ) -> RetentionResult:
        """Delete the refs ``policy`` does not keep; with ``prune``, then their space.

        The plan is made first and returned in ``result.plan``; ``dry_run``
        stops there (nothing deleted). A :class:`RetentionDecision` from an
        earlier dry run can be passed instead of a policy to execute exactly
        it (refs changed since are skipped). A plan that deletes every
        snapshot raises :class:`casnap.errors.RetentionError` unless
        ``allow_delete_all``. ``prune`` deletes, right after, the manifests of
        the deleted refs and what only they reference, with no grace period
        (:func:`casnap.gc.reclaim.reclaim`, waiting up to ``wait_seconds`` for
        takes in flight); ``result.reclaimed`` says what it freed and kept.
        Without it, ``gc`` reclaims the space after its grace period::

            preview = repo.retain(RetentionPolicy(KeepLast(3)), dry_run=True)
            print(preview.plan.render())
            repo.retain(preview.plan, prune=True).reclaimed.bytes_freed
        """
        if isinstance(policy, RetentionDecision):
            plan = policy
        else:
            plan = decide_retention(self.storage, policy, now, allow_delete_all=allow_delete_all)
        if dry_run:
            return RetentionResult((), {}, plan, dry_run=True)
        result = execute_retention(self.storage, plan)
        if prune:
            freed = reclaim(self.storage, result.retired_manifests, wait_seconds=wait_seconds)
            result = replace(result, reclaimed=freed)
        return result

    def gc(
        self,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        dry_run: bool = False,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
        progress: Progress | None = None,
    ) -> GcResult:
        """Delete what no ref or tag reaches and is older than ``grace_seconds`` (default 1 h).

        Safe beside running takes: it waits up to ``wait_seconds`` for takes in
        flight (else :class:`casnap.errors.GcBlockedError`, having deleted nothing).
        ``dry_run`` plans only; ``result.plan`` says what would go::

            repo.gc(dry_run=True).plan.bytes_to_free
            repo.gc(grace_seconds=0).bytes_freed
        """
        return gc(
            self.storage,
            grace_seconds=grace_seconds,
            dry_run=dry_run,
            wait_seconds=wait_seconds,
            progress=progress,
        )

    def unlock(self, *, force: bool = False) -> str | None:
        """Remove a stale or damaged ``gc.lock``; describe what went (None: no lock).

        Takes and gc already pass over a stale lock (expired, or claiming more
        than any holder writes, docs/gc.md); this removes it for good. A live
        lock, which a running gc renews, stays (:class:`casnap.errors.GcBusyError`
        naming its holder) unless ``force``, for a gc known to be gone::

            repo.unlock()  # 'the gc lock of gc a (host h, pid 1, ...): it claims ...'
        """
        return break_gc_lock(self.storage.store, force=force)

    def delete(self, name: str) -> str:
        """Delete snapshot ``name`` (its ref); returns the manifest hash it named.

        Only the ref goes: the next :meth:`gc` (after its grace period)
        reclaims the chunks no other snapshot or tag reaches; :meth:`du` says
        how much that is beforehand (``exclusive_bytes``). A tag on the
        snapshot keeps its data. :class:`casnap.SnapshotNotFoundError` if there
        is no such snapshot (``name`` is the snapshot's own name: no tag or ``latest``)::

            repo.delete("step_100")
            repo.gc(grace_seconds=0).bytes_freed

        or, at once and only for this snapshot, :meth:`reclaim`.
        """
        manifest = self.storage.resolve(name)
        self.storage.delete_ref(name)
        return manifest

    def reclaim(
        self, manifests: Sequence[str], *, wait_seconds: float = DEFAULT_WAIT_SECONDS
    ) -> ReclaimResult:
        """Delete, at once, the ``manifests`` whose refs were just deleted and what only
        they reference (no grace period; safe beside running takes, which it waits
        for up to ``wait_seconds`` before deferring: ``result.deferred``)::

            repo.reclaim([repo.delete("step_100")]).bytes_freed
        """
        return reclaim(self.storage, manifests, wait_seconds=wait_seconds)

    def copy_to(
        self,
        dst: Repository | str,
        names: Sequence[str] | None = None,
        *,
        force: bool = False,
        dry_run: bool = False,
        progress: Progress | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> CopyResult:
        """Copy snapshots ``names`` (default: all) to the repository ``dst`` (created if absent).

        Sends only the objects ``dst`` lacks, each checked against its name
        first, and writes each snapshot's ref last; an interrupted copy, run
        again, sends only the rest. ``storage_options`` open ``dst``;
        ``progress(bytes_done, bytes_total)``; ``dry_run`` returns the plan
        (``result.plan``) and writes nothing. Raises
        :class:`casnap.errors.CopyIntegrityError` when a snapshot needs a damaged
        source object (the others are copied), :class:`casnap.SnapshotExistsError`
        when ``dst`` has a name with other content and not ``force``
        (docs/copy.md)::

            result = casnap.Repository("/ckpt/run1").copy_to("gs://bucket/run1")
            print(result.render())
        """
        return copy_snapshots(
            self.storage,
            dst.storage if isinstance(dst, Repository) else dst,
            names,
            force=force,
            dry_run=dry_run,
            progress=progress,
            dst_storage_options=storage_options,
        )

    def tag(self, tag: str, snapshot: str) -> TagInfo:
        """Pin ``snapshot`` under ``tag`` against retention and gc."""
        return add_tag(self.storage, tag, snapshot)

    def untag(self, tag: str) -> TagInfo:
        """Remove ``tag``; returns what it pinned
        (:class:`casnap.errors.ObjectNotFoundError` if none)."""
        return remove_tag(self.storage, tag)

    def tags(self) -> dict[str, TagInfo]:
        """Every tag by name, in natural order (``v2`` before ``v10``)."""
        return list_tags(self.storage)

    # -- the torch side ----------------------------------------------------
    def snapshot(self, name: str) -> Snapshot:
        """The snapshot ``name``, a tag or ``latest`` names, as :meth:`resolve` finds it
        (:class:`casnap.SnapshotNotFoundError` if none); ``.name`` is its own name::

            repo.snapshot("latest").restore(app_state)
            repo.snapshot("best").name  # "step_300", the snapshot tag "best" is on
        """
        from casnap.api.snapshot import Snapshot

        path = self._path(resolve_name(self.storage, name))
        return Snapshot(path, repository=self.storage, session=self._take_session())

    def take(self, name: str, app_state: dict[str, Any], **kwargs: Any) -> Snapshot:
        """``Snapshot.take`` of ``app_state`` as ``name`` in this repository."""
        from casnap.api.snapshot import Snapshot

        kwargs.setdefault("session", self._take_session())
        return Snapshot.take(self._path(name), app_state, repository=self.storage, **kwargs)

    def export(
        self,
        snapshot: str,
        out_path: str | Path,
        *,
        format: str | None = None,
        key: str | None = None,
        memory_budget_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> ExportResult:
        """Write ``snapshot`` (or one ``key``) as safetensors or, for .pt/.pth/.bin, torch.save.

        ``format`` ("safetensors" or "torch") overrides the guess from the suffix::

            repo.export("step_3", "model.safetensors", key="0/model").tensor_bytes
        """
        from casnap.export import export_safetensors, export_torch

        fmt = format or (
            "torch" if str(out_path).endswith((".pt", ".pth", ".bin")) else "safetensors"
        )
        if fmt not in ("torch", "safetensors"):
            raise ConfigError(
                f"export format must be 'torch' or 'safetensors', got {fmt!r}", "format"
            )
        write = export_torch if fmt == "torch" else export_safetensors
        return write(
            self.snapshot(snapshot),
            out_path,
            key=key,
            memory_budget_bytes=memory_budget_bytes,
            progress=progress,
        )

    def _path(self, name: str) -> str:
        # Checked here: a local path would normalize "a/../b" or "a//b" into another name.
        return f"{self.url.rstrip('/')}/{check_ref_name(name)}"

    def _take_session(self) -> Session:
        if self._session is None:
            from casnap.take.session import Session

            self._session = Session()
        return self._session

    def __repr__(self) -> str:
        return f"casnap.Repository({self.url!r})"
