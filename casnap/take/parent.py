"""The one rule for a take's parents: every kind of take asks :class:`ParentRule`.

1. The parents given (``parents=``, a DCP re-save's replaced manifest): a
   manifest hash is kept as given, a snapshot name is resolved at once, so
   a wrong one fails before anything is written.
2. Else, through a session, the session's last take or restore (a
   session's first take has none: two sessions never parent each other).
3. Else, for a take without a session of its caller's (``Snapshot.take(f"
   {root}/step_{n}", app_state)``, a DCP save, a new process per save), the
   newest snapshot committed in its folder, found in the store as restic
   finds the latest snapshot of the same host and paths (setting
   ``auto_parent``; never in a repository the take created).

:meth:`ParentRule.choose` runs inside the take's lease, so the parent's
chunks stay until the take's ref names them. What a folder is, what
"newest" means (the ref written last; ties by manifest creation time, then
natural name order) and how to opt out: docs/repository.md, "Parents".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import groupby

from casnap.display import natural_key
from casnap.errors import CasnapError, IntegrityError, ObjectNotFoundError
from casnap.format.names import decode_name, is_hashed_key
from casnap.index import manifest_summary
from casnap.repo.named import recorded_name
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.settings import Settings
from casnap.take.session import Session

_REFS = "refs"
_NEVER = datetime.min.replace(tzinfo=UTC)
_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ParentRule:
    """What a take's parents will be (see the module docstring), decided by
    :meth:`choose` inside the take's lease."""

    given: tuple[str, ...] | None = None  # manifest hashes
    last: str | None = None  # the session's last take or restore
    newest: bool = False  # else the newest snapshot in the folder

    def choose(self, repo: RepoStorage, name: str) -> list[str]:
        """The parents of snapshot ``name``: call inside the take's lease."""
        if self.given is not None:
            return list(self.given)
        if self.last is not None:
            return [self.last]
        found = newest_parent(repo, name) if self.newest else None
        return [found] if found else []


def parent_rule(
    repo: RepoStorage,
    given: list[str] | None,
    session: Session | None,
    settings: Settings,
    fresh: bool,
    *,
    own_session: bool = False,
) -> ParentRule:
    """The rule for a take into ``repo``: ``given`` parents (names resolved now), else
    ``session``'s lineage, else the newest in the folder when the caller gave no
    session (``own_session``: the session is the taker's private one, as a
    :class:`~casnap.integrations.dcp_writer.CasnapWriter` given none makes)."""
    if given is not None:
        return ParentRule(tuple(_resolved(repo, p) for p in given))
    last = session.lineage.parent(repo.config.repo_id) if session is not None else None
    newest = (session is None or own_session) and settings.auto_parent and not fresh
    return ParentRule(None, last, newest)


def _resolved(repo: RepoStorage, parent: str) -> str:
    """A parent given as a manifest hash or a snapshot name, as the manifest hash.

    A hash is kept as given even if gc has collected that manifest (lineage may
    outlive what it points to; ``log`` shows such a parent as gone); a name
    must name a snapshot now.
    """
    if _HASH.match(parent):
        return parent
    return repo.resolve(parent)  # SnapshotNotFoundError when no snapshot has that name


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
