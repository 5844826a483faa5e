"""Takes, restores and manifest parses pause Python's cyclic collector (casnap.python_gc).

A full collection walks every object of the process (0.1 s with torch
imported); a take of many small tensors used to trigger several.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from helpers import numbered_tensors

from casnap import Session, Snapshot, StateDict
from casnap.errors import CasnapError
from casnap.python_gc import python_gc_paused


@pytest.fixture
def eager_collector():
    """A collector that makes a full collection every few hundred new objects, as it
    would in a process whose heap were small: the objects there are frozen (a full
    collection waits for the survivors to grow by a quarter of the rest) and the
    thresholds low. Thresholds, frozen objects and state come back afterwards."""
    before, enabled = gc.get_threshold(), gc.isenabled()
    gc.freeze()
    gc.collect()
    gc.enable()
    gc.set_threshold(100, 2, 2)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
        (gc.enable if enabled else gc.disable)()


def _full_collections_during(fn) -> int:
    seen = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return len(seen)


def test_a_take_and_a_retake_make_no_full_collection(tmp_path, eager_collector):
    app, session = {"m": StateDict(numbered_tensors(500))}, Session()
    first = _full_collections_during(
        lambda: Snapshot.take(str(tmp_path / "repo" / "s1"), app, session=session)
    )
    again = _full_collections_during(
        lambda: Snapshot.take(str(tmp_path / "repo" / "s2"), app, session=session)
    )
    assert (first, again) == (0, 0)
    assert gc.isenabled()  # restored after the take


def test_a_failed_take_restores_the_collector(tmp_path, eager_collector):
    app = {"m": StateDict(numbered_tensors(10))}
    Snapshot.take(str(tmp_path / "repo" / "s1"), app)
    with pytest.raises(CasnapError):  # the name is taken
        Snapshot.take(str(tmp_path / "repo" / "s1"), app)
    assert gc.isenabled()


def test_a_process_that_disabled_the_collector_keeps_it_disabled(tmp_path, eager_collector):
    gc.disable()
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(numbered_tensors(10))})
    assert not gc.isenabled()


def test_overlapping_pauses_restore_collection_once_the_last_ends(eager_collector):
    entered, release = threading.Event(), threading.Event()

    def other_take() -> None:
        with python_gc_paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other_take)
    with python_gc_paused():
        t.start()
        entered.wait(10)
        with python_gc_paused():  # reentrant
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's take still runs
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_restore_and_a_manifest_parse_make_no_full_collection(tmp_path, eager_collector):
    from casnap import Repository

    app = {"m": StateDict(numbered_tensors(500))}
    Snapshot.take(str(tmp_path / "repo" / "s1"), app)
    storage = Repository(str(tmp_path / "repo")).storage
    manifest_hash = storage.read_ref("s1").manifest
    parsed = _full_collections_during(lambda: storage.read_manifest(manifest_hash))
    target = {"m": StateDict({k: torch.zeros(64) for k in app["m"]})}
    restored = _full_collections_during(
        lambda: Snapshot(str(tmp_path / "repo" / "s1")).restore(target)
    )
    # Collection resumes when the restore ends: at most the one it deferred runs then.
    assert parsed == 0 and restored <= 1
    assert all(torch.equal(target["m"][k], app["m"][k]) for k in app["m"])
    assert gc.isenabled()
