"""The parent of a take that was given none: the newest snapshot committed in its folder.

A take names its parent (``parents=``), or descends from its session's
previous take or restore. When neither says anything, as for every
``Snapshot.take(f"{root}/step_{n}", app_state)`` without a session, a DCP
save, or a job that starts a new process per save, the parent is found in
the store, as restic finds the latest snapshot of the same host and paths:

- the **folder** of a snapshot is its name in the repository up to its last
  ``/`` (``runA/step_5`` is in ``runA/``; ``step_5`` is in the top level,
  ``""``). Only snapshots in exactly that folder are candidates:
  ``runA/eval/step_5`` is not in ``runA/``, and ``runB/step_5`` never
  parents ``runA/step_6``;
- the **newest** is the one whose ref the store wrote last (its modification
  time in the listing; by natural name order among equal or unknown times,
  so ``step_10`` after ``step_9``). A ref is the commit point, so every
  candidate is a committed snapshot.

The choice is made inside the take's lease (docs/gc.md): from then until the
ref is written no gc sweeps, so the parent's manifest, present when chosen,
keeps every chunk it names for the whole take, exactly as a session's parent
does. A parent that retention deleted before the take is simply not a
candidate any more.

Opting out: ``parents=[]`` for one take, ``storage_options={"auto_parent":
False}``, or ``CASNAP_AUTO_PARENT=0`` (docs/settings.md).
"""

from __future__ import annotations

from casnap.display import natural_key
from casnap.errors import CasnapError, IntegrityError, ObjectNotFoundError
from casnap.format.names import decode_name, is_hashed_key
from casnap.repo.named import recorded_name
from casnap.repo.repository import RepoStorage, manifest_key

_REFS = "refs"


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


def candidates(repo: RepoStorage, name: str) -> list[str]:
    """The snapshots in ``name``'s folder other than ``name``, newest first (see above)."""
    folder = folder_of(name)
    found: list[tuple[float, str]] = []
    for info in repo.store.list_info(_REFS):
        other = _name_of(repo, info.key[len(_REFS) + 1 :])
        if other is None or other == name or folder_of(other) != folder:
            continue
        found.append((info.mtime if info.mtime is not None else float("-inf"), other))
    found.sort(key=lambda t: (t[0], natural_key(t[1])), reverse=True)
    return [other for _, other in found]


def newest_parent(repo: RepoStorage, name: str) -> str | None:
    """The manifest hash of the newest committed snapshot in ``name``'s folder, or None.

    Called inside the take's lease. A candidate whose ref cannot be read
    (deleted meanwhile, damaged) or whose manifest is gone is passed over
    for the next newest one.
    """
    for other in candidates(repo, name):
        try:
            manifest = repo.resolve(other)
            if repo.store.exists(manifest_key(manifest)):
                return manifest
        except CasnapError:
            continue
    return None
