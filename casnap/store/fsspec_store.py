"""Any fsspec filesystem as an object store (``memory://``, ``gs://``, others)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar
from urllib.parse import quote

import fsspec

from casnap.errors import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRefusedError,
    StoreError,
)
from casnap.store.base import (
    Capabilities,
    Data,
    ObjectInfo,
    ObjectStore,
    changed,
    check_key,
    check_limit,
    join_parts,
)

# Protocols whose create-only write is a server-side precondition (atomic
# across processes). For the rest, create-only is check-then-write, made atomic
# only among the stores sharing one filesystem object by a lock kept on it
# (fsspec hands every store of one protocol and options the same instance).
_ATOMIC_CREATE = {"gs", "gcs"}
# Protocols whose replace is a server-side precondition too (GCS: the object's
# generation); elsewhere it is compare-then-write under the same in-process lock.
_CONDITIONAL_REPLACE = {"gs", "gcs"}
_MULTIPART = "==casnap-multipart=="  # the boundary of a GCS multipart upload
_CREATE_LOCK_ATTR = "_casnap_create_lock"

# Protocols whose paths are local files, where a key may hold a FIFO, a device
# or a symbolic link (an object store holds only objects).
_LOCAL_PROTOCOLS = {"file", "local"}

_RANGE_NOT_SATISFIABLE = 416
# HTTP statuses a repeat of the request may not meet: timeout, throttling, server trouble.
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
# Exception types (by name, so that no HTTP client is imported here) a retry may cure.
_TRANSIENT_TYPES = {
    "ClientConnectionError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ConnectionError",
    "TransportError",
    "ChunkedEncodingError",
}


def _default_options(protocol: str) -> dict[str, Any]:
    if protocol in ("gs", "gcs"):
        # Listings cached by one handle go stale when another process writes;
        # casnap lists to decide what gc may delete, so it must see fresh state.
        opts: dict[str, Any] = {"use_listings_cache": False}
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            opts.update(token="anon", endpoint_url=emulator)
        return opts
    return {}


def _open_fs(protocol: str, url: str, options: dict[str, Any]) -> tuple[Any, str]:
    if protocol in ("gs", "gcs"):
        # The plain class, not whatever `import gcsfs` picked: with
        # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on (its default) gcsfs exports a
        # subclass that probes every bucket for zonal/HNS over gRPC, which stalls
        # 60 s per call against an emulator. casnap needs plain buckets only.
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**options), GCSFileSystem._strip_protocol(url)
    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root


class FsspecStore(ObjectStore):
    """Objects below ``url`` on an fsspec filesystem; each put is a single write."""

    _read_whole: ClassVar[dict[str, Any]] = {}  # cat_file's options for a whole object

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        options = {**_default_options(protocol), **(storage_options or {})}
        try:
            fs, root = _open_fs(protocol, url, options)
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open store {url!r}: {exc}") from exc
        self._attach(
            fs,
            root,
            url,
            protocol,
            atomic_create=protocol in _ATOMIC_CREATE,
            conditional_replace=protocol in _CONDITIONAL_REPLACE,
        )

    def _attach(
        self,
        fs: Any,
        root: str,
        url: str,
        protocol: str,
        *,
        atomic_create: bool,
        conditional_replace: bool,
    ) -> None:
        """Serve the objects below ``root`` on the opened filesystem ``fs``."""
        self.fs = fs
        self.protocol = protocol
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.capabilities = Capabilities(
            atomic_create=atomic_create, local=False, conditional_replace=conditional_replace
        )
        # dict.setdefault is atomic: racing stores on one filesystem get one lock.
        self._create_lock: threading.Lock = vars(self.fs).setdefault(
            _CREATE_LOCK_ATTR, threading.Lock()
        )

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if self.root else check_key(key)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        path = self._path(key)  # outside the try: an invalid key is not a store failure
        if limit is not None:
            # One ranged read of at most limit + 1 bytes: the same single request,
            # and an oversized object never fills memory.
            data = self.get_range(key, 0, limit + 1)
            check_limit(key, len(data), limit)
            return data
        self._check_local(path, key)
        try:
            return bytes(self.fs.cat_file(path, **self._read_whole))
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        self._check_local(path, key)
        if end == start:
            if not self._is_object(path, key):
                raise ObjectNotFoundError(f"object {key!r} not found", key)
            return b""
        try:
            return bytes(self.fs.cat_file(path, start=start, end=end))
        except Exception as exc:
            # GCS and S3 answer a range that starts at or past the end with 416;
            # the contract says that is an empty read of an existing object.
            if _status_of(exc) == _RANGE_NOT_SATISFIABLE and self._is_object(path, key):
                return b""
            raise self._translate(exc, key) from exc

    def _check_local(self, path: str, key: str) -> None:
        """On a local filesystem, refuse what is not a regular file before opening it."""
        if self.protocol not in _LOCAL_PROTOCOLS:
            return
        try:
            info = self.fs.info(path)
        except Exception as exc:
            raise self._translate(exc, key) from exc
        if info.get("islink"):
            raise ObjectRefusedError(
                f"object {key!r} is a symbolic link; casnap reads only regular files", key
            )
        if info.get("type") == "directory":
            raise ObjectNotFoundError(f"object {key!r} not found", key)
        if info.get("type") != "file":
            raise ObjectRefusedError(
                f"object {key!r} is not a regular file; casnap reads only regular files", key
            )

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        # An object store's put is durable when it returns; ``durable`` changes nothing.
        path = self._path(key)
        payload = join_parts(data)
        try:
            if create_only and not self.capabilities.atomic_create:
                with self._create_lock:
                    if self._is_object(path, key):
                        raise FileExistsError(path)
                    self.fs.pipe_file(path, payload)
            else:
                self.fs.pipe_file(path, payload, mode="create" if create_only else "overwrite")
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        path = self._path(key)
        payload = join_parts(data)
        try:
            if expected is None:  # create-only, as atomic as this store's create
                self.put(key, payload, create_only=True)
            elif self.protocol in _CONDITIONAL_REPLACE:
                self._replace_generation(path, key, payload, expected)
            else:
                # Compare, then write, under the lock every store on this
                # filesystem object shares: atomic within this process only.
                with self._create_lock:
                    if self._current(key, expected) != expected:
                        raise changed(key)
                    self.fs.pipe_file(path, payload)
        except ObjectChangedError:
            raise
        except FileExistsError as exc:  # a create or a generation precondition failed
            raise changed(key) from exc
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def _current(self, key: str, expected: bytes) -> bytes | None:
        """The object's bytes, or None where it is missing or longer than ``expected``."""
        try:
            return self.get(key, limit=len(expected))
        except (ObjectNotFoundError, ObjectRefusedError):
            return None

    def _replace_generation(self, path: str, key: str, payload: bytes, expected: bytes) -> None:
        """GCS: read the object at its current generation, compare, then upload with
        ``ifGenerationMatch`` of that generation; a write in between fails it (412)."""
        try:
            generation = self.fs.info(path).get("generation")
            current = bytes(self.fs.cat_file(path, generation=generation))
        except FileNotFoundError as exc:  # gone, or overwritten since info (that generation)
            raise changed(key) from exc
        if not generation or current != expected:
            raise changed(key)
        # gcsfs's pipe_file has no generation precondition: its single-request
        # (multipart) upload, with one. Small objects only: a resumable upload
        # is what some emulators do not check.
        bucket, name, _ = self.fs.split_path(path)
        head = json.dumps({"name": name}).encode()
        body = b"".join(
            [
                f"--{_MULTIPART}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                head,
                f"\r\n--{_MULTIPART}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                payload,
                f"\r\n--{_MULTIPART}--".encode(),
            ]
        )
        self.fs.call(
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
            uploadType="multipart",
            headers={"Content-Type": f'multipart/related; boundary="{_MULTIPART}"'},
            data=body,
            json_out=True,
            ifGenerationMatch=str(generation),
        )
        self.fs.invalidate_cache(path)

    def exists(self, key: str) -> bool:
        return self._is_object(self._path(key), key)

    def _is_object(self, path: str, key: str) -> bool:
        # Not fs.exists: that is true for a mere prefix ("directory") and
        # gcsfs/fsspec swallow every error in isfile, so an outage would read
        # as "missing".
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise self._translate(exc, key) from exc
        if self.protocol in _LOCAL_PROTOCOLS:  # a FIFO or a link occupies the key too
            return bool(info.get("type") != "directory")
        return bool(info.get("type") == "file")

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _info in self._find(prefix, detail=False):
            yield key

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # One listing with details instead of one info() per object.
        for key, info in self._find(prefix, detail=True):
            if info.get("type", "file") == "file":
                size = info.get("size")
                yield ObjectInfo(key, int(size) if size is not None else None, _mtime_of(info))

    def _find(self, prefix: str, *, detail: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        base = self._path(prefix) if prefix else self.root
        try:
            found = self.fs.find(base, detail=detail)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._translate(exc, prefix) from exc
        items = found.items() if detail else ((p, {}) for p in found)
        strip = self.fs._strip_protocol
        # The root as listings spell it: "/" + root on memory://, "bucket/dir" on gs://.
        root = strip(self._path("x"))[:-1]
        # find() of a path that is itself an object returns that object; a
        # prefix names a folder, so only keys below it count.
        below = f"{root}{prefix}/" if prefix else root
        for path, info in items:
            path = strip(path)
            if path.startswith(below):
                yield path[len(root) :], info

    def _translate(self, exc: Exception, key: str) -> StoreError:
        """The casnap error for a failure of the filesystem (a backend may know more codes)."""
        return _translate(exc, key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except (FileNotFoundError, IsADirectoryError):
            return
        except Exception as exc:
            raise self._translate(exc, key) from exc


def _mtime_of(info: dict[str, Any]) -> float | None:
    """The modification time in a listing's details, under whatever name the backend uses."""
    for name in ("mtime", "updated", "LastModified", "last_modified", "created", "timeCreated"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()
    return None


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status behind a failure: gcsfs's ``code``, aiohttp's ``status``, or the
    botocore response that s3fs keeps as the ``__cause__`` of the error it raises."""
    for err in (exc, exc.__cause__):
        if err is None:
            continue
        status = getattr(err, "code", None) or getattr(err, "status", None)
        if isinstance(status, int) and not isinstance(status, bool):
            return status
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    status = _status_of(exc)
    if status is not None and status in _TRANSIENT_STATUS:
        return True
    return any(t.__name__ in _TRANSIENT_TYPES for t in type(exc).__mro__)


def _translate(exc: Exception, key: str) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    # A key that is only a prefix of other keys is not an object.
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ObjectNotFoundError(f"object {key!r} not found", key)
    if isinstance(exc, FileExistsError):
        return ObjectExistsError(f"object {key!r} already exists", key)
    transient = _is_transient(exc)
    return StoreError(f"{type(exc).__name__}: {exc} ({key!r})", key, transient=transient)
