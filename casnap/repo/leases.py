"""Leases and the gc lock: how takes in flight and gc keep out of each other's way.

Two kinds of record share one JSON shape (:class:`LeaseRecord`):

- ``.casnap/leases/<id>`` is held by a take, from before it decides anything
  about dedup until after its ref is written, and by anything else that turns
  an existing object into a root (tagging a snapshot, say).
- ``.casnap/gc.lock`` is held by the one gc that may sweep.

Each side *writes its own record first and then checks for the other's*
(Dekker's protocol, over the store). On a store whose operations are
linearizable (a local directory, GCS) at least one of the two sees the other:
a take that finds a live gc.lock withdraws its lease and waits for the gc to
finish; a gc that finds a live lease waits for it to go, or gives up. So no
take decides dedup while a gc marks and sweeps. The argument is in docs/gc.md.

A record is live until its ``expires_at``. A heartbeat thread pushes that out
while the holder runs, so only a crashed holder's record expires. A holder
whose heartbeat could not renew it in time must assume it was declared dead:
:meth:`Lease.check` then raises :class:`LeaseLostError` and the holder stops
instead of committing. ``CASNAP_LEASE_TTL`` (seconds, default 120, at most
30 min) sets the time to live.

A record's claim is bounded whatever it says: one whose expiry lies more
than :data:`MAX_RECORD_LIFE` ahead, or whose times do not parse, is not one a
casnap holder writes, and counts as stale (:meth:`LeaseRecord.stale_reason`).
So a hostile ``gc.lock`` claiming the year 9999 stops no take; a waiting take
or gc says every so often who it waits for; :func:`break_gc_lock`
(``casnap unlock``) removes a stale or damaged lock.

Example::

    with hold_lease(repo, kind="tag") as lease:
        manifest = repo.resolve("step_100")
        lease.check()  # still ours: no gc can have swept meanwhile
        write_the_tag(manifest)
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from casnap.errors import (  # noqa: F401  (defined in errors.py)
    CasnapError,
    ConfigError,
    GcBlockedError,
    GcBusyError,
    LeaseLostError,
    ManifestValidationError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRefusedError,
    StoreError,
)
from casnap.format.json_text import canonical_json, load_json
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.repo.repository import META, RepoStorage
from casnap.settings import MAX_LEASE_TTL, lease_ttl
from casnap.store import ObjectStore

_log = logging.getLogger(__name__)

LEASES = "leases"
GC_LOCK_KEY = "gc.lock"
# Claims of gcs about to take gc.lock, on stores without atomic create (_alone).
GC_CLAIMS = "gc-claims"
# Polling for the other side starts fast (a gc sweep of a small repository
# takes milliseconds) and backs off to this.
_POLL_MAX = 0.25
_POLL_MIN = 0.01
# A holder writes expires_at = its clock + TTL (at most MAX_LEASE_TTL); the
# slack absorbs a holder's clock running ahead of the reader's. A record that
# claims more is forged or broken, never a holder's (docs/gc.md).
CLOCK_SLACK = 300.0
MAX_RECORD_LIFE = MAX_LEASE_TTL + CLOCK_SLACK
# A wait for another's record is announced after this long, then again at
# this interval, naming the holder (a real gc usually ends in milliseconds).
WAIT_NOTICE_AFTER = 2.0
WAIT_NOTICE_EVERY = 30.0


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")


def parse_time(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time (naive times are UTC)."""
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


