"""Pausing Python's cyclic garbage collector while a take does per-tensor work,
or a manifest is parsed.

A take of many small tensors makes and keeps several objects per tensor, and
each full collection Python starts as they survive walks every object of the
process (with torch imported, some 170,000); a take's objects hardly ever
form cycles, so a take pauses automatic collection and restores it after:
what it frees dies by reference counting as before. What that saved is in
docs/pipeline.md ("Plan reuse") and benchmarks/README.md ("docs/pipeline.md:
small tensors").

The collector is process-wide, so the pause is too (an exception to "no
process-global state", with the LMDB environments and the reuse cache of
casnap.take.reuse): takes running at once in several threads share
one pause, counted, and the last to finish restores collection, only if a
take disabled it. A process that disabled collection itself keeps it
disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0  # takes inside python_gc_paused() right now
_paused_by_us = False  # whether the first of them disabled the collector


@contextmanager
def python_gc_paused() -> Iterator[None]:
    """Automatic cyclic garbage collection paused for the body, then restored.

    Reentrant and thread-safe; ``gc.collect()`` still works inside.

    Example::

        with python_gc_paused():
            entries = [build_entry(t) for t in tensors]  # no full collection meanwhile
    """
    global _holders, _paused_by_us
    with _lock:
        if _holders == 0:
            _paused_by_us = gc.isenabled()
            if _paused_by_us:
                gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _paused_by_us:
                _paused_by_us = False
                gc.enable()
