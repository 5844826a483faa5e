"""Where a snapshot path's repository is: the path's ancestors, or the one named.

:func:`locate` turns a snapshot path (a local path or a URL) and the store's options
into its repository and the snapshot's name in it, creating the repository where
a take asks; the checks on paths a take may write are here too (docs/repository.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

from casnap.errors import (
    ConfigError,
    InvalidNameError,
    RepositoryNotFoundError,
    SnapshotNotFoundError,
    as_path,
    expect_type,
)
from casnap.format.names import check_ref_name
from casnap.repo.repository import RepoStorage, store_options
from casnap.settings import DEFAULT_CHUNK_SIZE

# Where a snapshot path's repository is named: a URL, an open RepoStorage, or a
# casnap.Repository (anything whose ``storage`` is a RepoStorage; api sits above).
RepositoryArg = Any


def _repository(repository: RepositoryArg) -> str | RepoStorage | None:
    """``repository`` (a ``casnap.Repository``, a RepoStorage, a URL or None) checked."""
    repository = getattr(repository, "storage", repository)  # a casnap.Repository: its storage
    if repository is not None and not isinstance(repository, RepoStorage):
        expect_type(repository, str, "repository", "a casnap.Repository, a URL or None")
    return cast("str | RepoStorage | None", repository)


def split_url(path: str) -> tuple[str, list[str]]:
    """``("gs://", ["b", "run", "snap"])`` or ``("", ["/", ...])`` for local paths."""
    path = as_path(path)
    if "://" in path and not path.startswith("file://"):
        scheme, rest = path.split("://", 1)
        parts = [p for p in rest.split("/") if p]
        if any(p in (".", "..") for p in parts):  # a store may resolve them: refuse, never guess
            raise InvalidNameError(f"{path!r}: '.' and '..' are refused in a URL's path")
        return f"{scheme}://", parts
    local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    return "", [p for p in local.split(os.sep) if p]


def _join(scheme: str, parts: list[str]) -> str:
    return scheme + "/".join(parts) if scheme else os.sep + os.sep.join(parts)


HOW_TO_CHOOSE = (
    "choose the repository: take into a deeper path such as /ckpt/run1/step_100 (its parent "
    "/ckpt/run1 becomes the repository), name one with repository='/ckpt/run1', or create "
    "a shared one with `casnap init DIR` (docs/repository.md, 'Where snapshots live')"
)


def _local_parts(path: str) -> list[str]:
    return [p for p in os.path.abspath(os.path.expanduser(path)).split(os.sep) if p]


def _is_cwd_or_ancestor(path: str) -> bool:
    """Whether local ``path`` is the working directory or a directory above it (``/`` too),
    by its absolute path and, so a link cannot hide it, by its resolved one."""
    cwd, given = os.getcwd(), os.path.expanduser(path)
    for target, here in (
        (os.path.abspath(given), cwd),
        (os.path.realpath(given), os.path.realpath(cwd)),
    ):
        if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
            return True
    return False


def _check_take_path(path: str, scheme: str, parts: list[str]) -> None:
    """Refuse a take path whose repository nobody would predict (docs/repository.md)."""
    if scheme:
        return
    home = os.path.expanduser("~")
    if not parts:
        why = "names the file system root /"
    elif parts == _local_parts(os.getcwd()):
        why = "names the working directory itself"
    elif home != "~" and parts == _local_parts(home):
        why = "is the home directory itself"
    elif _is_cwd_or_ancestor(path):
        why = "names a directory the working directory is in (the job would run inside it)"
    else:
        return
    raise ConfigError(f"snapshot path {path!r} {why}; {HOW_TO_CHOOSE}", "path")


def _check_new_repository(path: str, scheme: str, repo_parts: list[str]) -> None:
    """A take never creates a repository at ``/`` or in the home directory by itself."""
    if scheme:
        return
    home = os.path.expanduser("~")
    if not repo_parts:
        where = "the file system root /"
    elif home != "~" and repo_parts == _local_parts(home):
        where = f"the home directory {_join(scheme, repo_parts)}"
    else:
        return
    raise ConfigError(
        f"snapshot path {path!r} would make {where} a repository; {HOW_TO_CHOOSE}", "path"
    )


def _ancestors(
    scheme: str, parts: list[str], options: dict[str, Any]
) -> Iterator[tuple[list[str], RepoStorage]]:
    """The ancestors of the snapshot path holding a repository, nearest first (never ``/``)."""
    for depth in range(len(parts) - 1, 0, -1):
        try:
            yield parts[:depth], RepoStorage.open(_join(scheme, parts[:depth]), options)
        except RepositoryNotFoundError:
            continue


def _holds(repo: RepoStorage, name: str) -> bool:
    try:
        return repo.has_ref(name)
    except InvalidNameError:
        return False


def locate(
    path: str,
    storage_options: dict[str, Any] | None,
    *,
    create: bool,
    existing: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    repository: RepositoryArg = None,
) -> tuple[RepoStorage, str]:
    """Find the repository holding snapshot ``path`` and the snapshot's name in it.

    By the rules of docs/repository.md, "Where snapshots live": an explicit
    ``repository`` (a URL, a RepoStorage or a ``casnap.Repository``) wins; else
    the nearest ancestor holding a repository, if it is the path's parent or
    shared (a read, ``create=False``, then tries each further ancestor that
    holds the name); else, with ``create=True``, the path's parent becomes a
    new repository with default chunk size ``chunk_size`` (never ``/`` or the
    home directory: :class:`casnap.ConfigError`).

    The name is checked before anything is created (:class:`casnap.errors.InvalidNameError`).
    ``existing``: a read of a snapshot that must exist; when no repository holds
    it, :class:`casnap.SnapshotNotFoundError` names every repository looked in.
    (Without it a read may return the repository a take would use: other ranks
    of a distributed take find rank 0's repository before the snapshot exists.)
    """
    options = dict(store_options(storage_options) or {})
    explicit = _repository(repository)
    scheme, parts = split_url(path)
    if create and explicit is None:
        _check_take_path(path, scheme, parts)  # "/" too: a ConfigError that says what to do
    if not parts or (scheme and len(parts) < 2):
        raise SnapshotNotFoundError(f"{path!r} names no snapshot inside a repository", path)
    if explicit is not None:
        r_scheme, r_parts = split_url(
            explicit.url if isinstance(explicit, RepoStorage) else explicit
        )
        if r_scheme != scheme or parts[: len(r_parts)] != r_parts or len(parts) == len(r_parts):
            raise SnapshotNotFoundError(
                f"snapshot path {path!r} is not inside repository {explicit!r}", path
            )
        name = check_ref_name("/".join(parts[len(r_parts) :]))
        if isinstance(explicit, RepoStorage):
            return explicit, name
        url = _join(scheme, r_parts)
        if not create:
            return RepoStorage.open(url, options), name
        return RepoStorage.open_or_create(url, options, chunk_size=chunk_size), name
    looked: list[str] = []
    nearest: tuple[RepoStorage, str] | None = None
    for repo_parts, repo in _ancestors(scheme, parts, options):
        name = "/".join(parts[len(repo_parts) :])
        if not looked and (len(repo_parts) == len(parts) - 1 or repo.config.shared):
            nearest = repo, name  # the repository a take uses
        if create:
            break  # only the nearest decides where a take goes
        # A read also finds the name further up: older versions put deeper snapshots
        # into an ancestor, and a take may since have made a nearer repository.
        looked.append(repo.url)
        if _holds(repo, name):
            return repo, name
    if nearest is not None:
        repo, name = nearest[0], check_ref_name(nearest[1])
        if existing and not create:
            raise SnapshotNotFoundError(
                f"no snapshot {name!r} in {repo.url}"
                + (f" (nor at this path in {', '.join(looked[1:])})" if looked[1:] else ""),
                name,
            )
        return repo, name
    if not create:
        where = f" (looked in {', '.join(looked)})" if looked else ""
        raise SnapshotNotFoundError(f"no casnap repository holds {path!r}{where}", path)
    name = check_ref_name(parts[-1])
    _check_new_repository(path, scheme, parts[:-1])
    url = _join(scheme, parts[:-1])
    # _ancestors has just found no config at the parent (its first probe).
    repo = RepoStorage.open_or_create(url, options, chunk_size=chunk_size, seen_absent=True)
    return repo, name
