"""A repository: config, immutable objects (chunks, packs, manifests) and refs.

Layout below the repository root (docs/format.md)::

    .casnap/config.json
    .casnap/chunks/<h[:2]>/<h>      one chunk frame, h = blake3 of the raw chunk
    .casnap/packs/<p[:2]>/<p>       frames of small chunks, p = blake3 of the pack bytes
    .casnap/manifests/<m[:2]>/<m>   manifest JSON, m = blake3 of the JSON bytes; its
                                    parts are loose objects in chunks/ (casnap.repo.parts)
    .casnap/refs/<key>              snapshot name -> manifest (the commit point);
                                    <key> is name_key(name): one flat component
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from casnap.errors import (
    ConfigError,
    InvalidNameError,
    ManifestValidationError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    SnapshotChangedError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    as_path,
    expect_type,
)
from casnap.format.json_text import canonical_json
from casnap.format.manifest import Manifest
from casnap.format.manifest_bytes import EntryTexts, split
from casnap.format.names import check_hash, check_ref_name, hash_bytes, is_hashed_key
from casnap.format.parse import (
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    parse_config,
    parse_manifest,
    parse_ref,
)
from casnap.format.records import Ref, RepoConfig, record_bytes
from casnap.format.versions import FORMAT_VERSION
from casnap.repo.named import check_recorded_name, named_keys, names_in
from casnap.repo.parts import PartMemo, store_parts
from casnap.settings import DEFAULT_CHUNK_SIZE, check_storage_options
from casnap.store import ObjectStore, open_store

META = ".casnap"
CONFIG_KEY = "config.json"


def config_bytes(config: RepoConfig) -> bytes:
    """The config as stored; ``shared`` only when true, so an implicit repository's
    config is the same bytes as before the field existed (older readers open it)."""
    doc = config.model_dump(mode="json")
    if not doc["shared"]:
        del doc["shared"]
    return canonical_json(doc)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def chunk_key(h: str) -> str:
    return f"chunks/{h[:2]}/{h}"


def pack_key(p: str) -> str:
    return f"packs/{p[:2]}/{p}"


def manifest_key(m: str) -> str:
    return f"manifests/{m[:2]}/{m}"


class RepoStorage:
    """The storage of a casnap repository: its config, immutable objects and refs.

    This is the layer the pipelines build on; :class:`casnap.Repository` is
    the public face (log, diff, du, gc, ...) and holds one as ``.storage``.

    Example::

        repo = RepoStorage.open("/ckpt/run1")
        for name in repo.list_snapshots():
            print(name, repo.read_manifest(repo.resolve(name)).metadata)
    """

    def __init__(self, root: ObjectStore, config: RepoConfig) -> None:
        self.root = root
        self.store = root.child(META)
        self.config = config
        self.url = root.url
        self.parts = PartMemo(self.store)  # parts parsed, shared by the manifests read
        # Set when this object created the repository, until the first take into it
        # consumes it (casnap.take.target.resolve_target): nothing to deduplicate against.
        self.created = False

    # -- opening ---------------------------------------------------------
    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None) -> RepoStorage:
        root = open_store(as_path(url, "url"), _options(storage_options))
        try:
            data = root.get(f"{META}/{CONFIG_KEY}", limit=MAX_RECORD_BYTES)
        except ObjectNotFoundError as exc:
            raise RepositoryNotFoundError(f"no casnap repository at {url!r}") from exc
        return cls(root, parse_config(data))

    @classmethod
    def open_or_create(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        shared: bool = False,
        seen_absent: bool = False,
    ) -> RepoStorage:
        """Open the repository at ``url``, creating it if absent (safe against a racing creator).

        ``seen_absent``: the caller has just found no config there, so it is not
        read again before the create-only put (which still loses to a racing creator).
        """
        url = as_path(url, "url")
        root = open_store(url, _options(storage_options))
        return cls.on_store(root, chunk_size=chunk_size, shared=shared, seen_absent=seen_absent)

    @classmethod
    def on_store(
        cls,
        root: ObjectStore,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        shared: bool = False,
        seen_absent: bool = False,
    ) -> RepoStorage:
        """The repository rooted at an already-open store, created if absent.

        ``shared``: a new repository is recorded as created on purpose to hold
        the runs below it (``Repository.init``), not implicitly by a take.

        Pass the result as ``repository=repo`` to make
        ``Snapshot`` use this exact store (for example a CountingStore).
        """
        key = f"{META}/{CONFIG_KEY}"
        if not seen_absent:
            try:
                return cls(root, parse_config(root.get(key, limit=MAX_RECORD_BYTES)))
            except ObjectNotFoundError:
                pass
        config = RepoConfig(
            format_version=FORMAT_VERSION,
            repo_id=uuid.uuid4().hex,
            chunk_size=chunk_size,
            created_at=now_iso(),
            shared=shared,
        )
        try:
            root.put(key, config_bytes(config), create_only=True)
        except ObjectExistsError:
            return cls(root, parse_config(root.get(key, limit=MAX_RECORD_BYTES)))
        repo = cls(root, config)
        repo.created = True
        return repo

    def share(self) -> None:
        """Record that this repository holds the runs below it (``casnap init`` on an existing one).

        The one change ever made to a config: it is rewritten, atomically,
        with ``shared: true`` and everything else as it was.
        """
        if self.config.shared:
            return
        config = self.config.model_copy(update={"shared": True})
        self.root.put(f"{META}/{CONFIG_KEY}", config_bytes(config))
        self.config = config

    @staticmethod
    def exists_at(url: str, storage_options: dict[str, Any] | None = None) -> bool:
        url = as_path(url, "url")
        return open_store(url, _options(storage_options)).exists(f"{META}/{CONFIG_KEY}")

    # -- manifests -------------------------------------------------------
    def write_manifest(
        self, manifest: Manifest, texts: Mapping[str, str] | None = None
    ) -> tuple[str, Manifest]:
        """Store ``manifest``'s parts, then itself (``texts``: its entries' JSON, see
        :func:`casnap.format.manifest_bytes.split`); returns its hash and the manifest
        as stored, its ``parts`` listed (what gc, verify and summaries follow)."""
        data, parts = split(manifest, texts)
        store_parts(self.store, parts)
        if isinstance(texts, EntryTexts) and texts.of is manifest.entries:
            texts.stored()  # a re-take of the same texts puts none of them again
        name = hash_bytes(data)
        try:
            self.store.put(manifest_key(name), data, create_only=True)
        except ObjectExistsError:
            pass  # same bytes, same name: already durable
        if parts:
            manifest = manifest.model_copy(update={"parts": [p.ref for p in parts]})
        return name, manifest

    def read_manifest(self, name: str) -> Manifest:
        check_hash(name, "manifest name")
        try:
            data = self.store.get(manifest_key(name), limit=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError as exc:
            raise SnapshotNotFoundError(f"manifest {name} is missing from {self.url}") from exc
        return parse_manifest(data, name, self.parts.load)

    # -- refs ------------------------------------------------------------
    def write_ref(self, name: str, manifest: str) -> None:
        """Commit a snapshot: create-only, so a name is never silently replaced.

        Idempotent: if the ref already names ``manifest`` the commit is done.
        That is what a client sees when its create took effect but the answer
        was lost and it (or the store's own client library) tried again.
        """
        key, *old = named_keys("refs", check_ref_name(name))
        # Under a hashed key the ref says its name (listings read it from there).
        recorded = name if is_hashed_key(key[len("refs/") :]) else None
        ref = Ref(manifest=check_hash(manifest), created_at=now_iso(), name=recorded)
        try:
            for taken in old:  # the name where an older version put it
                if self.store.exists(taken):
                    raise ObjectExistsError(f"{taken} exists", taken)
            self.store.put(key, record_bytes(ref), create_only=True)
        except ObjectExistsError as exc:
            try:
                if self.read_ref(name).manifest == ref.manifest:
                    return
            except (SnapshotNotFoundError, ManifestValidationError):
                pass  # deleted meanwhile, or unreadable: either way not ours
            raise SnapshotExistsError(
                f"snapshot {name!r} already exists in {self.url}; snapshots are immutable, "
                "choose a new path",
                name,
            ) from exc

    def replace_ref(self, name: str, manifest: str, expected: str) -> None:
        """Point ``name`` from manifest ``expected`` to ``manifest`` with one conditional
        replace of the ref (a re-save's commit point; docs/dcp.md): of writers racing
        from one version exactly one wins, the others raise :class:`SnapshotChangedError`
        having written nothing (as when ``name`` no longer names ``expected``)."""
        key, *older = named_keys("refs", check_ref_name(name))
        recorded = name if is_hashed_key(key[len("refs/") :]) else None
        ref = Ref(manifest=check_hash(manifest), created_at=now_iso(), name=recorded)
        found = self._stored_ref(name)
        if found is None or found[2].manifest != expected:
            raise SnapshotChangedError(
                f"snapshot {name!r} in {self.url} no longer names {expected[:12]} "
                "(another writer moved or deleted it); not replaced",
                name,
            )
        at, current, _ = found
        try:
            self.store.replace(key, record_bytes(ref), expected=current if at == key else None)
        except ObjectChangedError as exc:
            raise SnapshotChangedError(
                f"snapshot {name!r} in {self.url} was replaced by another writer while "
                "this one replaced it; not replaced",
                name,
            ) from exc
        for stale in older:  # the name where an older version put it
            self.store.delete(stale)

    def read_ref(self, name: str) -> Ref:
        found = self._stored_ref(name)
        if found is None:
            raise SnapshotNotFoundError(f"no snapshot {name!r} in {self.url}", name)
        return found[2]

    def _stored_ref(self, name: str) -> tuple[str, bytes, Ref] | None:
        """Where the ref of ``name`` is stored, its bytes and the ref; None if there is none."""
        for key in named_keys("refs", check_ref_name(name)):
            try:
                data = self.store.get(key, limit=MAX_RECORD_BYTES)
            except ObjectNotFoundError:
                continue
            ref = parse_ref(data, name)
            check_recorded_name("refs", key[len("refs/") :], name, ref.name)
            return key, data, ref
        return None

    def has_ref(self, name: str) -> bool:
        return any(self.store.exists(k) for k in named_keys("refs", check_ref_name(name)))

    def resolve(self, name: str) -> str:
        """The manifest hash a snapshot name points to."""
        return self.read_ref(name).manifest

    def list_snapshots(self) -> list[str]:
        """Snapshot names in natural order (``step_2`` before ``step_10``), decoded: as
        they were given to the take.

        A damaged ref under a hashed key (a long name) cannot say its name: it is
        refused (:class:`casnap.errors.ManifestValidationError`); ``verify`` lists them all.
        """
        return names_in(self.store, "refs")

    def delete_ref(self, name: str) -> None:
        for key in named_keys("refs", check_ref_name(name)):
            self.store.delete(key)

    def iter_manifest_names(self) -> Iterator[str]:
        for key in self.store.list("manifests"):
            yield key.rsplit("/", 1)[-1]


# -- discovery -----------------------------------------------------------
def _options(storage_options: Any) -> dict[str, Any] | None:
    """``storage_options`` checked: a dict of the store's (fsspec) options, or None."""
    if storage_options is not None:
        expect_type(storage_options, Mapping, "storage_options", "a dict or None")
        check_storage_options(storage_options)
    return cast("dict[str, Any] | None", storage_options)


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
    options = dict(_options(storage_options) or {})
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
