"""Which snapshot this process's state descends from, per repository.

A take's parent is the previous take of this process into the same
repository, or the snapshot this process last restored from; explicit
``parents=`` override it. This is the one piece of process-wide state in
casnap: lineage *is* a property of the process. It is guarded by a lock and
keyed by repository id, so repositories never see each other's lineage.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_last: dict[str, str] = {}


def current_parent(repo_id: str) -> str | None:
    with _lock:
        return _last.get(repo_id)


def record(repo_id: str, manifest: str) -> None:
    with _lock:
        _last[repo_id] = manifest


def forget(repo_id: str | None = None) -> None:
    """Drop the lineage of one repository (or all): the next take has no implicit parent."""
    with _lock:
        if repo_id is None:
            _last.clear()
        else:
            _last.pop(repo_id, None)
