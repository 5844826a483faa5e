"""The object-store contract as a reusable test suite, for casnap's backends and yours.

Every backend runs the same tests: subclass :class:`StoreConformance` in a
pytest module and provide a ``store`` fixture that yields an empty store::

    import pytest
    from casnap.store.testing import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path)

        def reopen(self, store):  # optional: a second, independent handle
            return MyStore(store.root)

The contract itself is documented in :mod:`casnap.store.base`. This module
needs pytest (the ``test`` extra); nothing else in casnap imports it.

The stores that fail on purpose (:class:`~casnap.store.faults.FaultyStore`,
:class:`~casnap.store.faults.FailingStore`) live in :mod:`casnap.store.faults`,
which does not need pytest; ``FaultyStore`` is importable from here too.
"""

from __future__ import annotations

import array
import os
import threading
import time

import pytest

from casnap.errors import (
    IntegrityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRefusedError,
    StoreError,
)
from casnap.store.base import Capabilities, ObjectInfo, ObjectStore
from casnap.store.faults import FaultyStore
from casnap.store.testing_replace import ReplaceConformance
from casnap.store.testing_replace import race as _race

__all__ = ["FaultyStore", "ReplaceConformance", "StoreConformance"]

UNSAFE_KEYS = [
    "../x",
    "a/../../x",
    "/abs",
    "a//b",
    "a/./b",
    ".",
    "..",
    "",
    "a/",
    "a\\b",
    "a b",
    "a\x00b",
    "x~tmp-0",
]

# Valid keys that look like things a backend might treat specially.
ODD_KEYS = ["a.tmp-1", "..a", "a..", "-x", "x=1,y@2%+_", ".hidden"]

LARGE = 9 << 20  # above the usual single-request and buffer sizes of clients


def _keys(store: ObjectStore, prefix: str = "") -> list[str]:
    return sorted(store.list(prefix))


