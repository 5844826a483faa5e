"""A bound on how long the command line waits for a remote store's first answer.

Without one, ``casnap ls gs://bucket/x`` with no network sat silent for
minutes: gcsfs repeats every failed request six times with backoff (about
30 s, not configurable per call), and :class:`casnap.store.RetryingStore`
repeats that ``store_retries`` times. A person at a terminal wants one line
naming the URL within seconds instead. :func:`first_contact` runs the opening
of a repository (its first request) in a daemon thread and gives up after
``CASNAP_REMOTE_TIMEOUT`` seconds (default 20, ``0`` waits for the store's
own retries); the thread is abandoned, which is fine for a process about to
exit. Local paths are opened directly.

Example::

    repo = first_contact(url, lambda: Repository(url, options))
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from casnap.errors import StoreError
from casnap.settings import get as setting

T = TypeVar("T")
_log = logging.getLogger(__name__)
# In-process stores answer at once; only a network can keep the command waiting.
_LOCAL_SCHEMES = ("file://", "memory://")
# The HTTP clients whose retries we outwait; each logs a failed attempt's cause.
_CLIENT_LOGGERS = ("gcsfs", "s3fs")


def is_remote(url: str) -> bool:
    """Whether opening ``url`` goes over a network (``gs://...``), not a local path."""
    return "://" in url and not url.startswith(_LOCAL_SCHEMES)


class _LastFailure(logging.Handler):
    """Remembers the cause of the last failed attempt the HTTP client logged.

    gcsfs keeps its exception to itself until its retries are over; its log
    records ("... retrying after exception: <cause>") are the only way to say
    *why* there was no answer (no DNS, connection refused, ...) in time.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.cause: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "exception: " in message:
            self.cause = message.split("exception: ", 1)[1].splitlines()[0]


def first_contact(url: str, open_: Callable[[], T]) -> T:
    """``open_()``, or, if ``url`` is remote and no answer comes within the
    ``remote_timeout`` setting, a transient :class:`casnap.StoreError` whose one
    line names the URL, the last cause seen and what to check."""
    limit = float(setting("remote_timeout"))
    if not is_remote(url) or limit <= 0:
        return open_()
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()  # settings overrides go with the call

    def attempt() -> None:
        try:
            outcome["value"] = context.run(open_)
        except BaseException as exc:  # handed to the waiting thread, raised there
            outcome["error"] = exc

    watcher = _LastFailure()
    loggers = [logging.getLogger(name) for name in _CLIENT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(watcher)
        if lg.getEffectiveLevel() > logging.DEBUG:
            lg.setLevel(logging.DEBUG)
    _log.info("contacting %s (waiting at most %g s: CASNAP_REMOTE_TIMEOUT)", url, limit)
    worker = threading.Thread(target=attempt, name="casnap-first-contact", daemon=True)
    try:
        worker.start()
        worker.join(limit)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(watcher)
            lg.setLevel(level)
    if worker.is_alive():
        cause = f" (last cause seen: {watcher.cause})" if watcher.cause else ""
        raise StoreError(
            f"no answer from {url} within {limit:g} s{cause}; check the network, the "
            "bucket name and the credentials (CASNAP_REMOTE_TIMEOUT=SECONDS waits longer)",
            transient=True,
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]
