"""Leases and the gc lock: how takes in flight and gc keep out of each other's way.

A take (or anything that turns an object into a root) holds
``.casnap/leases/<id>``; the one gc that may sweep holds ``.casnap/gc.lock``.
Each side writes its own record first and then checks for the other's, so no
take decides dedup while a gc marks and sweeps (docs/gc.md, "The protocol").
A heartbeat keeps a record live while its holder runs; a holder that could
not renew in time stops (:meth:`Lease.check` raises :class:`LeaseLostError`).
A record claiming more than
:data:`~casnap.repo.lease_record.MAX_RECORD_LIFE` counts as stale.

The records are :mod:`casnap.repo.lease_record`; gc's side is
:mod:`casnap.repo.gc_lock`; this module is the takes' side (and
:func:`wait_for_leases`, gc's wait for them). Example::

    with hold_lease(repo, kind="tag") as lease:
        manifest = repo.resolve("step_100")
        lease.check()  # still ours: no gc can have swept meanwhile
        write_the_tag(manifest)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from casnap.errors import (
    CasnapError,
    GcBlockedError,
    LeaseLostError,
    ManifestValidationError,
    ObjectRefusedError,
    StoreError,
)
from casnap.repo.lease_record import (
    GC_LOCK_KEY,
    LEASES,
    LeaseRecord,
    iso_time,
    read_gc_lock,
    read_record,
)
from casnap.repo.repository import META, RepoStorage
from casnap.settings import lease_ttl
from casnap.store import ObjectStore

_log = logging.getLogger(__name__)

# Polling for the other side starts fast (a gc sweep of a small repository
# takes milliseconds) and backs off to this.
_POLL_MAX = 0.25
_POLL_MIN = 0.01
# A wait for another's record is announced after this long, then again at
# this interval, naming the holder (a real gc usually ends in milliseconds).
WAIT_NOTICE_AFTER = 2.0
WAIT_NOTICE_EVERY = 30.0


class Lease:
    """A held lease or gc lock, renewed by a heartbeat thread until :meth:`release`.

    ``check()`` raises :class:`LeaseLostError` once the record may have
    expired in the eyes of others. A renewal counts only if its put returned
    ``margin`` seconds before the previous expiry (so no other process can have
    judged the record dead in between); otherwise the lease is lost for good.

    Only the process that took the lease releases it: in a child made by
    ``os.fork()`` (whose finalizers and ``with`` blocks may run ``release``),
    the record is the parent's, still guarding the parent's work, and the
    child's copy of the lease does nothing.
    """

    def __init__(self, store: ObjectStore, key: str, record: LeaseRecord, ttl: float) -> None:
        self.store = store
        self.key = key
        self.record = record
        self.ttl = ttl
        self.margin = ttl / 4
        self.period = ttl / 6
        self._valid_until = record.expires()
        self._lost = False
        self._released = False
        self._pid = os.getpid()  # the process that holds the record
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"casnap-lease-{record.id[:8]}", daemon=True
        )

    @property
    def id(self) -> str:
        return self.record.id

    def start(self) -> Lease:
        self._thread.start()
        return self

    def valid(self) -> bool:
        return (
            not self._lost
            and not self._released
            and time.time() < (self._valid_until - self.margin)
        )

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the record is certainly still live."""
        if not self.valid():
            raise LeaseLostError(
                f"{self.key} ({self.record.kind}) was not renewed in time; another process "
                "may have treated it as dead, so this operation stops without committing",
                self.key,
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            self._renew()

    def _renew(self) -> None:
        with self._guard:
            if self._released or self._lost:
                return
            deadline = self._valid_until - self.margin
            now = time.time()
            if now >= deadline:
                self._lost = True
                return
            record = self.record.model_copy(update={"expires_at": iso_time(now + self.ttl)})
            try:
                self.store.put(self.key, record.to_bytes(), durable=False)
            except StoreError as exc:
                _log.warning("casnap: renewing %s failed (%s); retrying", self.key, exc)
                return
            if time.time() < deadline:
                self.record, self._valid_until = record, now + self.ttl
            else:
                self._lost = True

    def release(self) -> None:
        """Stop renewing and delete the record (the gc lock only if it is still ours).

        In a forked child nothing happens: checked before any lock, which a parent
        thread may have held at the fork."""
        if self._pid != os.getpid():
            return
        with self._guard:
            if self._released:
                return
            self._released = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            if self.key == GC_LOCK_KEY:
                current = read_record(self.store, self.key)
                if current is None or current.id != self.id:
                    return  # broken as stale and taken by another gc: not ours to delete
            self.store.delete(self.key)
        except CasnapError as exc:
            # It expires by itself; failing the operation it guarded would be worse.
            _log.warning("casnap: could not delete %s (%s); it expires on its own", self.key, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def poll_delays(first: float = _POLL_MIN) -> Iterator[float]:
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, _POLL_MAX)


def acquire_lease(store: ObjectStore, *, kind: str = "take", ttl: float | None = None) -> Lease:
    """Write a lease, then make sure no live gc.lock exists (else withdraw, wait, retry).

    Waits as long as a live gc holds the lock; a crashed gc's lock stops
    counting once it expires. Returns the lease with its heartbeat running.
    """
    ttl = lease_ttl() if ttl is None else ttl
    notice = WaitNotice(kind, store)
    while True:
        record = LeaseRecord.new(kind, ttl)
        key = f"{LEASES}/{record.id}"
        store.put(key, record.to_bytes(), create_only=True, durable=False)
        try:
            lock = read_gc_lock(store)
        except BaseException:
            store.delete(key)
            raise
        if lock is None or not holds(store, lock):
            return Lease(store, key, record, ttl).start()
        # Withdraw before waiting: the gc waits for live leases, so keeping
        # ours while waiting for it would deadlock.
        store.delete(key)
        wait_for_gc(store, notice)


def unlock_hint(store: ObjectStore, force: str = "") -> str:
    """The command that removes the lock, naming the repository (not its META folder)."""
    url = store.url.removesuffix(f"/{META}")
    return f"`casnap unlock {url}{force}`"


def holds(store: ObjectStore, lock: LeaseRecord) -> bool:
    """Whether ``lock`` counts; a stale one is passed over with a warning naming it."""
    reason = lock.stale_reason()
    if reason is None:
        return True
    if lock.expires() > time.time():
        # Not merely expired (a crashed gc's lock, which the next gc breaks):
        # a claim no holder makes, which someone should look at.
        _log.warning(
            "casnap: ignoring the stale %s/%s of %s: %s (%s removes it)",
            store.url,
            GC_LOCK_KEY,
            lock.describe(),
            reason,
            unlock_hint(store),
        )
    return False


class WaitNotice:
    """Says now and then, as a log warning, who a wait is for: waiting is never silent."""

    def __init__(self, who: str, store: ObjectStore) -> None:
        self.who = who
        self.url = store.url
        self.hint = unlock_hint(store, " --force")
        self.start = time.monotonic()
        self.due = self.start + WAIT_NOTICE_AFTER

    def waiting_for(self, holder: LeaseRecord, what: str = GC_LOCK_KEY) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + WAIT_NOTICE_EVERY
        _log.warning(
            "casnap: %s has waited %.0f s for %s/%s, held by %s; if that gc is not "
            "running, %s breaks the lock",
            self.who,
            now - self.start,
            self.url,
            what,
            holder.describe(),
            self.hint,
        )


def wait_for_gc(store: ObjectStore, notice: WaitNotice | None = None) -> None:
    """Return once no live gc.lock exists, saying now and then who holds it."""
    notice = WaitNotice("a take", store) if notice is None else notice
    for delay in poll_delays():
        lock = read_gc_lock(store)
        if lock is None or not holds(store, lock):
            return
        notice.waiting_for(lock)
        time.sleep(delay)


@contextmanager
def hold_lease(
    repo: RepoStorage, *, kind: str = "take", ttl: float | None = None
) -> Iterator[Lease]:
    """Hold a lease on ``repo`` for the duration of the block (see the module docstring)."""
    lease = acquire_lease(repo.store, kind=kind, ttl=ttl)
    try:
        yield lease
    finally:
        lease.release()


@dataclass(frozen=True)
class LeaseScan:
    """The leases present, by liveness at one moment."""

    live: tuple[tuple[str, LeaseRecord], ...]
    dead: tuple[tuple[str, LeaseRecord], ...]
    malformed: tuple[str, ...]  # counted as live: we cannot tell when they end

    @property
    def blocking(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.live) + self.malformed


def scan_leases(store: ObjectStore, now: float | None = None, folder: str = LEASES) -> LeaseScan:
    """The records below ``folder``: takes' leases, or (``GC_CLAIMS``) gcs' claims."""
    now = time.time() if now is None else now
    live: list[tuple[str, LeaseRecord]] = []
    dead: list[tuple[str, LeaseRecord]] = []
    malformed: list[str] = []
    for key in sorted(store.list(folder)):
        try:
            record = read_record(store, key)
        except (ManifestValidationError, ObjectRefusedError):  # not a record casnap wrote
            malformed.append(key)
            continue
        if record is None:
            continue  # released while listing
        (live if record.is_live(now) else dead).append((key, record))
    return LeaseScan(tuple(live), tuple(dead), tuple(malformed))


def wait_for_leases(store: ObjectStore, wait_seconds: float) -> int:
    """Poll until no live lease exists; :class:`GcBlockedError` after ``wait_seconds``.

    Called by gc while it holds the lock, so no new lease can stay: a take that
    writes one now sees the lock and withdraws it. Returns how many leases
    were live at first (the takes gc waited for).
    """
    deadline = time.monotonic() + wait_seconds
    first: int | None = None
    for delay in poll_delays():
        scan = scan_leases(store)
        if first is None:
            first = len(scan.blocking)
        if not scan.blocking:
            return first
        if time.monotonic() >= deadline:
            held = [f"{k}: {r.describe()}" for k, r in scan.live]
            held += [f"{k}: malformed (delete it if no take is running)" for k in scan.malformed]
            raise GcBlockedError(
                f"gc gave up after {wait_seconds:g} s: {len(held)} take(s) still in flight "
                f"in {store.url} ({'; '.join(held)}); nothing was deleted",
                scan.blocking,
            )
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
    raise AssertionError("unreachable")  # pragma: no cover