class LeaseRecord(BaseModel):
    """The JSON of a lease or of the gc lock (untrusted on read)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: StrictStr
    kind: StrictStr  # "take", "tag", "gc", ...
    created_at: StrictStr
    expires_at: StrictStr
    host: StrictStr
    pid: StrictInt

    @classmethod
    def new(cls, kind: str, ttl: float) -> LeaseRecord:
        if ttl > MAX_LEASE_TTL:  # others would judge the record stale (stale_reason)
            raise ConfigError(f"a lease TTL of {ttl:g} s exceeds the maximum {MAX_LEASE_TTL:g} s")
        now = time.time()
        return cls(
            id=uuid.uuid4().hex,
            kind=kind,
            created_at=_iso(now),
            expires_at=_iso(now + ttl),
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    def expires(self) -> float:
        return parse_time(self.expires_at)

    def stale_reason(self, now: float | None = None) -> str | None:
        """Why the record no longer counts (None while it is live).

        Its own expiry ends it, but only a claim a holder could have made
        counts: both times must parse and the expiry may lie at most
        :data:`MAX_RECORD_LIFE` ahead (a heartbeat pushes it out by the TTL,
        at most 30 min, from the holder's clock). Anything else (``"x"`` as
        ``created_at``, an expiry in the year 9999) was written by something
        that is not a live holder, so it holds nobody up.
        """
        now = time.time() if now is None else now
        try:
            parse_time(self.created_at)
        except (ValueError, OverflowError):
            return f"its created_at {self.created_at[:40]!r} is not a time"
        expires = self.expires()
        if expires <= now:
            return f"it expired at {self.expires_at}"
        if expires > now + MAX_RECORD_LIFE:
            return (
                f"it claims to live until {self.expires_at[:40]}, more than "
                f"{MAX_RECORD_LIFE:g} s ahead, which no casnap holder writes"
            )
        return None

    def is_live(self, now: float | None = None) -> bool:
        return self.stale_reason(now) is None

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump())

    def describe(self) -> str:
        where = (
            f"host {self.host[:64]}, pid {self.pid}, since {self.created_at[:40]}, "
            f"expires {self.expires_at[:40]}"
        )
        return f"{self.kind} {self.id[:12]} ({where})"


def parse_record(data: bytes, key: str) -> LeaseRecord:
    """Validate a lease or lock record; a malformed one raises ManifestValidationError."""
    if len(data) > MAX_RECORD_BYTES:
        raise ManifestValidationError(f"{key} is larger than {MAX_RECORD_BYTES} bytes", key)
    raw = load_json(data, key)
    try:
        record = LeaseRecord.model_validate(raw)
        record.expires()
    except (ValueError, OverflowError, ValidationError) as exc:
        raise ManifestValidationError(f"{key} is not a valid lease record: {exc}", key) from exc
    return record


def read_record(store: ObjectStore, key: str) -> LeaseRecord | None:
    """The record at ``key``, or None when there is none."""
    try:
        data = store.get(key, limit=MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        return None
    return parse_record(data, key)


def read_gc_lock(store: ObjectStore) -> LeaseRecord | None:
    """The gc lock's record (live or not), or None when no gc holds or left one."""
    return read_record(store, GC_LOCK_KEY)


class Lease:
    """A held lease or gc lock, renewed by a heartbeat thread until :meth:`release`.

    ``check()`` raises :class:`LeaseLostError` once the record may have
    expired in the eyes of others. A renewal counts only if its put returned
    ``margin`` seconds before the previous expiry (so no other process can have
    judged the record dead in between); otherwise the lease is lost for good.
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
            record = self.record.model_copy(update={"expires_at": _iso(now + self.ttl)})
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
        """Stop renewing and delete the record (the gc lock only if it is still ours)."""
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


def _poll_delays(first: float = _POLL_MIN) -> Iterator[float]:
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
    notice = _WaitNotice(kind, store)
    while True:
        record = LeaseRecord.new(kind, ttl)
        key = f"{LEASES}/{record.id}"
        store.put(key, record.to_bytes(), create_only=True, durable=False)
        try:
            lock = read_gc_lock(store)
        except BaseException:
            store.delete(key)
            raise
        if lock is None or not _holds(store, lock):
            return Lease(store, key, record, ttl).start()
        # Withdraw before waiting: the gc waits for live leases, so keeping
        # ours while waiting for it would deadlock.
        store.delete(key)
        wait_for_gc(store, notice)


def _unlock_hint(store: ObjectStore, force: str = "") -> str:
    """The command that removes the lock, naming the repository (not its META folder)."""
    url = store.url.removesuffix(f"/{META}")
    return f"`casnap unlock {url}{force}`"


def _holds(store: ObjectStore, lock: LeaseRecord) -> bool:
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
            _unlock_hint(store),
        )
    return False


class _WaitNotice:
    """Says now and then, as a log warning, who a wait is for: waiting is never silent."""

    def __init__(self, who: str, store: ObjectStore) -> None:
        self.who = who
        self.url = store.url
        self.hint = _unlock_hint(store, " --force")
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


def wait_for_gc(store: ObjectStore, notice: _WaitNotice | None = None) -> None:
    """Return once no live gc.lock exists, saying now and then who holds it."""
    notice = _WaitNotice("a take", store) if notice is None else notice
    for delay in _poll_delays():
        lock = read_gc_lock(store)
        if lock is None or not _holds(store, lock):
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
    delays = _poll_delays()
    notice = _WaitNotice("gc", store)
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
                f"running, {_unlock_hint(store, ' --force')} breaks the lock",
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
    for delay in _poll_delays():
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
