"""What an export writes: the tensors of a selection, their names and what identifies it.

Names follow the rule of docs/export.md. Used by both writers,
:mod:`casnap.export.safetensors_file` and :mod:`casnap.export.torch_file`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from casnap.errors import UnsupportedValueError, expect_type
from casnap.format.entries import ContainerEntry, ObjectEntry, PrimitiveEntry, TensorEntry
from casnap.format.manifest import Manifest
from casnap.format.tree import missing_key, subtree
from casnap.repo.repository import RepoStorage


class StorageHolder(Protocol):
    """A repository as the export reads it: :class:`casnap.Repository` is one."""

    @property
    def storage(self) -> RepoStorage: ...


class ExportSource(Protocol):
    """What an export reads: a :class:`casnap.Snapshot` is one (export sits below
    the api layer and never imports it)."""

    @property
    def name(self) -> str: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def manifest_hash(self) -> str: ...

    @property
    def repository(self) -> StorageHolder: ...


@dataclass(frozen=True)
class ExportItem:
    """One tensor to export: its name in the file, its logical key and its entry."""

    name: str
    key: str
    entry: TensorEntry


# -- what to export ------------------------------------------------------------


def resolve_key(manifest: Manifest, key: str) -> str:
    """``key`` as a logical key of the snapshot; ``model/...`` means ``0/model/...`` when
    every entry is rank 0."""
    entries = manifest.entries
    if key in entries:
        return key
    if f"0/{key}" in entries and all(k.startswith("0/") for k in entries):
        return f"0/{key}"
    raise missing_key(key, entries)  # naming the nearest keys


def _roots(entries: dict[str, Any]) -> list[str]:
    """Top-level keys (``<rank>/<app key>``) ordered by rank, then key."""

    def rank_then_key(k: str) -> tuple[int, str]:
        rank = k.split("/", 1)[0]
        return (int(rank) if rank.isdigit() else -1, k)

    return sorted((k for k in entries if k.rsplit("/", 1)[0] not in entries), key=rank_then_key)


def select(manifest: Manifest, key: str | None) -> tuple[list[ExportItem], list[str]]:
    """The tensors to export, named by the rule of docs/export.md, and the skipped keys.

    Tensors come in state-dict order (each container's member order), not in the
    manifest's sorted key order.
    """
    entries = manifest.entries
    if key is None:
        order: list[str] = []
        for root in _roots(entries):
            order.extend(subtree(entries, root))
        seen = set(order)
        order += sorted(k for k in entries if k not in seen)  # unlisted entries, if any
        strip = 2 if all(k.startswith("0/") for k in entries) else 0
        named = [(k[strip:], k) for k in order]
    else:
        k = resolve_key(manifest, key)
        entry = entries[k]
        if isinstance(entry, TensorEntry):
            return [ExportItem(k.rsplit("/", 1)[-1], k, entry)], []
        if isinstance(entry, PrimitiveEntry):
            what = f"a primitive ({entry.type})"
        elif isinstance(entry, ObjectEntry):
            what = f"a pickled {entry.type_name}"
        else:
            what = ""
        if what:
            raise UnsupportedValueError(
                f"{k}: is {what}, not a tensor or a container of tensors; "
                "export writes tensors only",
                k,
            )
        named = [(sub[len(k) + 1 :], sub) for sub in subtree(entries, k)[1:]]
    items: list[ExportItem] = []
    skipped: list[str] = []
    for name, k in named:
        entry = entries[k]
        if isinstance(entry, TensorEntry):
            items.append(ExportItem(name, k, entry))
        elif not isinstance(entry, ContainerEntry):
            skipped.append(k)
    if key is not None and not items:
        raise UnsupportedValueError(f"{key}: holds no tensors to export", key)
    return items, skipped


def plan_export(
    snapshot: ExportSource, key: str | None
) -> tuple[list[ExportItem], list[str], dict[str, str]]:
    """The items and skipped keys of the selection, and what identifies it."""
    if not hasattr(snapshot, "manifest") or not hasattr(snapshot, "manifest_hash"):
        expect_type(snapshot, type(None), "snapshot", "a casnap.Snapshot, e.g. Snapshot(path)")
    if key is not None:
        expect_type(key, str, "key", "a logical key or None")
    manifest = snapshot.manifest
    if key is not None:
        key = resolve_key(manifest, key)
    items, skipped = select(manifest, key)
    info = {
        "casnap.snapshot": snapshot.name,
        "casnap.manifest": snapshot.manifest_hash,
    }
    if "step" in manifest.metadata:
        info["casnap.step"] = json.dumps(manifest.metadata["step"])
    if key is not None:
        info["casnap.key"] = key
    return items, skipped, info
