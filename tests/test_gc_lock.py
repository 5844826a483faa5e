"""The gc lock: one gc at a time, a bounded life whatever it claims, loud waits.

Issue #23 point 5: a ``gc.lock`` written by hand, claiming to be held until
the year 9999 with an unparsable ``created_at``, made every take and every gc
wait without a word. These tests run real takes and real gcs against that
exact record, against a live lock a real gc session holds (which must still
be respected), and break locks through the API and the CLI. Two gcs at once
must not both sweep, also on a store without atomic create (claims).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from casnap import Repository, Snapshot, StateDict
from casnap.cli.app import main
from casnap.errors import ConfigError, GcBusyError, ObjectExistsError
from casnap.gc.collect import GcSession, gc
from casnap.repo.gc_lock import acquire_gc_lock
from casnap.repo.lease_record import GC_LOCK_KEY, MAX_RECORD_LIFE, LeaseRecord, read_gc_lock
from casnap.repo.leases import WAIT_NOTICE_AFTER, Lease
from casnap.repo.repository import RepoStorage
from casnap.store import LocalStore

# The record from the issue, byte for byte.
HOSTILE = b'{"id":"a","kind":"gc","created_at":"x","expires_at":"9999-01-01","host":"h","pid":1}'
BOUND = 20.0  # seconds a take or gc may take here; the bug waited forever


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.setenv("CASNAP_LEASE_TTL", "5")


@pytest.fixture
def repo(tmp_path) -> Repository:
    return Repository.of(RepoStorage.open_or_create(str(tmp_path / "repo")))


def state(seed: int) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    return StateDict(w=torch.randn(50_000, generator=g), b=torch.randn(10, generator=g))


def take_in_thread(repo: Repository, name: str, st: StateDict) -> tuple[threading.Thread, list]:
    """Start a real take in a daemon thread (a hang must not hang the test run)."""
    outcome: list = []

    def run() -> None:
        try:
            Snapshot.take(f"{repo.url}/{name}", {"s": st}, repository=repo)
            outcome.append("ok")
        except BaseException as exc:  # reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def restores(repo: Repository, name: str, st: StateDict) -> bool:
    out = StateDict({k: torch.zeros_like(v) for k, v in st.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"s": out})
    return all(torch.equal(out[k], st[k]) for k in st)


def test_a_stale_lock_of_a_crashed_gc_stops_counting_once_expired(repo):
    stale = LeaseRecord.new("gc", ttl=-1.0)
    repo.storage.store.put(GC_LOCK_KEY, stale.to_bytes())
    # does not wait for a dead gc
    Snapshot.take(f"{repo.url}/s1", {"s": state(1)}, repository=repo)
    gc(repo.storage, grace_seconds=0, wait_seconds=0)  # breaks the stale lock
    assert not repo.storage.store.exists(GC_LOCK_KEY)


def test_only_one_gc_at_a_time(repo):
    with GcSession(repo.storage), pytest.raises(GcBusyError, match="another gc"):
        gc(repo.storage, wait_seconds=0.2)
    gc(repo.storage)


class _CheckThenWrite(LocalStore):
    """A store without atomic create (like S3 before conditional writes): create-only is
    a check, a pause and a write, so two processes can both find the key free."""

    capabilities = dataclasses.replace(LocalStore.capabilities, atomic_create=False)

    def put(self, key, data, *, create_only=False, durable=True):
        if create_only:
            if self.exists(key):
                raise ObjectExistsError(f"object {key!r} already exists", key)
            time.sleep(0.05)
        super().put(key, data, durable=durable)


def _two_gcs_at_once(root: str) -> list[object]:
    stores = [_CheckThenWrite(root) for _ in range(2)]
    barrier = threading.Barrier(2)
    out: list[object] = [None, None]

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = acquire_gc_lock(stores[i], ttl=5, wait_seconds=0.5)
        except GcBusyError as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lock in out:
        if not isinstance(lock, Exception):
            assert isinstance(lock, Lease), lock
            lock.release()
    return out


@pytest.mark.parametrize("claims", [True, False], ids=["claims", "without-claims"])
def test_two_gcs_on_a_store_without_atomic_create(tmp_path, monkeypatch, claims):
    if not claims:  # the negative control: what the claim step prevents
        monkeypatch.setattr("casnap.repo.gc_lock._alone", _nobody_else)
    won = []
    for round_ in range(3):
        results = _two_gcs_at_once(str(tmp_path / f"r{round_}"))
        won.append(sum(not isinstance(r, GcBusyError) for r in results))
        assert list(LocalStore(str(tmp_path / f"r{round_}")).list("gc-claims")) == []
    if claims:
        assert won == [1, 1, 1]  # one gc runs, the other refuses with GcBusyError
    else:
        assert 2 in won  # both would sweep at once


@contextmanager
def _nobody_else(store, record):
    yield None


def test_the_hostile_lock_from_the_issue_stops_no_take(repo, caplog):
    repo.storage.store.put(GC_LOCK_KEY, HOSTILE)
    st = state(1)
    started = time.monotonic()
    thread, outcome = take_in_thread(repo, "s1", st)
    thread.join(BOUND)
    assert not thread.is_alive(), "the take is still waiting for the forged gc.lock"
    assert outcome == ["ok"] and time.monotonic() - started < BOUND
    assert restores(repo, "s1", st)
    # It said why it went ahead, naming the record and the way to remove it.
    text = caplog.text
    assert "ignoring the stale" in text and "gc a" in text and "casnap unlock" in text


def test_the_hostile_lock_from_the_issue_is_broken_by_gc(repo):
    Snapshot.take(f"{repo.url}/s1", {"s": state(1)}, repository=repo)
    repo.storage.store.put(GC_LOCK_KEY, HOSTILE)
    started = time.monotonic()
    result = repo.gc(grace_seconds=0, wait_seconds=BOUND)  # GcBusyError after BOUND before
    assert time.monotonic() - started < BOUND / 2
    assert result.plan is not None
    assert not repo.storage.store.exists(GC_LOCK_KEY)


@pytest.mark.parametrize(
    "change",
    [
        {"created_at": "x"},  # expiry plausible, but not a record a holder writes
        {"expires_at": "9999-01-01T00:00:00+00:00"},  # created_at fine, the claim is not
    ],
)
def test_a_record_no_holder_would_write_is_stale(change):
    record = LeaseRecord.new("gc", ttl=60).model_copy(update=change)
    assert record.stale_reason() is not None and not record.is_live()


def test_a_claim_within_the_bound_counts_until_it_expires():
    record = LeaseRecord.new("gc", ttl=60)
    assert record.stale_reason() is None
    assert record.is_live(time.time() + 59) and not record.is_live(time.time() + 61)
    # The longest TTL a holder may use, seen from a reader whose clock lags by minutes.
    longest = LeaseRecord.new("gc", ttl=1800)
    assert longest.is_live(time.time() - (MAX_RECORD_LIFE - 1800) + 1)


def test_a_ttl_beyond_the_bound_is_refused():
    with pytest.raises(ConfigError, match="exceeds the maximum"):
        LeaseRecord.new("take", ttl=7200)


def test_a_live_gc_lock_still_holds_a_take_and_the_wait_names_its_holder(repo, caplog):
    # A real gc session: its lock is renewed by its heartbeat (TTL 5 s) for
    # longer than the TTL, so only the bound on claims, not on holding, applies.
    caplog.set_level(logging.WARNING)
    st = state(2)
    with GcSession(repo.storage, wait_seconds=5) as session:
        holder = session.lock.record
        thread, outcome = take_in_thread(repo, "s1", st)
        time.sleep(max(6.0, WAIT_NOTICE_AFTER + 1))  # past the TTL: renewed, still live
        assert thread.is_alive() and not outcome and not repo.storage.has_ref("s1")
        now = read_gc_lock(repo.storage.store)
        assert now is not None and now.id == holder.id  # nobody broke it
        waits = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert waits, caplog.text
        assert holder.id[:12] in waits[0] and f"pid {holder.pid}" in waits[0]
        assert f"since {holder.created_at}" in waits[0] and "casnap unlock" in waits[0]
    thread.join(BOUND)
    assert outcome == ["ok"] and restores(repo, "s1", st)


def test_a_gc_waiting_for_a_live_lock_names_its_holder(repo, caplog):
    caplog.set_level(logging.WARNING)
    lock = acquire_gc_lock(repo.storage.store, ttl=5)
    try:
        with pytest.raises(GcBusyError, match="casnap unlock"):
            repo.gc(grace_seconds=0, wait_seconds=WAIT_NOTICE_AFTER + 1)
    finally:
        lock.release()
    assert f"gc {lock.id[:12]}" in caplog.text and "has waited" in caplog.text


def test_unlock_breaks_a_stale_lock_and_keeps_a_live_one(repo):
    assert repo.unlock() is None
    repo.storage.store.put(GC_LOCK_KEY, HOSTILE)
    removed = repo.unlock()
    assert removed is not None and "gc a" in removed and "9999" in removed
    assert not repo.storage.store.exists(GC_LOCK_KEY)

    lock = acquire_gc_lock(repo.storage.store, ttl=5)
    try:
        with pytest.raises(GcBusyError, match="live gc"):
            repo.unlock()
        now = read_gc_lock(repo.storage.store)
        assert now is not None and now.id == lock.id
        assert "removed by force" in repo.unlock(force=True)
        assert not repo.storage.store.exists(GC_LOCK_KEY)
    finally:
        lock.release()  # finds the lock gone or not its own: deletes nothing


def test_casnap_unlock_on_the_command_line(repo, capsys):
    repo.storage.store.put(GC_LOCK_KEY, b"{not json")  # damaged: nothing would ever release it
    assert main(["unlock", repo.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "damaged" in out["removed"] and not repo.storage.store.exists(GC_LOCK_KEY)

    lock = acquire_gc_lock(repo.storage.store, ttl=5)
    try:
        assert main(["unlock", repo.url]) != 0  # live: refused, naming the holder
        assert lock.id[:12] in capsys.readouterr().err
        assert repo.storage.store.exists(GC_LOCK_KEY)
        assert main(["unlock", repo.url, "--force"]) == 0
        assert not repo.storage.store.exists(GC_LOCK_KEY)
    finally:
        lock.release()
