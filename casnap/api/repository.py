"""``casnap.Repository``: the public face of a repository.

Example::

    import casnap

    repo = casnap.Repository("/ckpt/run1")
    for line in repo.log():
        print(line.name, line.step, line.new_bytes)
    print(repo.du().dedup_ratio)
    repo.retain(casnap.RetentionPolicy(casnap.KeepLast(3)))
    repo.gc(grace_seconds=3600)

Listing, ``log``, ``du``, ``diff``, ``verify``, ``retain``, ``gc`` and tags
never import torch; ``take``, ``snapshot``, ``export`` and ``diff(...,
stats=True)`` load the torch layers when called.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casnap.errors import ConfigError, SnapshotNotFoundError
from casnap.gc.collect import GcResult, gc
from casnap.ops.history import EntryDiff, LogLine, Usage, diff, du, log
from casnap.ops.retention import (
    RetentionPolicy,
    RetentionResult,
    execute_retention,
    plan_retention,
)
from casnap.ops.verify import VerifyReport, verify
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import TagInfo, add_tag, list_tags, remove_tag

if TYPE_CHECKING:
    from casnap.api.snapshot import Snapshot
    from casnap.export.stream import ExportResult
    from casnap.take.session import Session


class Repository(RepoStorage):
    """An existing casnap repository at ``url`` (a directory or an fsspec URL).

    ``Repository(url)`` opens it (:class:`casnap.RepositoryNotFoundError` if
    there is none); :meth:`init` creates one. Takes through one Repository
    object share a :class:`casnap.Session`: each descends from the previous.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        opened = RepoStorage.open(url, storage_options)  # RepositoryNotFoundError if none
        RepoStorage.__init__(self, opened.root, opened.config)
        self._session: Session | None = None

    @classmethod
    def _make(cls, root: Any, config: Any) -> Any:
        obj = super()._make(root, config)
        obj._session = None
        return obj

    @classmethod
    def init(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_size: int | None = None,
    ) -> Repository:
        """Create the repository at ``url`` (or open it, if one is there already)."""
        if chunk_size is None:
            return cls.open_or_create(url, storage_options)  # type: ignore[no-any-return]
        return cls.open_or_create(url, storage_options, chunk_size=chunk_size)  # type: ignore[no-any-return]

    # -- reading the graph -----------------------------------------------
    def snapshots(self) -> list[str]:
        """Snapshot names, sorted."""
        return self.list_snapshots()

    def log(self) -> list[LogLine]:
        """Every snapshot, oldest first, with lineage, step, size and the bytes it added."""
        return log(self)

    def du(self) -> Usage:
        """Logical and stored bytes, dedup ratio, and what deleting each snapshot frees."""
        return du(self, {t: info.manifest for t, info in list_tags(self).items()})

    def diff(self, a: str, b: str, *, stats: bool = False) -> list[Any]:
        """Per entry: added, removed, changed or unchanged between snapshots ``a`` and ``b``.

        ``stats=True`` also reads the changed tensors' chunks for numeric drift.
        """
        ma, mb = self.read_manifest(self.resolve(a)), self.read_manifest(self.resolve(b))
        if not stats:
            out: list[EntryDiff] = diff(ma, mb)
            return out
        from casnap.restore.drift import drift

        return drift(self, ma, self, mb, diff(ma, mb))

    def verify(
        self, *, read_data: bool = False, part: tuple[int, int] | None = None
    ) -> VerifyReport:
        """Check every ref, manifest and chunk (``read_data``: re-hash chunk bytes)."""
        return verify(self, read_data=read_data, part=part)

    # -- maintenance -----------------------------------------------------
    def retain(
        self, policy: RetentionPolicy, *, dry_run: bool = False, now: datetime | None = None
    ) -> RetentionResult | Any:
        """Delete the refs ``policy`` does not keep (``dry_run``: return the plan only)."""
        plan = plan_retention(self, policy, now)
        return plan if dry_run else execute_retention(self, plan)

    def gc(self, *, grace_seconds: float | None = None, dry_run: bool = False) -> GcResult:
        """Delete what no ref or tag reaches and is older than ``grace_seconds``."""
        if grace_seconds is None:
            return gc(self, dry_run=dry_run)
        return gc(self, grace_seconds=grace_seconds, dry_run=dry_run)

    def tag(self, tag: str, snapshot: str) -> TagInfo:
        """Pin ``snapshot`` under ``tag`` against retention and gc."""
        return add_tag(self, tag, snapshot)

    def untag(self, tag: str) -> TagInfo:
        return remove_tag(self, tag)

    def tags(self) -> dict[str, TagInfo]:
        return list_tags(self)

    # -- the torch side ----------------------------------------------------
    def snapshot(self, name: str) -> Snapshot:
        """The snapshot ``name`` (:class:`casnap.SnapshotNotFoundError` if there is none)."""
        from casnap.api.snapshot import Snapshot

        if not self.has_ref(name):
            raise SnapshotNotFoundError(f"no snapshot {name!r} in {self.url}", name)
        return Snapshot(self._path(name), storage_options={"repository": self},
                        session=self._take_session())  # fmt: skip

    def take(self, name: str, app_state: dict[str, Any], **kwargs: Any) -> Snapshot:
        """``Snapshot.take`` of ``app_state`` as ``name`` in this repository."""
        from casnap.api.snapshot import Snapshot

        options = {**kwargs.pop("storage_options", {}), "repository": self}
        kwargs.setdefault("session", self._take_session())
        return Snapshot.take(self._path(name), app_state, storage_options=options, **kwargs)

    def export(
        self,
        snapshot: str,
        out_path: str | Path,
        *,
        format: str | None = None,
        key: str | None = None,
        memory_budget_bytes: int | None = None,
    ) -> ExportResult:
        """Write ``snapshot`` (or one ``key``) as safetensors or, for .pt/.pth/.bin, torch.save."""
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
            self.snapshot(snapshot), out_path, key=key, memory_budget_bytes=memory_budget_bytes
        )

    def _path(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def _take_session(self) -> Session:
        if self._session is None:
            from casnap.take.session import Session

            self._session = Session()
        return self._session

    def __repr__(self) -> str:
        return f"casnap.Repository({self.url!r})"
