"""The object-store contract every backend implements.

Six operations over flat, '/'-separated keys relative to the store's root:
``get``, ``get_range``, ``put`` (atomic; optionally create-only), ``exists``,
``list`` (a prefix, recursively) and ``delete``, plus one for the few mutable
objects, ``replace`` (a conditional put: compare and swap). Backends are thin;
backend exceptions are translated to casnap errors in one place per backend.

Around them, with defaults a minimal backend inherits: ``list_info``,
``list_temporary``/``delete_temporary``, ``flush``, ``map``, ``unwrap``,
``capabilities`` and ``replace`` (whose default raises
:class:`ConditionalReplaceUnsupportedError`); each method's docstring and
docs/architecture.md, "The store contract", say what it is for. Wrappers
build on :class:`WrapperStore`.

Semantics every backend guarantees (tested by :mod:`casnap.store.testing`,
which a third-party backend can run too):

- A put is atomic: a reader sees either no object or the whole object.
- ``put(..., create_only=True)`` raises :class:`ObjectExistsError` when the
  key exists. ``Capabilities.atomic_create`` says whether that check is atomic
  against other processes (local directory, GCS) or only within this process.
- ``replace(key, data, expected=old)`` writes ``data`` only if the object holds
  exactly the bytes ``old`` (``expected=None``: only if there is no object);
  otherwise it raises :class:`ObjectChangedError` and writes nothing. Of
  replacers racing from the same ``expected`` exactly one wins.
  ``Capabilities.conditional_replace`` says whether that holds against other
  processes (local directory: a lock on the key's folder; GCS: generation
  match; S3: ``If-Match``) or only within this process (a generic fsspec
  filesystem, S3 without conditional writes). A replace is ordered against
  other replaces and create-only puts of the key; a plain ``put`` or a
  ``delete`` racing it may be overwritten by it (or overwrite it) where the
  backend compares under a lock, so mutable objects are written by replaces only.
- ``get(key, limit=n)`` of an object larger than ``n`` bytes raises
  :class:`ObjectRefusedError` without reading more than ``n + 1`` bytes of it
  (a backend that can tell the size first refuses before reading any), so a
  small record can never fill memory. Without ``limit`` the whole object is read.
- Only regular objects are read: where a backend can hold something else at a
  key (a local directory: a FIFO, a device, a socket, a symbolic link),
  ``get``, ``get_range``, ``read_into`` and ``map`` raise :class:`ObjectRefusedError`
  at once, without blocking or following it. ``exists`` is true for it (the
  key is taken), so a reader goes on to read it and is told what is wrong.
- ``get``/``get_range`` of a missing key raise :class:`ObjectNotFoundError`.
  A key that is only a folder of other keys (``a`` when ``a/b`` exists) is
  missing. ``get_range`` past the end returns the bytes there are, maybe none.
- ``delete`` of a missing key is not an error. A delete is visible at once;
  like a non-durable put it may be undone by a crash until the next
  ``flush()`` or durable put returns.
- ``list(prefix)`` yields every key below the folder ``prefix/`` (not an object
  named ``prefix``, not ``prefixx/...``), in no particular order, and never a
  temporary object of an unfinished put. It reflects writes made through any
  other handle: backends must not serve it, or ``exists``, from a stale cache.
- Invalid keys raise :class:`InvalidNameError` before any I/O.
- A failure is a :class:`StoreError` whose ``transient`` flag says whether the
  same call may succeed if repeated (a timeout, a dropped connection, HTTP
  429/5xx) or will fail the same way (permissions, a full disk, a bad key,
  a refused object).
  :class:`~casnap.store.retry.RetryingStore` retries the transient ones.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from casnap.errors import (
    ConditionalReplaceUnsupportedError,
    InvalidNameError,
    ObjectChangedError,
    ObjectRefusedError,
    StoreError,
)

Buffer = bytes | bytearray | memoryview
Data = Buffer | Sequence[Buffer]

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._+=@,%-]+$")


def check_key(key: str) -> str:
    """Reject keys that are empty, absolute, or could climb out of the root."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise InvalidNameError(f"store key {key!r} must be a relative path")
    for seg in key.split("/"):
        if seg in ("", ".", "..") or not _KEY_SEGMENT.match(seg):
            raise InvalidNameError(f"store key {key!r} has an unsafe segment {seg!r}")
    return key


def as_parts(data: Data) -> list[Buffer]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    return list(data)


def check_limit(key: str, size: int, limit: int | None) -> None:
    """Refuse an object of (at least) ``size`` bytes read with ``limit`` (see ``get``)."""
    if limit is not None and size > limit:
        raise ObjectRefusedError(
            f"object {key!r} is larger than the {limit} bytes allowed for what it holds; "
            "it is not one of casnap's, or it is damaged",
            key,
        )


