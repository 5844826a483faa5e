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

import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from casnap.errors import (
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
        root = open_store(as_path(url, "url"), store_options(storage_options))
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
        root = open_store(url, store_options(storage_options))
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
        return open_store(url, store_options(storage_options)).exists(f"{META}/{CONFIG_KEY}")

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


def store_options(storage_options: Any) -> dict[str, Any] | None:
    """``storage_options`` checked: a dict of the store's (fsspec) options, or None."""
    if storage_options is not None:
        expect_type(storage_options, Mapping, "storage_options", "a dict or None")
        check_storage_options(storage_options)
    return cast("dict[str, Any] | None", storage_options)
