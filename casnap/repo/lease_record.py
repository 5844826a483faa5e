"""Lease and gc-lock records: their keys, their JSON, when one stops counting.

A take's lease (``.casnap/leases/<id>``), the gc lock (``.casnap/gc.lock``)
and a gc's claim (``.casnap/gc-claims/<id>``) share one JSON shape,
:class:`LeaseRecord`, untrusted on read. A record is live until its
``expires_at``, and only a claim a holder could have made counts: one whose
expiry lies more than :data:`MAX_RECORD_LIFE` ahead, or whose times do not
parse, is stale (:meth:`LeaseRecord.stale_reason`). The protocol that uses
them is :mod:`casnap.repo.leases` (takes) and :mod:`casnap.repo.gc_lock` (gc).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from casnap.errors import ConfigError, ManifestValidationError, ObjectNotFoundError
from casnap.format.json_text import canonical_json, load_json
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.settings import MAX_LEASE_TTL
from casnap.store import ObjectStore

LEASES = "leases"
GC_LOCK_KEY = "gc.lock"
# Claims of gcs about to take gc.lock, on stores without atomic create (_alone).
GC_CLAIMS = "gc-claims"
# A holder writes expires_at = its clock + TTL (at most MAX_LEASE_TTL); the
# slack absorbs a holder's clock running ahead of the reader's. A record that
# claims more is forged or broken, never a holder's (docs/gc.md).
CLOCK_SLACK = 300.0
MAX_RECORD_LIFE = MAX_LEASE_TTL + CLOCK_SLACK


def iso_time(ts: float) -> str:
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
            created_at=iso_time(now),
            expires_at=iso_time(now + ttl),
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
