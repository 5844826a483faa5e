"""The gc lock: at most one gc sweeps a repository (docs/gc.md).

``.casnap/gc.lock`` is held by the one gc that may sweep, written create-only
and renewed by a heartbeat like a take's lease (:class:`casnap.repo.leases.Lease`).
A gc that finds a live lock waits or gives up (:class:`GcBusyError`); a crashed
gc's lock stops counting once it expires and the next gc breaks it; a stale
or damaged lock is removed by :func:`break_gc_lock` (``casnap unlock``). Once
it holds the lock, gc waits for the takes' leases to go
(:func:`casnap.repo.leases.wait_for_leases`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

from casnap.errors import (
    GcBusyError,
    ManifestValidationError,
    ObjectExistsError,
    ObjectRefusedError,
)
from casnap.repo.lease_record import (
    GC_CLAIMS,
    GC_LOCK_KEY,
    LeaseRecord,
    read_gc_lock,
    read_record,
)
from casnap.repo.leases import Lease, WaitNotice, poll_delays, unlock_hint
from casnap.settings import lease_ttl
from casnap.store import ObjectStore

_log = logging.getLogger("casnap.repo.leases")  # the logger the lock's warnings always used


def acquire_gc_lock(
    store: ObjectStore, *, ttl: float | None = None, wait_seconds: float = 0.0
) -> Lease:
    """Create ``gc.lock`` (create-only), breaking a lock whose holder's lease expired.

    On a store whose create-only put is not atomic across processes
    (``Capabilities.atomic_create`` false), two gcs could both see no lock and
    both write one; there each attempt first claims the right to try
    (:func:`_alone`), so at most one gc at a time checks and writes the lock.
    Raises :class:`GcBusyError` if another gc still holds the lock, or keeps
    claiming it, after ``wait_seconds``.
    """
    ttl = lease_ttl() if ttl is None else ttl
    deadline = time.monotonic() + wait_seconds
    delays = poll_delays()
    notice = WaitNotice("gc", store)
    while True:
        record = LeaseRecord.new("gc", ttl)
        with _alone(store, record) as rival:
            if rival is None:
                try:
                    store.put(GC_LOCK_KEY, record.to_bytes(), create_only=True, durable=False)
                    return Lease(store, GC_LOCK_KEY, record, ttl).start()
                except ObjectExistsError:
                    pass
                rival = read_gc_lock(store)
                if rival is None:
                    continue  # released meanwhile
                if not rival.is_live():
                    _break_stale(store, rival)
                    continue
        if time.monotonic() >= deadline:
            raise GcBusyError(
                f"another gc holds {store.url}/{GC_LOCK_KEY}: {rival.describe()}; if it is not "
                f"running, {unlock_hint(store, ' --force')} breaks the lock",
                rival,
            )
        notice.waiting_for(rival)
        # Jitter: two gcs that claimed at once and both backed off must not retry in step.
        time.sleep(next(delays) * random.uniform(0.5, 1.5))


@contextmanager
def _alone(store: ObjectStore, record: LeaseRecord) -> Iterator[LeaseRecord | None]:
    """Yield None if this gc may check and write ``gc.lock`` now, else a rival's claim.

    On a store with atomic create the lock's own create-only put decides, so
    there is nothing to do. Elsewhere each gc writes ``gc-claims/<id>`` and
    *then* lists the claims (the same write-then-check as leases against the
    lock): of two gcs claiming at once at least one sees the other, so at most
    one goes on. Both may back off; they retry with jitter. A claim lives only
    while its gc checks and writes the lock; a crashed gc's claim counts until
    it expires; gc deletes expired ones with the expired leases.
    """
    if store.capabilities.atomic_create:
        yield None
        return
    key = f"{GC_CLAIMS}/{record.id}"
    store.put(key, record.to_bytes(), durable=False)
    try:
        rival = None
        for other in store.list(GC_CLAIMS):
            if other == key:
                continue
            # A malformed claim raises ManifestValidationError naming it: we
            # cannot tell when it ends, and guessing could let two gcs sweep.
            claim = read_record(store, other)
            if claim is not None and claim.is_live():
                rival = claim
        yield rival
    finally:
        store.delete(key)


def _break_stale(store: ObjectStore, stale: LeaseRecord) -> None:
    # Re-read first so that a lock another breaker just took over is left alone.
    current = read_gc_lock(store)
    if current is not None and current.id == stale.id:
        why = stale.stale_reason() or "it expired"
        _log.warning("casnap: breaking the stale gc lock of %s: %s", stale.describe(), why)
        store.delete(GC_LOCK_KEY)


def break_gc_lock(store: ObjectStore, *, force: bool = False) -> str | None:
    """Remove ``gc.lock`` if it is stale or damaged; describe what went (None: there was none).

    A live lock (a gc that is running and renews it) stays, with
    :class:`GcBusyError` naming its holder, unless ``force``: use that only
    when no gc is running (a host that died, a clock far off). A lock that
    is not a record at all (malformed JSON, a FIFO) is removed too: nothing
    could ever release it.
    """
    try:
        lock = read_gc_lock(store)
    except (ManifestValidationError, ObjectRefusedError) as exc:
        store.delete(GC_LOCK_KEY)
        _log.warning("casnap: removed the damaged %s/%s (%s)", store.url, GC_LOCK_KEY, exc)
        return f"a damaged {GC_LOCK_KEY} ({exc})"
    if lock is None:
        return None
    reason = lock.stale_reason()
    if reason is None and not force:
        raise GcBusyError(
            f"{store.url}/{GC_LOCK_KEY} is held by a live gc: {lock.describe()}; it is renewed "
            "while that gc runs (break it with force=True / --force only if it does not)",
            lock,
        )
    store.delete(GC_LOCK_KEY)
    what = f"the gc lock of {lock.describe()}: {reason or 'live, removed by force'}"
    _log.warning("casnap: removed %s", what)
    return what
