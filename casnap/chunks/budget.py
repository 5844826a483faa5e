"""A byte budget shared by the threads of one take or restore, and the memory ceiling.

The budget bounds the bytes in flight (fetched frames, decoded chunks). The
ceiling (:func:`memory_ceiling`) bounds what a read may allocate for its
results: sizes come from a manifest, which is untrusted, so a restore checks
what it would allocate against the ceiling before allocating anything
(:func:`check_allocation`).
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from casnap.errors import ConfigError, TooLargeError, expect_type
from casnap.settings import default_memory_budget


class ByteBudget:
    """Blocks ``acquire(n)`` while more than ``limit`` bytes are held.

    A request larger than the whole limit is admitted alone (when nothing else
    is held), so a single oversized chunk cannot deadlock the pipeline.
    ``peak`` records the most bytes ever held at once.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ConfigError(f"memory budget must be positive, got {limit}", "memory_budget_bytes")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.held and self.held + n > self.limit:
                self._cond.wait()
            self.held += n
            self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


def check_budget(memory_budget_bytes: int | None) -> int:
    """The memory budget of a take, restore or export: the argument, else the default.

    A budget that is not a positive int is refused with a CasnapError.
    """
    if memory_budget_bytes is not None:
        expect_type(memory_budget_bytes, int, "memory_budget_bytes", "a number of bytes (int)")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ConfigError(
            f"memory_budget_bytes must be positive, got {memory_budget_bytes}",
            "memory_budget_bytes",
        )
    return memory_budget_bytes or default_memory_budget()


# Reads allocating less than this are not checked against the ceiling: the
# address-space headroom says nothing about memory the heap already holds.
_SMALL = 16 << 20


def _physical_memory() -> int:
    """This machine's RAM, or the cgroup's memory limit when that is lower (containers)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        total = 0
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            cap = fh.read().strip()
        if cap.isdigit() and (not total or int(cap) < total):
            total = int(cap)
    except OSError:
        pass
    return total


def _address_space_left() -> int | None:
    """Bytes of address space this process may still map under RLIMIT_AS (None: unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            used = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, soft - used)


def memory_ceiling() -> int | None:
    """The most bytes a read may allocate for its results: physical memory (or the
    cgroup's limit), less when RLIMIT_AS leaves less address space (None: unknown).

    A tensor larger than this cannot be restored on this machine anyway (its
    pages would have to be resident), so a manifest declaring more is refused
    before anything is allocated, instead of failing inside the allocator.
    """
    known = [n for n in (_physical_memory() or None, _address_space_left()) if n is not None]
    return min(known) if known else None


def check_allocation(needs: dict[str, int], what: str) -> None:
    """Raise :class:`TooLargeError` if ``needs`` (key -> bytes to allocate) exceeds the ceiling.

    Called before the first allocation of ``what`` ("this restore"), with
    every allocation it will make, so nothing is half-allocated when refused.
    """
    total = sum(needs.values())
    if total <= _SMALL:
        return  # served from memory the process has; the allocator is the judge
    ceiling = memory_ceiling()
    if ceiling is None or total <= ceiling:
        return
    key = max(needs, key=lambda k: needs[k])
    raise TooLargeError(
        f"{key}: the snapshot declares {needs[key]} bytes for this entry, and {what} would "
        f"allocate {total} bytes in all, more than the {ceiling} bytes this process can "
        "allocate (physical memory, or the address-space limit); the manifest is damaged, "
        "or the snapshot does not fit on this machine",
        key,
        total,
        ceiling,
    )


def allocation_failed(key: str, nbytes: int, exc: BaseException) -> TooLargeError:
    """The :class:`TooLargeError` for an allocation of ``nbytes`` that the allocator refused."""
    return TooLargeError(
        f"{key}: cannot allocate the {nbytes} bytes the snapshot declares for this entry: {exc}",
        key,
        nbytes,
        memory_ceiling() or 0,
    )


@contextmanager
def allocating(key: str, nbytes: int) -> Iterator[None]:
    """Translate the allocator refusing ``nbytes`` for ``key`` into :class:`TooLargeError`.

    The ceiling check comes first; this catches what it cannot see (other
    threads' memory, fragmentation): Python's MemoryError and torch's
    "can't allocate memory" RuntimeError.
    """
    try:
        yield
    except TooLargeError:
        raise
    except MemoryError as exc:
        raise allocation_failed(key, nbytes, exc) from exc
    except RuntimeError as exc:
        if "allocate" not in str(exc):
            raise
        raise allocation_failed(key, nbytes, exc) from exc
