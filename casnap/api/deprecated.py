"""Top-level names that left ``casnap`` in 0.2, kept one release as deprecated aliases.

``casnap.<name>`` still works for each, with a :class:`DeprecationWarning` naming
the new spelling (``casnap/__init__.py``, ``__getattr__``); the list and the
reasons are in docs/architecture.md, "Public API". Classes are returned as
they are (the same object). The functions that duplicated
:class:`casnap.Repository` methods are these shims: they take a
``Repository`` as well as the storage they used to take, and call the
function underneath.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from casnap.api.repository import Repository
from casnap.ops import copy as copying
from casnap.ops import retention
from casnap.repo import tags
from casnap.repo.repository import RepoStorage

# Every moved error and warning is in casnap.errors under the same name (casnap.errors.__all__).
MOVED_CLASSES = {
    "CopyResult": "casnap.ops.copy",
    "RetentionPlan": "casnap.ops.retention",
    "TagInfo": "casnap.repo.tags",
}

# Old name -> the new spelling a warning gives.
MOVED_FUNCTIONS = {
    "add_tag": "casnap.Repository(url).tag(tag, snapshot)",
    "list_tags": "casnap.Repository(url).tags()",
    "remove_tag": "casnap.Repository(url).untag(tag)",
    "copy": "casnap.Repository(src).copy_to(dst, names)",
    "plan_retention": "casnap.Repository(url).retain(policy, dry_run=True).plan",
    "execute_retention": "casnap.Repository(url).retain(plan)",
}


def _storage(repo: Repository | RepoStorage | str) -> Any:
    return repo.storage if isinstance(repo, Repository) else repo


def add_tag(repo: Repository | RepoStorage, tag: str, snapshot_name: str) -> tags.TagInfo:
    return tags.add_tag(_storage(repo), tag, snapshot_name)


def list_tags(repo: Repository | RepoStorage) -> dict[str, tags.TagInfo]:
    return tags.list_tags(_storage(repo))


def remove_tag(repo: Repository | RepoStorage, tag: str) -> tags.TagInfo:
    return tags.remove_tag(_storage(repo), tag)


def copy(
    src: Repository | RepoStorage | str,
    dst: Repository | RepoStorage | str,
    names: Sequence[str] | None = None,
    **kwargs: Any,
) -> copying.CopyResult:
    return copying.copy(_storage(src), _storage(dst), names, **kwargs)


def plan_retention(
    repo: Repository | RepoStorage,
    policy: retention.RetentionPolicy,
    now: datetime | None = None,
    **kwargs: Any,
) -> retention.RetentionPlan:
    return retention.plan_retention(_storage(repo), policy, now, **kwargs)


def execute_retention(
    repo: Repository | RepoStorage, plan: retention.RetentionPlan
) -> retention.RetentionResult:
    return retention.execute_retention(_storage(repo), plan)
