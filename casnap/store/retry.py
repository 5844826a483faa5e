"""Retrying transient store failures, with backoff and a bound.

:class:`RetryingStore` wraps any backend. Its semantics, which callers rely on:

- Only failures the backend marks transient (``StoreError.transient``: a
  timeout, a dropped connection, HTTP 408/429/5xx) are retried. Everything
  else (a missing or existing object, a bad key, a permission, a full disk, an
  object refused for its type or size) is raised at once, unchanged.
- A call is tried at most ``1 + retries`` times. Before retry *n* (1-based) the
  wrapper sleeps a random time in ``[0, min(max_delay, delay * 2**(n-1))]``
  ("full jitter", so many clients do not retry in step). When the bound is
  reached the last error is raised with the number of attempts in its message;
  it stays transient, so a caller can tell "gave up" from "refused".
- Every operation of the contract is idempotent, so repeating one is safe:
  ``get``, ``get_range``, ``read_into``, ``exists``, ``list``/``list_info`` (a
  listing is read whole before its first key is handed out, so a retry never
  yields a key twice), ``delete`` (a missing object is not an error) and an
  overwriting ``put``.
- A create-only ``put`` is where a lost response matters: the first attempt may
  have created the object and only its answer was lost, so the retry finds the
  object there. If the object then holds exactly the bytes being put, the put
  succeeded (it was ours, or identical, which content addressing makes the
  same thing); otherwise :class:`ObjectExistsError` is raised as usual.
- A ``replace`` likewise: after a transient failure, a retry that finds the
  object changed and holding exactly the bytes being put succeeded (the bytes
  of a ref name their time, so they are this writer's); otherwise
  :class:`ObjectChangedError` is raised as usual. After a lost answer that
  error is ambiguous: the earlier attempt may have landed and been replaced
  by another writer since. A caller must then treat its write as possibly
  made (the DCP commit keeps its manifest under a name of its own either way).

:func:`casnap.store.open_store` wraps remote backends in one, configured by the
``store_retries`` and ``store_retry_delay`` settings (``docs/settings.md``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from casnap.errors import (
    ConfigError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
from casnap.settings import get as setting
from casnap.store.base import (
    Buffer,
    Data,
    ObjectInfo,
    ObjectStore,
    WrapperStore,
    as_parts,
    join_parts,
)

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure."""

    retries: int = 4  # attempts after the first
    delay: float = 0.2  # seconds: the cap of the first backoff, doubled each retry
    max_delay: float = 10.0  # the cap never grows beyond this

    def __post_init__(self) -> None:
        if self.retries < 0 or not self.delay >= 0 or not self.max_delay >= 0:
            raise ConfigError(f"invalid retry policy {self}", "store_retries")

    @classmethod
    def from_settings(cls) -> RetryPolicy:
        return cls(retries=int(setting("store_retries")), delay=float(setting("store_retry_delay")))

    def backoff(self, retry: int) -> float:
        """The longest sleep before retry number ``retry`` (1-based)."""
        return float(min(self.max_delay, self.delay * 2.0 ** (retry - 1)))


class RetryingStore(WrapperStore):
    """``inner`` with transient failures retried (see the module docstring)."""

    def __init__(
        self,
        inner: ObjectStore,
        policy: RetryPolicy | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(inner)
        self.policy = RetryPolicy.from_settings() if policy is None else policy
        self._sleep = sleep

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        retry = 0
        while True:
            try:
                return fn()
            except StoreError as exc:
                if not exc.transient:
                    raise
                if retry >= self.policy.retries:
                    if retry:
                        exc.args = (f"{exc.args[0]} (gave up after {retry + 1} attempts)",)
                    raise
                retry += 1
                pause = random.uniform(0.0, self.policy.backoff(retry))
                _log.info(
                    "casnap: %s %r failed (%s); retry %d in %.2f s", what, key, exc, retry, pause
                )
                self._sleep(pause)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key, limit=limit))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call("get", key, lambda: self.inner.get_range(key, start, end))

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        return self._call("get", key, lambda: self.inner.read_into(key, buffers))

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        return self._call("get", key, lambda: self.inner.map(key, limit, private=private))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from self._call("list", prefix, lambda: list(self.inner.list(prefix)))

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from self._call("list", prefix, lambda: list(self.inner.list_info(prefix)))

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from self._call("list", prefix, lambda: list(self.inner.list_temporary(prefix)))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def delete_temporary(self, key: str) -> bool:
        return self._call("delete", key, lambda: self.inner.delete_temporary(key))

    def flush(self) -> None:
        self._call("flush", "", self.inner.flush)

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        parts = as_parts(data)
        write = partial(self.inner.put, key, parts, create_only=create_only, durable=durable)
        self._write("put", key, parts, write, ObjectExistsError)

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        parts = as_parts(data)
        write = partial(self.inner.replace, key, parts, expected=expected)
        self._write("replace", key, parts, write, ObjectChangedError)

    def _write(
        self,
        op: str,
        key: str,
        parts: Sequence[Buffer],
        write: Callable[[], None],
        refused: type[StoreError],
    ) -> None:
        """Retry ``write``; a ``refused`` answer after a transient failure is success when the
        object holds exactly ``parts``: an earlier attempt landed, only its answer was lost."""
        failed = False

        def attempt() -> None:
            nonlocal failed
            try:
                write()
            except refused:
                if failed and self._holds(key, parts):
                    return
                raise
            except StoreError as exc:
                failed = failed or exc.transient
                raise

        self._call(op, key, attempt)

    def _holds(self, key: str, parts: Sequence[Buffer]) -> bool:
        try:
            return self._call("get", key, lambda: self.inner.get(key)) == join_parts(parts)
        except ObjectNotFoundError:
            return False
