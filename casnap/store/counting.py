"""A store wrapper that counts requests and bytes: what tests and benchmarks measure."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

from casnap.store.base import Buffer, Data, ObjectInfo, ObjectStore, WrapperStore, as_parts


class CountingStore(WrapperStore):
    """Forwards to ``inner`` and counts each operation and the bytes moved.

    ``requests[op]`` counts calls; ``bytes_written`` and ``bytes_read`` count
    payload bytes; ``written_keys`` lists the keys of successful puts.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests: Counter[str] = Counter()
            self.bytes_written = 0
            self.bytes_read = 0
            self.written_keys: list[str] = []
            self.read_keys: list[str] = []
            self.mapped_keys: list[str] = []  # objects read through ``map`` (also counted as gets)

    def _count(self, op: str, read: int = 0, written: int = 0, key: str | None = None) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes_read += read
            self.bytes_written += written
            if written and key is not None:
                self.written_keys.append(key)
            if op in ("get", "get_range") and key is not None:
                self.read_keys.append(key)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        data = b""
        try:
            data = self.inner.get(key, limit=limit)
            return data
        finally:  # a failed read (a probe of a missing object) is a request too
            self._count("get", read=len(data), key=key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = b""
        try:
            data = self.inner.get_range(key, start, end)
            return data
        finally:
            self._count("get_range", read=len(data), key=key)

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        parts = as_parts(data)
        try:
            self.inner.put(key, parts, create_only=create_only, durable=durable)
        finally:
            self._count("put")
        self._wrote(key, parts)

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        parts = as_parts(data)
        try:
            self.inner.replace(key, parts, expected=expected)
        finally:
            self._count("replace")
        self._wrote(key, parts)

    def _wrote(self, key: str, parts: list[Buffer]) -> None:
        with self._lock:
            self.bytes_written += sum(len(memoryview(p).cast("B")) for p in parts)
            self.written_keys.append(key)

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        n = 0
        try:
            n = self.inner.read_into(key, buffers)
            return n
        finally:
            self._count("get", read=n, key=key)

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        buf = None
        try:
            buf = self.inner.map(key, limit, private=private)
            return buf
        except BaseException:
            self._count("get", key=key)  # a failed read is a request too
            raise
        finally:
            if buf is not None:  # None: nothing was read, the caller reads it instead
                self._count("get", read=len(buf), key=key)
                with self._lock:
                    self.mapped_keys.append(key)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._count("list")
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._count("list")
        return self.inner.list_info(prefix)

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._count("list")
        return self.inner.list_temporary(prefix)

    def delete_temporary(self, key: str) -> bool:
        self._count("delete")
        return self.inner.delete_temporary(key)
