"""Stores that fail on purpose: what the retry wrapper and the commit protocol are tested against.

Both wrap a store and forward every call to it (:class:`~casnap.store.base.WrapperStore`),
``map`` and ``flush`` included, so what runs over them reads and writes as it would over
the store below, until a call they choose fails:

- :class:`FaultyStore` fails a seeded share of its calls with transient errors, before
  or after the call took effect (a lost response): a flaky network.
- :class:`FailingStore` fails the n-th call of one operation on keys under some prefixes
  (and, if asked, every later one): a disk that fills, a connection that drops, a
  process killed halfway.

Neither needs pytest; benchmarks and child processes use them too.
"""

from __future__ import annotations

import random
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar

from casnap.errors import StoreError
from casnap.store.base import Buffer, Data, ObjectInfo, ObjectStore, WrapperStore, as_parts

T = TypeVar("T")
When = Literal["before", "after"] | None

CHUNK_OBJECTS = (".casnap/chunks/", ".casnap/packs/")  # a repository's chunk files and packs


class _Injecting(WrapperStore):
    """Asks :meth:`_fault` before each call of an operation whether and when it fails."""

    @abstractmethod
    def _fault(self, op: str, key: str) -> When:
        """None: the call goes through; "before" or "after" it took effect: it fails."""

    @abstractmethod
    def _error(self, op: str, key: str, when: str) -> BaseException:
        """The exception the call fails with."""

    def _run(self, op: str, key: str, call: Callable[[], T]) -> T:
        when = self._fault(op, key)
        if when == "before":
            raise self._error(op, key, when)
        result = call()
        if when == "after":
            raise self._error(op, key, when)
        return result

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        return self._run("get", key, lambda: self.inner.get(key, limit=limit))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._run("get_range", key, lambda: self.inner.get_range(key, start, end))

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        return self._run("read_into", key, lambda: self.inner.read_into(key, buffers))

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        return self._run("map", key, lambda: self.inner.map(key, limit, private=private))

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        parts = as_parts(data)  # a list of buffers can be put again after a lost answer
        self._run(
            "put", key, lambda: self.inner.put(key, parts, create_only=create_only, durable=durable)
        )

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        parts = as_parts(data)
        self._run("replace", key, lambda: self.inner.replace(key, parts, expected=expected))

    def exists(self, key: str) -> bool:
        return self._run("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from self._run("list", prefix, lambda: list(self.inner.list(prefix)))

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from self._run("list", prefix, lambda: list(self.inner.list_info(prefix)))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))


class FaultyStore(_Injecting):
    """``inner`` with a share ``rate`` of calls failing transiently (seeded, reproducible).

    A failing call fails either before it reaches ``inner`` or, with
    probability ``lost``, after it took effect (the response was lost). Only
    the operations in ``ops`` fail. ``faults`` counts the failures injected.
    """

    OPS = ("get", "get_range", "read_into", "map", "put", "replace", "exists", "list", "delete")

    def __init__(
        self,
        inner: ObjectStore,
        rate: float,
        *,
        lost: float = 0.5,
        seed: int = 0,
        ops: tuple[str, ...] = OPS,
    ) -> None:
        super().__init__(inner)
        self.rate, self.lost, self.ops = rate, lost, ops
        self.faults = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def _fault(self, op: str, key: str) -> When:
        if op not in self.ops:
            return None
        with self._lock:
            if self._random.random() >= self.rate:
                return None
            self.faults += 1
            return "after" if self._random.random() < self.lost else "before"

    def _error(self, op: str, key: str, when: str) -> BaseException:
        if when == "before":
            return StoreError(
                f"injected transient fault before {op} ({key!r})", key, transient=True
            )
        return StoreError(f"injected lost response of {op} ({key!r})", key, transient=True)


class FailingStore(_Injecting):
    """``inner`` whose ``n``-th call of ``op`` on a key under ``prefixes`` fails.

    ``fail(key)`` gives the exception raised (by default a permanent
    :class:`StoreError`); it may end the process itself instead (``os._exit``).
    ``after``: the call takes effect first, then fails (its answer was lost).
    ``lasting``: every later such call fails too (a full disk stays full).
    Calls count only while ``armed`` (a test may arm it at the step it means);
    ``calls`` counts them, the failing ones included.

    Example: ``FailingStore(LocalStore(root), 3)`` fails the third put of a chunk
    file or pack, as a disk filling up halfway through a take would.
    """

    def __init__(
        self,
        inner: ObjectStore,
        n: int,
        *,
        op: str = "put",
        prefixes: tuple[str, ...] = CHUNK_OBJECTS,
        fail: Callable[[str], BaseException] | None = None,
        after: bool = False,
        lasting: bool = False,
        armed: bool = True,
    ) -> None:
        super().__init__(inner)
        self.n, self.op, self.prefixes = n, op, prefixes
        self.fail = fail
        self.after, self.lasting = after, lasting
        self.armed = armed
        self.calls = 0
        self._lock = threading.Lock()

    def _fault(self, op: str, key: str) -> When:
        if op != self.op or not self.armed or not key.startswith(self.prefixes):
            return None
        with self._lock:
            self.calls += 1
            if self.calls < self.n or (self.calls > self.n and not self.lasting):
                return None
        return "after" if self.after else "before"

    def _error(self, op: str, key: str, when: str) -> BaseException:
        if self.fail is not None:
            return self.fail(key)
        return StoreError(f"injected failure of {op} {key!r} (call {self.calls})", key)