class StoreConformance(ReplaceConformance):
    """Tests every :class:`~casnap.store.ObjectStore` must pass (with the conditional
    replace's, :class:`~casnap.store.testing_replace.ReplaceConformance`)."""

    def reopen(self, store: ObjectStore) -> ObjectStore:
        """A second handle on the same objects, with its own client and caches."""
        return store

    # -- put / get -----------------------------------------------------------

    def test_put_get_bytes(self, store: ObjectStore) -> None:
        store.put("obj", b"hello world")
        assert store.get("obj") == b"hello world"

    def test_get_returns_bytes(self, store: ObjectStore) -> None:
        store.put("obj", bytearray(b"abc"))
        data = store.get("obj")
        assert type(data) is bytes
        assert data == b"abc"

    def test_put_memoryview(self, store: ObjectStore) -> None:
        backing = bytearray(b"0123456789")
        store.put("slice", memoryview(backing)[2:7])
        floats = array.array("f", [1.5, -2.0, 3.25])  # a typed buffer, like a tensor's
        store.put("floats", memoryview(floats))
        assert store.get("slice") == b"23456"
        assert store.get("floats") == floats.tobytes()

    def test_put_list_of_buffers(self, store: ObjectStore) -> None:
        parts: list[bytes | bytearray | memoryview] = [
            b"head|",
            bytearray(b"middle|"),
            b"",
            memoryview(b"xxtail")[2:],
        ]
        store.put("joined", parts)
        assert store.get("joined") == b"head|middle|tail"

    def test_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        store.put("empty-list", [])
        assert store.exists("empty")
        assert store.get("empty") == b""
        assert store.get("empty-list") == b""
        assert store.get_range("empty", 0, 10) == b""
        assert _keys(store) == ["empty", "empty-list"]

    def test_nested_keys(self, store: ObjectStore) -> None:
        store.put("a/b/c/d", b"deep")
        assert store.get("a/b/c/d") == b"deep"

    def test_odd_but_valid_keys(self, store: ObjectStore) -> None:
        for i, key in enumerate(ODD_KEYS):
            store.put(f"odd/{key}", str(i).encode())
        for i, key in enumerate(ODD_KEYS):
            assert store.get(f"odd/{key}") == str(i).encode()
        assert _keys(store, "odd") == sorted(f"odd/{k}" for k in ODD_KEYS)

    def test_large_object(self, store: ObjectStore) -> None:
        data = os.urandom(LARGE)
        store.put("big", [data[: LARGE // 3], memoryview(data)[LARGE // 3 :]])
        assert store.get("big") == data
        mid = LARGE // 2
        assert store.get_range("big", mid - 5, mid + (1 << 20)) == data[mid - 5 : mid + (1 << 20)]

    @pytest.mark.parametrize("size", [10, 5000, (1 << 20) + 56])
    def test_read_into_fills_the_buffers_in_order(self, store: ObjectStore, size: int) -> None:
        """Split reads (a large local file's first page comes alone) fill every buffer."""
        data = os.urandom(size)
        store.put("frame", data)
        bufs = [bytearray(56), bytearray(5000), bytearray(size)]
        n = store.read_into("frame", [memoryview(b) for b in bufs])
        assert n == size  # buffers longer than the object: what it holds
        assert b"".join(bufs)[:size] == data
        whole = bytearray(size)
        assert store.read_into("frame", [memoryview(whole)]) == size and whole == data
        short = bytearray(size // 2)
        assert store.read_into("frame", [memoryview(short)]) == size // 2
        assert short == data[: size // 2]

    # -- get with a limit ----------------------------------------------------

    def test_get_within_limit(self, store: ObjectStore) -> None:
        store.put("small", b"0123456789")
        store.put("empty", b"")
        assert store.get("small", limit=10) == b"0123456789"
        assert store.get("small", limit=1 << 20) == b"0123456789"
        assert store.get("empty", limit=0) == b""
        assert store.get("empty", limit=5) == b""

    def test_get_over_limit_is_refused(self, store: ObjectStore) -> None:
        store.put("record", b"x" * 100)
        for limit in (0, 1, 99):
            with pytest.raises(ObjectRefusedError) as info:
                store.get("record", limit=limit)
            err = info.value
            assert isinstance(err, StoreError) and isinstance(err, IntegrityError)
            assert not err.transient  # repeating the read cannot help
            assert err.key == "record"
            assert "record" in str(err) and str(limit) in str(err)
        assert store.get("record") == b"x" * 100  # no limit: the whole object

    def test_get_large_object_with_limit(self, store: ObjectStore) -> None:
        data = os.urandom(LARGE)
        store.put("big", data)
        assert store.get("big", limit=LARGE) == data
        with pytest.raises(ObjectRefusedError):
            store.get("big", limit=LARGE - 1)
        with pytest.raises(ObjectRefusedError):
            store.get("big", limit=64 << 10)

    def test_get_missing_with_limit(self, store: ObjectStore) -> None:
        store.put("dir/obj", b"x")
        with pytest.raises(ObjectNotFoundError):
            store.get("nope", limit=10)
        with pytest.raises(ObjectNotFoundError):
            store.get("dir", limit=10)
        with pytest.raises(InvalidNameError):
            store.get("../x", limit=10)

    # -- get_range -----------------------------------------------------------

    def test_get_range_middle(self, store: ObjectStore) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 2, 5) == b"234"
        assert store.get_range("r", 0, 10) == b"0123456789"

    def test_get_range_past_end(self, store: ObjectStore) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 7, 100) == b"789"
        assert store.get_range("r", 10, 20) == b""
        assert store.get_range("r", 50, 60) == b""

    def test_get_range_zero_length(self, store: ObjectStore) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 4, 4) == b""
        assert store.get_range("r", 0, 0) == b""

    def test_get_range_rejects_bad_bounds(self, store: ObjectStore) -> None:
        store.put("r", b"0123456789")
        with pytest.raises(ValueError):
            store.get_range("r", 5, 4)
        with pytest.raises(ValueError):
            store.get_range("r", -1, 4)

    # -- missing objects -----------------------------------------------------

    def test_get_missing(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError) as info:
            store.get("nope/missing")
        assert isinstance(info.value, FileNotFoundError)
        assert info.value.key == "nope/missing"

    def test_get_range_missing(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.get_range("missing", 0, 10)
        with pytest.raises(ObjectNotFoundError):
            store.get_range("missing", 3, 3)
        with pytest.raises(FileNotFoundError):
            store.get_range("missing", 100, 200)

    def test_prefix_is_not_an_object(self, store: ObjectStore) -> None:
        store.put("dir/obj", b"x")
        assert not store.exists("dir")
        with pytest.raises(ObjectNotFoundError):
            store.get("dir")
        with pytest.raises(ObjectNotFoundError):
            store.get_range("dir", 0, 1)
        store.delete("dir")
        assert store.get("dir/obj") == b"x"

    def test_key_below_an_object_is_missing(self, store: ObjectStore) -> None:
        store.put("file", b"x")
        assert not store.exists("file/child")
        with pytest.raises(ObjectNotFoundError):
            store.get("file/child")
        store.delete("file/child")
        assert store.get("file") == b"x"

    # -- create-only and overwrite -------------------------------------------

    def test_create_only_new(self, store: ObjectStore) -> None:
        store.put("c/new", b"first", create_only=True)
        assert store.get("c/new") == b"first"

    def test_create_only_existing(self, store: ObjectStore) -> None:
        store.put("c/obj", b"original")
        with pytest.raises(ObjectExistsError) as info:
            store.put("c/obj", b"replacement", create_only=True)
        assert isinstance(info.value, FileExistsError)
        assert info.value.key == "c/obj"
        assert store.get("c/obj") == b"original"
        assert _keys(store) == ["c/obj"]

    def test_create_only_after_delete(self, store: ObjectStore) -> None:
        store.put("c/obj", b"one", create_only=True)
        store.delete("c/obj")
        store.put("c/obj", b"two", create_only=True)
        assert store.get("c/obj") == b"two"

    def test_overwrite_replaces(self, store: ObjectStore) -> None:
        store.put("o", b"a much longer first version")
        store.put("o", b"short")
        assert store.get("o") == b"short"
        store.put("o", [b"list ", b"version"])
        assert store.get("o") == b"list version"
        assert _keys(store) == ["o"]

    def test_concurrent_create_only_one_winner(self, store: ObjectStore) -> None:
        n = 10
        for round_ in range(5):
            key = f"race/{round_}"

            def create(i: int, key: str = key) -> None:
                store.put(key, f"w{i}".encode(), create_only=True)

            results = _race(n, create)
            winners = [i for i, r in enumerate(results) if r is None]
            losers = [r for r in results if r is not None]
            assert len(winners) == 1, results
            assert all(isinstance(r, ObjectExistsError) for r in losers), losers
            assert store.get(key) == f"w{winners[0]}".encode()

    def test_readers_never_see_a_partial_put(self, store: ObjectStore) -> None:
        size = 1 << 20
        versions = [bytes([v]) * size for v in range(4)]
        store.put("hot", versions[0])
        stop = threading.Event()
        seen: list[bytes] = []

        def write() -> None:
            for i in range(12):
                store.put("hot", versions[i % len(versions)])
            stop.set()

        writer = threading.Thread(target=write)
        writer.start()
        try:
            while True:
                seen.append(store.get("hot"))
                if stop.is_set():
                    break
        finally:
            writer.join()
        assert seen
        assert all(data in versions for data in seen)

    # -- exists / delete -----------------------------------------------------

    def test_exists(self, store: ObjectStore) -> None:
        assert not store.exists("e/k")
        store.put("e/k", b"1")
        assert store.exists("e/k")
        assert not store.exists("e/k2")
        store.delete("e/k")
        assert not store.exists("e/k")

    def test_delete(self, store: ObjectStore) -> None:
        store.put("d/one", b"1")
        store.put("d/two", b"2")
        store.delete("d/one")
        assert not store.exists("d/one")
        with pytest.raises(ObjectNotFoundError):
            store.get("d/one")
        assert _keys(store) == ["d/two"]

    def test_delete_missing_is_fine(self, store: ObjectStore) -> None:
        store.delete("never/written")
        store.put("once", b"x")
        store.delete("once")
        store.delete("once")
        assert _keys(store) == []

    # -- list ----------------------------------------------------------------

    def test_list_empty_store(self, store: ObjectStore) -> None:
        assert _keys(store) == []
        assert _keys(store, "anything") == []

    def test_list_prefix_recursively(self, store: ObjectStore) -> None:
        keys = ["chunks/ab/abc1", "chunks/ab/abd2", "chunks/cd/cde3", "refs/main", "refs/x/y/z"]
        for key in keys:
            store.put(key, key.encode())
        assert _keys(store) == sorted(keys)
        assert _keys(store, "chunks") == keys[:3]
        assert _keys(store, "chunks/ab") == keys[:2]
        assert _keys(store, "refs") == ["refs/main", "refs/x/y/z"]
        assert _keys(store, "refs/x") == ["refs/x/y/z"]

    def test_list_missing_prefix(self, store: ObjectStore) -> None:
        store.put("refs/main", b"x")
        assert _keys(store, "nothing") == []
        assert _keys(store, "refs/nothing/deeper") == []

    def test_list_prefix_is_a_folder_not_a_string_prefix(self, store: ObjectStore) -> None:
        store.put("ref", b"1")
        store.put("refs/a", b"2")
        store.put("refsx/b", b"3")
        assert _keys(store, "ref") == []
        assert _keys(store, "refs") == ["refs/a"]

    def test_list_after_delete_and_overwrite(self, store: ObjectStore) -> None:
        for i in range(5):
            store.put(f"l/{i}", b"x")
        store.delete("l/2")
        store.put("l/3", b"y")
        assert _keys(store, "l") == ["l/0", "l/1", "l/3", "l/4"]

    def test_list_shows_no_temporary_objects(self, store: ObjectStore) -> None:
        keys = [f"t/{i}" for i in range(16)]
        _race(len(keys), lambda i: store.put(keys[i], os.urandom(1000), create_only=True))
        _race(len(keys), lambda i: store.put(keys[i], b"again", create_only=True))
        _race(len(keys), lambda i: store.put(keys[i], b"overwrite"))
        assert _keys(store) == sorted(keys)

    # -- key validation ------------------------------------------------------

    @pytest.mark.parametrize("key", UNSAFE_KEYS)
    def test_unsafe_keys_rejected(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(InvalidNameError):
            store.put(key, b"x")
        with pytest.raises(InvalidNameError):
            store.put(key, b"x", create_only=True)
        with pytest.raises(InvalidNameError):
            store.get(key)
        with pytest.raises(InvalidNameError):
            store.get_range(key, 0, 1)
        with pytest.raises(InvalidNameError):
            store.exists(key)
        with pytest.raises(InvalidNameError):
            store.delete(key)
        if key:  # "" is the whole store
            with pytest.raises(InvalidNameError):
                list(store.list(key))
        assert _keys(store) == []

    # -- a second handle -----------------------------------------------------

    def test_second_handle_sees_fresh_state(self, store: ObjectStore) -> None:
        other = self.reopen(store)
        assert _keys(other) == []  # list before writing, to prime any listing cache
        assert not other.exists("f/a")
        store.put("f/a", b"1")
        store.put("f/b/c", b"2")
        assert other.exists("f/a")
        assert _keys(other, "f") == ["f/a", "f/b/c"]
        assert other.get("f/a") == b"1"
        store.put("f/a", b"changed")
        assert other.get("f/a") == b"changed"
        store.delete("f/a")
        assert not other.exists("f/a")
        assert _keys(other, "f") == ["f/b/c"]
        with pytest.raises(ObjectExistsError):
            other.put("f/b/c", b"late", create_only=True)
        other.put("f/a", b"from other", create_only=True)
        assert store.get("f/a") == b"from other"

    # -- listing with details, temporaries, flush, unwrap --------------------

    def test_list_info_matches_list(self, store: ObjectStore) -> None:
        before = time.time()
        sizes = {"i/a": 0, "i/b/c": 3, "i/d": 1000}
        for key, size in sizes.items():
            store.put(key, os.urandom(size))
        store.put("other", b"x")
        infos = sorted(store.list_info("i"), key=lambda info: info.key)
        assert [info.key for info in infos] == _keys(store, "i") == sorted(sizes)
        for info in infos:
            assert isinstance(info, ObjectInfo)
            assert info.size is None or info.size == sizes[info.key]
            # Clocks of a remote store may be a little off ours; an hour is not.
            assert info.mtime is None or before - 3600 < info.mtime < time.time() + 3600
        store.put("i/b/c", b"longer now")
        (info,) = [i for i in store.list_info("i/b")]
        assert info.size is None or info.size == len(b"longer now")
        assert list(store.list_info("missing")) == []

    def test_no_temporaries_after_finished_puts(self, store: ObjectStore) -> None:
        store.put("t/a", b"1")
        store.put("t/b", b"2", create_only=True)
        store.put("t/a", b"3")
        with pytest.raises(ObjectExistsError):
            store.put("t/b", b"4", create_only=True)
        assert list(store.list_temporary()) == []
        assert list(store.list_temporary("t")) == []

    def test_delete_temporary_never_deletes_an_object(self, store: ObjectStore) -> None:
        store.put("t/obj", b"keep")
        try:
            assert store.delete_temporary("t/obj") is False
        except InvalidNameError:
            pass
        assert store.get("t/obj") == b"keep"

    def test_flush_after_puts_and_deletes(self, store: ObjectStore) -> None:
        store.put("f/a", b"1", durable=False)
        store.put("f/b", b"2", durable=False)
        store.delete("f/a")
        store.flush()
        assert _keys(store, "f") == ["f/b"]
        assert store.get("f/b") == b"2"

    def test_deferred_puts_land_by_the_next_flush(self, store: ObjectStore) -> None:
        owner = store.deferral()
        with store.deferring(owner):  # deferred where capabilities.deferred_sync
            store.put("d/obj", b"later", create_only=True, durable=False)
        store.flush()
        owner.check()
        assert store.get("d/obj") == b"later"

    def test_unwrap_and_capabilities(self, store: ObjectStore) -> None:
        base = store.unwrap()
        assert isinstance(base, ObjectStore)
        assert base.unwrap() is base
        assert isinstance(store.capabilities, Capabilities)
        assert store.capabilities == base.capabilities
        assert isinstance(store.capabilities.conditional_replace, bool)
        assert isinstance(store.capabilities.deferred_sync, bool)
