"""The parent of a take that was given none: the newest snapshot committed in its folder.

When neither ``parents=`` nor a session names one (``Snapshot.take(f"{root}/
step_{n}", app_state)`` without a session, a DCP save, a new process per
save), the parent is found in the store as restic finds the latest snapshot
of the same host and paths. What a folder is, what "newest" means (the ref
written last; ties by manifest creation time, then natural name order), why
the choice is made inside the take's lease, and how to opt out:
docs/repository.md, "Parents".
"""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import groupby

from casnap.display import natural_key
from casnap.errors import CasnapError, IntegrityError, ObjectNotFoundError
from casnap.format.names import decode_name, is_hashed_key
from casnap.index import manifest_summary
from casnap.repo.named import recorded_name
from casnap.repo.repository import RepoStorage, manifest_key

_REFS = "refs"
_NEVER = datetime.min.replace(tzinfo=UTC)


def folder_of(name: str) -> str:
    """The folder of snapshot ``name``: everything before its last ``/`` (``""``: the top)."""
    return name.rpartition("/")[0]


def _name_of(repo: RepoStorage, key: str) -> str | None:
    if not is_hashed_key(key):
        return decode_name(key)
    try:  # a name too long for a flat key: its record says it
        return recorded_name(repo.store, _REFS, key)
    except (ObjectNotFoundError, IntegrityError):
        return None  # deleted meanwhile, or damaged: not a parent (verify reports it)


def _listed(repo: RepoStorage, name: str) -> list[tuple[float | None, str]]:
    """(listed time, name) of the snapshots in ``name``'s folder other than ``name``,
    newest first by time, then by natural name order (see above)."""
    folder = folder_of(name)
    found: list[tuple[float | None, str]] = []
    for info in repo.store.list_info(_REFS):
        other = _name_of(repo, info.key[len(_REFS) + 1 :])
        if other is None or other == name or folder_of(other) != folder:
            continue
        found.append((info.mtime, other))
    found.sort(
        key=lambda t: (t[0] if t[0] is not None else float("-inf"), natural_key(t[1])),
        reverse=True,
    )
    return found


def candidates(repo: RepoStorage, name: str) -> list[str]:
    """The snapshots in ``name``'s folder other than ``name``, by listed time and name,
    newest first (:func:`newest_parent` orders refs listed with one time further)."""
    return [other for _, other in _listed(repo, name)]


def _created(repo: RepoStorage, manifest: str) -> datetime:
    try:
        when = manifest_summary(repo, manifest).created_at
        created = datetime.fromisoformat(when)
    except (CasnapError, ValueError):
        return _NEVER  # unreadable: after every readable one of its time
    return created if created.tzinfo is not None else created.replace(tzinfo=UTC)


def newest_parent(repo: RepoStorage, name: str) -> str | None:
    """The manifest hash of the newest committed snapshot in ``name``'s folder, or None.

    Called inside the take's lease. A candidate whose ref cannot be read
    (deleted meanwhile, damaged) or whose manifest is gone is passed over
    for the next newest one. Refs listed with the same time are ordered by
    their manifests' creation (a summary the index usually holds): only
    those are resolved together.
    """
    for listed_at, group in groupby(_listed(repo, name), key=lambda t: t[0]):
        names = [other for _, other in group]
        if listed_at is None:  # unknown times: natural name order, resolved one by one
            for other in names:
                if (manifest := _manifest_of(repo, other)) is not None:
                    return manifest
            continue
        found = [m for m in (_manifest_of(repo, other) for other in names) if m is not None]
        if found:
            # stable: natural name order among equal creation times
            return max(found, key=lambda m: _created(repo, m)) if len(found) > 1 else found[0]
    return None


def _manifest_of(repo: RepoStorage, name: str) -> str | None:
    try:
        manifest = repo.resolve(name)
        return manifest if repo.store.exists(manifest_key(manifest)) else None
    except CasnapError:
        return None
