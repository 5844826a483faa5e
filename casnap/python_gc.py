"""Pausing Python's cyclic garbage collector while a take does per-tensor work,
or a manifest is parsed.

A take of many small tensors makes a handful of container objects per tensor
(a flattened leaf, a write request, chunk references, the manifest entry and
its lists) and keeps about five per tensor alive as the session's plan for
the next take. Python starts a full collection whenever the objects that
survived into the oldest generation grow by a quarter of it, and a full
collection walks every object of the process: with torch imported that is
about 170,000 objects and 0.1 s on the 2-core benchmark machine. A first
take of 20,000 small tensors triggered two or three of them (0.2 to 0.4 s of
a 1.5 s take), a re-take one in two (docs/pipeline.md). Parsing a manifest
of 20,000 entries builds some 100,000 models and lists: with collection on it
took 1.3 to 2.2 s, paused 0.4 to 0.8 s.

A take's objects hardly ever form reference cycles (a failure's traceback
may), so a take pauses automatic collection while it does that work and
restores it afterwards: what a take frees dies by reference counting as
before, and what it keeps is examined by the next collection the process
makes anyway.

The collector is process-wide, so the pause is too (an exception to "no
process-global state", with the LMDB environments and the detached plans of
casnap.take.session): takes running at once in several threads share
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
