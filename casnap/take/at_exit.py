"""Async takes still committing when the interpreter exits: finished before it does.

A script that calls ``Snapshot.async_take`` (or a ``Checkpointer`` with
``async_take=True``) and ends without ``wait()`` or ``close()`` would lose
its last snapshot: Python stops its thread pools from taking new work
before ``atexit`` handlers run, so the background commit failed, silently.
Python's own pools register their exit hook with ``threading``'s exit
hooks, which run in reverse order of registration once the main thread
ends; this module registers after them (imported by the API, after
:mod:`concurrent.futures.thread`), so it runs first: it waits for every
pending take of this process, saying so, and warns, naming the snapshot,
about one whose commit failed and was never waited for. As DCP's and
Orbax's async savers, it finishes the work rather than drop it.
(docs/snapshot.md, "Exiting with an async take pending".)

The pending takes are module state, kept per process: a forked child
neither waits for its parent's takes (their threads are not in it) nor
warns about them.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  its exit hook registered before ours
import logging
import os
import threading
from concurrent.futures import CancelledError, Future
from typing import Any

_log = logging.getLogger("casnap")

# id(future) -> (the pid that started it, the snapshot's path, the future)
_pending: dict[int, tuple[int, str, Future[Any]]] = {}


def watch(future: Future[Any], path: str) -> None:
    """Finish ``future`` (the background commit of snapshot ``path``) before exit.

    Forgotten once it succeeded, or once :func:`observed` says its caller saw it."""
    key = id(future)
    _pending[key] = (os.getpid(), path, future)

    def done(f: Future[Any]) -> None:
        if not f.cancelled() and f.exception() is None:
            _pending.pop(key, None)

    future.add_done_callback(done)


def observed(future: Future[Any]) -> None:
    """The caller waited for ``future``: a failure reached it, no warning at exit."""
    _pending.pop(id(future), None)


def finish_pending() -> None:
    """Wait for this process's pending takes; warn about each one that failed unseen."""
    pid = os.getpid()
    for owner, path, future in list(_pending.values()):
        if owner != pid:
            continue
        if not future.done():
            _log.warning("casnap: waiting for the async take of %s to commit before exiting", path)
        try:
            exc = future.exception()
        except CancelledError as cancelled:
            exc = cancelled
        if exc is not None:
            _log.warning(
                "casnap: the async take of %s failed and was not committed: %s: %s",
                path,
                type(exc).__name__,
                exc,
            )
    _pending.clear()


_register: Any = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(finish_pending)
else:  # not CPython's threading: atexit is the best there is
    atexit.register(finish_pending)
