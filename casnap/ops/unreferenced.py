"""Unreferenced objects: what no ref or tag reaches, as ``du`` and ``verify`` report it.

These are the manifests, chunk objects and packs a ``gc`` would delete once
they are older than its grace period (docs/gc.md): snapshots retired without
``--prune``, takes that died before their ref. Garbage costs space, never
correctness, so ``verify`` reports it without failing.

Example::

    from casnap.ops.unreferenced import find_unreferenced

    junk = find_unreferenced(repo, {"3f2a..."}, {"chunks/ab/ab12..."})
    print(junk.describe())
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from casnap.display import format_size
from casnap.repo.repository import RepoStorage
from casnap.store import ObjectInfo

_KEY = re.compile(r"^(manifests|chunks|packs)/([0-9a-f]{2})/([0-9a-f]{64})$")


@dataclass(frozen=True)
class Unreferenced:
    """Objects in the store that no ref or tag reaches, with their bytes."""

    manifests: int = 0
    objects: int = 0  # chunk objects and packs
    bytes: int = 0  # of both, as the store lists them

    @property
    def count(self) -> int:
        return self.manifests + self.objects

    def __bool__(self) -> bool:
        return bool(self.count)

    def describe(self) -> str:
        """One line for humans: how much, and how to delete it."""
        return (
            f"unreferenced: {self.manifests} manifest(s), {self.objects} chunk object(s)/pack(s), "
            f"{format_size(self.bytes)} that no ref or tag reaches; `casnap gc` deletes them once "
            "older than its grace period (1h), `casnap gc --grace 0` at once when every process "
            "writing this repository is a current casnap"
        )


def find_unreferenced(
    repo: RepoStorage,
    manifests: Collection[str],
    objects: Collection[str],
    listed: Iterable[ObjectInfo] | None = None,
    listed_manifests: Iterable[ObjectInfo] | None = None,
) -> Unreferenced:
    """What one listing of ``manifests/``, ``chunks/`` and ``packs/`` holds beyond the given.

    ``manifests`` are the hashes the roots name; ``objects`` the keys
    (``chunks/<h[:2]>/<h>``, ``packs/<p[:2]>/<p>``) their manifests need;
    ``listed`` a listing of ``chunks/`` and ``packs/`` the caller already made,
    ``listed_manifests`` one of ``manifests/``.
    Keys of a shape casnap never writes and temp files are not counted.
    """
    count = {"manifests": 0, "objects": 0}
    size = 0
    if listed is None:
        listed = [i for kind in ("chunks", "packs") for i in repo.store.list_info(kind)]
    if listed_manifests is None:
        listed_manifests = repo.store.list_info("manifests")
    for info in itertools.chain(listed_manifests, listed):
        match = _KEY.match(info.key)
        if match is None or match.group(3)[:2] != match.group(2):
            continue
        if match.group(1) == "manifests":
            if match.group(3) in manifests:
                continue
            count["manifests"] += 1
        else:
            if info.key in objects:
                continue
            count["objects"] += 1
        size += info.size or 0
    return Unreferenced(count["manifests"], count["objects"], size)