def changed(key: str) -> ObjectChangedError:
    """The error of a conditional replace that found ``key`` other than expected."""
    return ObjectChangedError(
        f"object {key!r} changed: it is not what the conditional replace expected "
        "(another writer replaced, created or deleted it)",
        key,
    )


def join_parts(data: Data) -> bytes:
    parts = as_parts(data)
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    return b"".join(parts)


@dataclass(frozen=True)
class Capabilities:
    """What a backend promises beyond the basic contract."""

    atomic_create: bool  # create-only puts are atomic across processes
    local: bool  # backed by a local filesystem (cheap probes)
    # replace() (compare and swap) is atomic across processes, not only within this one
    conditional_replace: bool = False
    # within deferring(), non-durable puts defer their file sync and rename to a flush
    deferred_sync: bool = False


class Deferral:
    """One writer's deferred puts (a take's, made on any of its threads): the errors of
    those whose fsync or rename failed, whichever ``flush`` settled them.

    Several takes share one store (threads taking through one ``Repository``),
    and a flush settles every file queued, its caller's and the others': a
    file of this writer's that failed in another's flush is gone for good, so
    the writer must hear of it (:meth:`check`) even though its own flush
    found nothing left to settle.
    """

    def __init__(self, translate: Callable[[BaseException], BaseException]) -> None:
        self._errors: list[BaseException] = []
        self._translate = translate  # the store's: an OSError becomes its StoreError

    def failed(self, exc: BaseException) -> None:
        self._errors.append(exc)

    def check(self) -> None:
        """Raise the first error of any of this writer's files (once they are settled),
        as the store's flush would have raised it."""
        if self._errors:
            first = self._errors[0]
            raise self._translate(first) from first


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing, with what the backend knows about it."""

    key: str
    size: int | None  # bytes; None: the backend cannot say
    mtime: float | None  # seconds since the epoch of its last write; None: cannot say


class ObjectStore(ABC):
    """A flat key/value store of immutable-once-written objects."""

    url: str
    capabilities: Capabilities

    @abstractmethod
    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The whole object; :class:`ObjectRefusedError` if it is larger than ``limit`` bytes."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object; fewer only if it is shorter."""

    @abstractmethod
    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        """Write the object atomically; ``data`` may be a list of buffers written in order.

        With ``durable=False`` the object is visible at once but may be lost in
        a crash until the next durable put (or :meth:`flush`) returns: every
        durable put first makes all earlier non-durable puts durable. Chunks
        are written non-durably, the manifest and ref durably, which keeps the
        commit order without paying a directory sync per chunk.
        """

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        """Write the object only if it holds exactly ``expected`` (``None``: only if
        there is none), atomically; else raise :class:`ObjectChangedError`.

        For the few mutable objects (a ref a re-save moves): read it, decide, then
        replace it from what was read, and a writer that raced in between is
        detected instead of overwritten. Durable when it returns, like a durable
        put (earlier non-durable puts first). ``capabilities.conditional_replace``
        says whether it is atomic against other processes or only within this one.

        Example::

            old = store.get("refs/main")
            store.replace("refs/main", new, expected=old)  # ObjectChangedError if moved
        """
        raise ConditionalReplaceUnsupportedError(
            f"{type(self).__name__} at {self.url!r} cannot replace an object conditionally", key
        )

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        """Read the object's first bytes into ``buffers`` in order; returns the bytes read.

        Backends that can read straight into caller memory (a local file's
        ``preadv``) override this; the default copies from :meth:`get`.
        """
        data = memoryview(self.get(key))
        pos = 0
        for buf in buffers:
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
        return pos

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        """The object's first ``limit`` bytes (fewer if it is shorter) as a read-only
        buffer mapped from its file, or ``None`` if the store cannot map it.

        ``private``: a writable copy-on-write mapping instead; what the caller
        writes stays in this process's memory (only the pages written are
        copied) and never reaches the object (a delta rebuilt on its base).

        Raises as :meth:`read_into` would (missing, refused); like it, reads
        nothing past ``limit``. The mapping lives as long as the buffer is referenced.
        A restore verifies a chunk on the mapping before any byte of it reaches
        a target (docs/pipeline.md, "A failed restore"). The default: ``None``.
        """
        return None

    def flush(self) -> None:  # noqa: B027  (a no-op default, not an abstract method)
        """Make every earlier non-durable put durable (a no-op where puts always are)."""

    def deferral(self) -> Deferral:
        """A writer's :class:`Deferral`, to hand to :meth:`deferring`."""
        return Deferral(lambda exc: exc)

    def deferring(self, owner: Deferral | None = None) -> AbstractContextManager[None]:
        """Within: where ``capabilities.deferred_sync``, this thread's non-durable puts
        defer their file sync and rename to the next :meth:`flush` or durable put, and
        ``owner`` hears of each such file that fails, whichever flush settles it
        (content-addressed keys only: docs/pipeline.md). The default defers nothing."""
        return nullcontext()

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys under ``prefix`` (a folder-like prefix such as ``"refs"``), recursively."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is not an error (durable after ``flush``)."""

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """:meth:`list` with sizes and modification times (``None`` where unknown)."""
        for key in self.list(prefix):
            yield ObjectInfo(key, None, None)

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Leftovers of unfinished puts below ``prefix`` (keys outside the key alphabet)."""
        return iter(())

    def delete_temporary(self, key: str) -> bool:
        """Remove a leftover that :meth:`list_temporary` returned; False if it was gone."""
        return False

    def unwrap(self) -> ObjectStore:
        """The backend below every view and wrapper (itself for a backend)."""
        return self

    def child(self, prefix: str) -> ObjectStore:
        """A view of this store rooted at ``prefix``."""
        return PrefixStore(self, check_key(prefix))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class WrapperStore(ObjectStore):
    """``inner`` with every call of the contract forwarded to it unchanged.

    The base of the wrappers (zarr's ``WrapperStore`` is the model): a subclass
    overrides only what it changes, and inherits the rest, ``map`` and ``flush``
    included, so a wrapped store reads and writes as the store below it does
    (a wrapped local store still maps its files). ``url``, ``capabilities`` and
    ``unwrap()`` are the inner store's; ``child`` is a view of the wrapper, so
    what the wrapper adds applies below the view too.
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        return self.inner.get(key, limit=limit)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        self.inner.put(key, data, create_only=create_only, durable=durable)

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        self.inner.replace(key, data, expected=expected)

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        return self.inner.read_into(key, buffers)

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        return self.inner.map(key, limit, private=private)

    def flush(self) -> None:
        self.inner.flush()

    def deferral(self) -> Deferral:
        return self.inner.deferral()

    def deferring(self, owner: Deferral | None = None) -> AbstractContextManager[None]:
        return self.inner.deferring(owner)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list_info(prefix)

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list_temporary(prefix)

    def delete_temporary(self, key: str) -> bool:
        return self.inner.delete_temporary(key)

    def unwrap(self) -> ObjectStore:
        return self.inner.unwrap()


class PrefixStore(WrapperStore):
    """Another store seen from a sub-folder; its errors name keys as the view sees them.

    It overrides every call that takes a key or a prefix (a test holds it to that)."""

    def __init__(self, inner: ObjectStore, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.url = inner.url.rstrip("/") + "/" + prefix

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    @contextmanager
    def _as_seen(self, key: str) -> Iterator[None]:
        try:
            yield
        except StoreError as exc:
            if exc.key is not None and exc.key.startswith(self.prefix + "/"):
                exc.key = exc.key[len(self.prefix) + 1 :]
            raise

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        with self._as_seen(key):
            return self.inner.get(self._k(key), limit=limit)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._as_seen(key):
            return self.inner.get_range(self._k(key), start, end)

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        with self._as_seen(key):
            self.inner.put(self._k(key), data, create_only=create_only, durable=durable)

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        with self._as_seen(key):
            self.inner.replace(self._k(key), data, expected=expected)

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        with self._as_seen(key):
            return self.inner.read_into(self._k(key), buffers)

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        with self._as_seen(key):
            return self.inner.map(self._k(key), limit, private=private)

    def exists(self, key: str) -> bool:
        with self._as_seen(key):
            return self.inner.exists(self._k(key))

    def _full(self, prefix: str) -> str:
        return self._k(prefix) if prefix else self.prefix

    def list(self, prefix: str = "") -> Iterator[str]:
        cut = len(self.prefix) + 1
        with self._as_seen(prefix):
            for key in self.inner.list(self._full(prefix)):
                yield key[cut:]

    def delete(self, key: str) -> None:
        with self._as_seen(key):
            self.inner.delete(self._k(key))

    def _seen(
        self, prefix: str, listing: Callable[[str], Iterator[ObjectInfo]]
    ) -> Iterator[ObjectInfo]:
        cut = len(self.prefix) + 1
        with self._as_seen(prefix):
            for info in listing(self._full(prefix)):
                yield ObjectInfo(info.key[cut:], info.size, info.mtime)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._seen(prefix, self.inner.list_info)

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._seen(prefix, self.inner.list_temporary)

    def delete_temporary(self, key: str) -> bool:
        # Temporary names are outside the key alphabet: no check_key here.
        return self.inner.delete_temporary(f"{self.prefix}/{key}")
