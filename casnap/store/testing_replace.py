"""The conditional replace of the object-store contract, as conformance tests.

:class:`~casnap.store.testing.StoreConformance` includes these, so every
backend that runs the suite runs them too; they live here only to keep each
module short. :func:`race` runs callables on threads released together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from casnap.errors import InvalidNameError, ObjectChangedError, StoreError
from casnap.store.base import ObjectStore


def race(n: int, work: Callable[[int], object]) -> list[object]:
    """Run ``work(i)`` for i in range(n) on n threads released together; results or exceptions."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # collected and asserted on by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class ReplaceConformance:
    """``replace(key, data, expected=...)``: compare and swap (see :mod:`casnap.store.base`)."""

    def reopen(self, store: ObjectStore) -> ObjectStore:
        return store

    def _racer(self, store: ObjectStore) -> ObjectStore:
        """A handle for one racing writer: its own client where the store claims that
        replace is atomic across processes, else the same one (atomic only within it)."""
        return self.reopen(store) if store.capabilities.conditional_replace else store

    def test_replace_when_it_holds_what_is_expected(self, store: ObjectStore) -> None:
        store.put("r/ref", b"version one")
        store.replace("r/ref", b"two", expected=b"version one")
        assert store.get("r/ref") == b"two"
        store.replace("r/ref", [b"thr", b"ee"], expected=b"two")
        assert store.get("r/ref") == b"three"
        store.put("r/empty", b"")
        store.replace("r/empty", b"full", expected=b"")
        assert store.get("r/empty") == b"full"
        assert sorted(store.list("r")) == ["r/empty", "r/ref"]
        assert list(store.list_temporary()) == []

    def test_replace_of_other_content_changes_nothing(self, store: ObjectStore) -> None:
        store.put("r/ref", b"current")
        for wrong in (b"stale", b"curren", b"current!", b""):
            with pytest.raises(ObjectChangedError) as info:
                store.replace("r/ref", b"new", expected=wrong)
            err = info.value
            assert isinstance(err, StoreError) and isinstance(err, FileExistsError)
            assert not err.transient  # the same replace meets the same object again
            assert err.key == "r/ref" and "r/ref" in str(err)
        assert store.get("r/ref") == b"current"

    def test_replace_of_a_missing_object(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectChangedError):
            store.replace("r/none", b"new", expected=b"old")
        with pytest.raises(ObjectChangedError):
            store.replace("deep/er/none", b"new", expected=b"old")
        assert not store.exists("r/none") and not store.exists("deep/er/none")
        store.put("r/gone", b"old")
        store.delete("r/gone")
        with pytest.raises(ObjectChangedError):
            store.replace("r/gone", b"new", expected=b"old")
        assert not store.exists("r/gone")

    def test_replace_expecting_none_creates_only(self, store: ObjectStore) -> None:
        store.replace("r/new", b"first", expected=None)
        assert store.get("r/new") == b"first"
        with pytest.raises(ObjectChangedError) as info:
            store.replace("r/new", b"second", expected=None)
        assert info.value.key == "r/new"
        assert store.get("r/new") == b"first"

    def test_replace_refuses_unsafe_keys(self, store: ObjectStore) -> None:
        for key in ("../x", "/abs", "a//b", "", "x~tmp-0"):
            with pytest.raises(InvalidNameError):
                store.replace(key, b"x", expected=b"y")
            with pytest.raises(InvalidNameError):
                store.replace(key, b"x", expected=None)

    def test_concurrent_replacers_from_one_version_one_winner(self, store: ObjectStore) -> None:
        n = 6
        for round_ in range(3):
            key = f"race/{round_}"
            store.put(key, b"base")
            handles = [self._racer(store) for _ in range(n)]

            def swap(i: int, key: str = key, handles: list[ObjectStore] = handles) -> None:
                handles[i].replace(key, f"writer {i}".encode(), expected=b"base")

            results = race(n, swap)
            winners = [i for i, r in enumerate(results) if r is None]
            assert len(winners) == 1, results
            losers = [r for r in results if r is not None]
            assert all(isinstance(r, ObjectChangedError) for r in losers), losers
            assert store.get(key) == f"writer {winners[0]}".encode()

    def test_concurrent_creating_replacers_one_winner(self, store: ObjectStore) -> None:
        handles = [self._racer(store) for _ in range(6)]
        results = race(6, lambda i: handles[i].replace("race/new", b"%d" % i, expected=None))
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        assert all(isinstance(r, ObjectChangedError) for r in results if r is not None)
        assert store.get("race/new") == b"%d" % winners[0]

    def test_read_then_replace_loses_no_update(self, store: ObjectStore) -> None:
        # Writers that read, append a token of their own and replace, again when
        # they lost: with a last-writer-wins put some tokens would vanish. (A
        # token may appear twice where a replace landed but its answer was lost,
        # and another writer moved the object before the retry looked.)
        writers, each = 4, 4
        store.put("log", b"")
        handles = [self._racer(store) for _ in range(writers)]

        def append(i: int) -> None:
            for k in range(each):
                while True:
                    old = handles[i].get("log")
                    try:
                        handles[i].replace("log", old + b"%d.%d," % (i, k), expected=old)
                        break
                    except ObjectChangedError:
                        continue

        assert race(writers, append) == [None] * writers
        tokens = store.get("log").decode().split(",")[:-1]
        assert set(tokens) == {f"{i}.{k}" for i in range(writers) for k in range(each)}
