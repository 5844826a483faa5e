"""A repository: config, immutable objects (chunks, packs, manifests) and refs.

Layout below the repository root (docs/format.md)::

    .casnap/config.json
    .casnap/chunks/<h[:2]>/<h>      one chunk frame, h = blake3 of the raw chunk
    .casnap/packs/<p[:2]>/<p>       frames of small chunks, p = blake3 of the pack bytes
    .casnap/manifests/<m[:2]>/<m>   manifest JSON, m = blake3 of the JSON bytes
    .casnap/refs/<name>             snapshot name -> manifest (the commit point)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

from casnap.errors import (
    ManifestValidationError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    as_path,
    expect_type,
)
from casnap.format.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Manifest,
    Ref,
    RepoConfig,
    canonical_json,
    parse_config,
    parse_manifest,
    parse_ref,
)
from casnap.format.names import check_hash, check_ref_name, hash_bytes
from casnap.settings import DEFAULT_CHUNK_SIZE
from casnap.store import ObjectStore, open_store

META = ".casnap"
CONFIG_KEY = "config.json"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def chunk_key(h: str) -> str:
    return f"chunks/{h[:2]}/{h}"


def pack_key(p: str) -> str:
    return f"packs/{p[:2]}/{p}"


def manifest_key(m: str) -> str:
    return f"manifests/{m[:2]}/{m}"


def ref_key(name: str) -> str:
    return f"refs/{check_ref_name(name)}"


class RepoStorage:
    """The storage of a casnap repository: its config, immutable objects and refs.

    This is the layer the pipelines build on; :class:`casnap.Repository` is
    the public face (log, diff, du, gc, ...) built on top of it.

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

    @classmethod
    def _make(cls, root: ObjectStore, config: RepoConfig) -> Any:
        """An instance of ``cls`` over ``root``, whatever ``cls``'s own constructor takes."""
        obj = cls.__new__(cls)
        RepoStorage.__init__(obj, root, config)
        return obj

    # -- opening ---------------------------------------------------------
    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None) -> RepoStorage:
        root = open_store(as_path(url, "url"), _options(storage_options))
        try:
            data = root.get(f"{META}/{CONFIG_KEY}", limit=MAX_RECORD_BYTES)
        except ObjectNotFoundError as exc:
            raise RepositoryNotFoundError(f"no casnap repository at {url!r}") from exc
        return cls._make(root, parse_config(data))

    @classmethod
    def open_or_create(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> RepoStorage:
        """Open the repository at ``url``, creating it if absent (safe against a racing creator)."""
        url = as_path(url, "url")
        return cls.on_store(open_store(url, _options(storage_options)), chunk_size=chunk_size)

    @classmethod
    def on_store(cls, root: ObjectStore, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> RepoStorage:
        """The repository rooted at an already-open store, created if absent.

        Pass the result as ``storage_options={"repository": repo}`` to make
        ``Snapshot`` use this exact store (for example a CountingStore).
        """
        key = f"{META}/{CONFIG_KEY}"
        try:
            return cls._make(root, parse_config(root.get(key, limit=MAX_RECORD_BYTES)))
        except ObjectNotFoundError:
            pass
        config = RepoConfig(
            format_version=FORMAT_VERSION,
            repo_id=uuid.uuid4().hex,
            chunk_size=chunk_size,
            created_at=now_iso(),
        )
        try:
            root.put(key, canonical_json(config.model_dump(mode="json")), create_only=True)
        except ObjectExistsError:
            config = parse_config(root.get(key, limit=MAX_RECORD_BYTES))
        return cls._make(root, config)

    @staticmethod
    def exists_at(url: str, storage_options: dict[str, Any] | None = None) -> bool:
        url = as_path(url, "url")
        return open_store(url, _options(storage_options)).exists(f"{META}/{CONFIG_KEY}")

    # -- manifests -------------------------------------------------------
    def write_manifest(self, manifest: Manifest, jsonable: dict[str, Any] | None = None) -> str:
        """Store ``manifest`` (``jsonable``: its :meth:`Manifest.to_jsonable`); returns its hash."""
        data = manifest.to_bytes(jsonable)
        name = hash_bytes(data)
        try:
            self.store.put(manifest_key(name), data, create_only=True)
        except ObjectExistsError:
            pass  # same bytes, same name: already durable
        return name

    def read_manifest(self, name: str) -> Manifest:
        check_hash(name, "manifest name")
        try:
            data = self.store.get(manifest_key(name), limit=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError as exc:
            raise SnapshotNotFoundError(f"manifest {name} is missing from {self.url}") from exc
        return parse_manifest(data, name)

    # -- refs ------------------------------------------------------------
    def write_ref(self, name: str, manifest: str) -> None:
        """Commit a snapshot: create-only, so a name is never silently replaced.

        Idempotent: if the ref already names ``manifest`` the commit is done.
        That is what a client sees when its create took effect but the answer
        was lost and it (or the store's own client library) tried again.
        """
        ref = Ref(manifest=check_hash(manifest), created_at=now_iso())
        try:
            self.store.put(ref_key(name), canonical_json(ref.model_dump()), create_only=True)
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

    def read_ref(self, name: str) -> Ref:
        try:
            data = self.store.get(ref_key(name), limit=MAX_RECORD_BYTES)
        except ObjectNotFoundError as exc:
            raise SnapshotNotFoundError(f"no snapshot {name!r} in {self.url}", name) from exc
        return parse_ref(data, name)

    def has_ref(self, name: str) -> bool:
        return self.store.exists(ref_key(name))

    def resolve(self, name: str) -> str:
        """The manifest hash a snapshot name points to."""
        return self.read_ref(name).manifest

    def list_snapshots(self) -> list[str]:
        return sorted(k[len("refs/") :] for k in self.store.list("refs"))

    def delete_ref(self, name: str) -> None:
        self.store.delete(ref_key(name))

    def iter_manifest_names(self) -> Iterator[str]:
        for key in self.store.list("manifests"):
            yield key.rsplit("/", 1)[-1]


# -- discovery -----------------------------------------------------------
def _options(storage_options: Any) -> dict[str, Any] | None:
    if storage_options is not None:
        expect_type(storage_options, Mapping, "storage_options", "a dict or None")
    return storage_options


def split_url(path: str) -> tuple[str, list[str]]:
    """``("gs://", ["b", "run", "snap"])`` or ``("", ["/", ...])`` for local paths."""
    path = as_path(path)
    if "://" in path and not path.startswith("file://"):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://", [p for p in rest.split("/") if p]
    local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    return "", [p for p in local.split(os.sep) if p]


def _join(scheme: str, parts: list[str]) -> str:
    return scheme + "/".join(parts) if scheme else os.sep + os.sep.join(parts)


def locate(
    path: str,
    storage_options: dict[str, Any] | None,
    *,
    create: bool,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[RepoStorage, str]:
    """Find the repository holding snapshot ``path`` and the snapshot's name in it.

    An explicit ``storage_options["repository"]`` wins; else the nearest ancestor
    of ``path`` that holds a repository; else (``create=True``) the path's parent
    directory becomes a new repository with default chunk size ``chunk_size``.
    """
    options = dict(_options(storage_options) or {})
    explicit = options.pop("repository", None)
    scheme, parts = split_url(path)
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
        repo_parts = r_parts
    else:
        repo_parts = []
        for depth in range(len(parts) - 1, 0, -1):
            if RepoStorage.exists_at(_join(scheme, parts[:depth]), options):
                repo_parts = parts[:depth]
                break
        if not repo_parts:
            if not create:
                raise SnapshotNotFoundError(f"no casnap repository holds {path!r}", path)
            repo_parts = parts[:-1]
    name = check_ref_name("/".join(parts[len(repo_parts) :]))
    if isinstance(explicit, RepoStorage):
        return explicit, name
    url = _join(scheme, repo_parts)
    if not create:
        return RepoStorage.open(url, options), name
    return RepoStorage.open_or_create(url, options, chunk_size=chunk_size), name
