"""Naming a snapshot: by its name, by a tag, or as ``latest``.

Looked up in this order: a snapshot of that name, a repository tag of that
name (while its snapshot still holds the pinned manifest), then ``latest``
(by step, then creation time; ``run1/latest``: the newest below ``run1/``).
Anything else is :class:`casnap.SnapshotNotFoundError` naming the closest
snapshot and tag names (docs/repository.md, "Naming a snapshot").
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from casnap.errors import InvalidNameError, ObjectNotFoundError, SnapshotNotFoundError
from casnap.ops.retention import read_snapshots
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import read_tag, tag_names

LATEST = "latest"


def resolve_name(repo: RepoStorage, name: str) -> str:
    """The snapshot ``name`` means in ``repo`` (see the module docstring for the order)."""
    try:
        if repo.has_ref(name):
            return name
    except InvalidNameError:
        pass  # not a snapshot name; a tag or "latest" cannot be one either
    tagged = _tagged(repo, name)
    if tagged is not None:
        return tagged
    if name == LATEST or name.endswith("/" + LATEST):
        return _latest(repo, name[: -len(LATEST)])
    raise SnapshotNotFoundError(
        f"no snapshot or tag {name!r} in {repo.url}"
        + suggest(name, [*repo.list_snapshots(), *tag_names(repo)], f"`casnap ls {repo.url}`"),
        name,
    )


def suggest(name: str, known: Iterable[str], listing: str) -> str:
    """``"; did you mean 'a' or 'b'?"`` from the names closest to ``name``, else
    where to look (``listing``: the command that lists them)."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)
    if not close:
        return f"; {listing} lists them"
    quoted = [repr(c) for c in close]
    head = ", ".join(quoted[:-1])
    return f"; did you mean {head + ' or ' if head else ''}{quoted[-1]}?"


def _tagged(repo: RepoStorage, name: str) -> str | None:
    """The snapshot tag ``name`` is on, or None if there is no such tag."""
    try:
        info = read_tag(repo, name)
    except (ObjectNotFoundError, InvalidNameError):
        return None
    try:
        current = repo.resolve(info.snapshot)
    except SnapshotNotFoundError:
        current = None
    if current != info.manifest:
        # The commands read through snapshot names; the tag's manifest has none now.
        raise SnapshotNotFoundError(
            f"tag {name!r} pins snapshot {info.snapshot!r} as it was (manifest "
            f"{info.manifest[:12]}), and {repo.url} no longer has it under that name",
            name,
        )
    return info.snapshot


def _latest(repo: RepoStorage, prefix: str) -> str:
    """The newest snapshot whose name starts with ``prefix`` (by step, then time)."""
    names = [n for n in repo.list_snapshots() if n.startswith(prefix)]
    infos, _unreadable = read_snapshots(repo, names, tags={})
    if not infos:
        where = f" below {prefix.rstrip('/')!r}" if prefix else ""
        raise SnapshotNotFoundError(f"no snapshot{where} in {repo.url} to be 'latest'", LATEST)
    return infos[-1].name
