"""The forwarding base of the store wrappers: it forwards the whole contract, and a
wrapped store reads as the store below it does (a wrapped local store still maps)."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from casnap.errors import StoreError
from casnap.store import (
    CountingStore,
    FsspecStore,
    LocalStore,
    ObjectStore,
    PrefixStore,
    RetryingStore,
    RetryPolicy,
    WrapperStore,
)
from casnap.store.faults import FailingStore, FaultyStore

# Every public method of the contract, the ones with a default included.
CONTRACT = {
    name
    for name, _ in inspect.getmembers(ObjectStore, inspect.isfunction)
    if not name.startswith("_")
}
# What a wrapper does not forward, and why.
NOT_FORWARDED = {"child": "a view of the wrapper, so what the wrapper adds applies below it"}

# One call of each forwarded method, against a store holding "a/obj" = b"hello".
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "get": (("a/obj",), {"limit": 10}),
    "get_range": (("a/obj", 1, 3), {}),
    "put": (("a/new", b"x"), {"create_only": True, "durable": False}),
    "replace": (("a/obj", b"bye"), {"expected": b"hello"}),
    "read_into": (("a/obj", [memoryview(bytearray(3))]), {}),
    "map": (("a/obj", 4), {"private": True}),
    "flush": ((), {}),
    "deferral": ((), {}),
    "deferring": ((None,), {}),
    "exists": (("a/obj",), {}),
    "list": (("a",), {}),
    "delete": (("a/obj",), {}),
    "list_info": (("a",), {}),
    "list_temporary": (("a",), {}),
    "delete_temporary": (("a/obj.~tmp-1",), {}),
    "unwrap": ((), {}),
}


def test_every_method_of_the_contract_is_forwarded_by_the_base() -> None:
    # A method added to the contract fails here until the base forwards it.
    assert set(CALLS) == CONTRACT - set(NOT_FORWARDED)
    assert all(name in vars(WrapperStore) for name in CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_base_forwards_each_call_unchanged(tmp_path: Path, name: str) -> None:
    inner = LocalStore(str(tmp_path / "store"))
    inner.put("a/obj", b"hello")
    seen: list[tuple[str, tuple[Any, ...], dict[str, Any], object]] = []

    def recording(method: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            seen.append((name, args, kwargs, result))
            return result

        return call

    for method in CONTRACT:  # the real store, each call recorded on its way in
        setattr(inner, method, recording(getattr(inner, method), method))
    args, kwargs = CALLS[name]
    result = getattr(WrapperStore(inner), name)(*args, **kwargs)
    # The wrapper's call is the outermost, recorded last (a backend calls itself too).
    assert seen and seen[-1][:3] == (name, args, kwargs)
    assert result is seen[-1][3]


def test_a_prefix_view_translates_every_call_that_takes_a_key() -> None:
    keyed = {
        name
        for name in CONTRACT - set(NOT_FORWARDED)
        if {"key", "prefix"} & set(inspect.signature(getattr(ObjectStore, name)).parameters)
    }
    assert {"get", "put", "map", "list", "delete_temporary"} <= keyed
    assert all(name in vars(PrefixStore) for name in keyed)  # none forwarded untranslated


WRAPPERS: dict[str, Callable[[ObjectStore], ObjectStore]] = {
    "base": WrapperStore,
    "prefix view": lambda s: s.child("view"),
    "counting": CountingStore,
    "retrying": lambda s: RetryingStore(s, RetryPolicy(retries=1, delay=0.0)),
    "faulty": lambda s: FaultyStore(s, 0.0),
    "failing": lambda s: FailingStore(s, 1, op="map", prefixes=("nothing/",)),
}


@pytest.fixture
def memory() -> Iterator[FsspecStore]:
    store = FsspecStore(f"memory://casnap-test-{uuid.uuid4().hex}")
    yield store
    if store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=list(WRAPPERS))
def test_a_wrapped_store_keeps_its_capabilities_and_maps_as_it_does(
    tmp_path: Path, memory: FsspecStore, wrap: Callable[[ObjectStore], ObjectStore]
) -> None:
    local = LocalStore(str(tmp_path / "store"))
    assert local.capabilities != memory.capabilities  # the test tells them apart
    for inner in (local, memory):
        store = wrap(inner)
        assert store.capabilities == inner.capabilities
        assert store.unwrap() is inner
        store.put("k/obj", b"mapped or read")
        store.flush()
        mapped = store.map("k/obj", 100)
        if inner is local:  # mmap reads, as production makes them
            assert mapped is not None and bytes(mapped) == b"mapped or read"
        else:  # a remote store cannot map: the caller reads instead
            assert mapped is None
        assert store.get("k/obj") == b"mapped or read"


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=list(WRAPPERS))
def test_a_wrapped_store_defers_puts_as_the_store_below_it(
    tmp_path: Path, memory: FsspecStore, wrap: Callable[[ObjectStore], ObjectStore]
) -> None:
    for inner in (LocalStore(str(tmp_path / "store")), memory):
        store = wrap(inner)
        owner = store.deferral()
        with store.deferring(owner):
            store.put("c/obj", b"deferred", create_only=True, durable=False)
        # A deferred put's object appears once a flush has synced and renamed it.
        assert inner.capabilities.deferred_sync is (inner is not memory)
        assert store.exists("c/obj") is not inner.capabilities.deferred_sync
        store.flush()
        owner.check()
        assert store.get("c/obj") == b"deferred"


def test_a_counting_wrapper_counts_mapped_reads(tmp_path: Path) -> None:
    store = CountingStore(LocalStore(str(tmp_path / "store")))
    store.put("k", b"12345")
    assert bytes(store.map("k", 3) or b"") == b"123"
    assert store.mapped_keys == ["k"] and store.requests["get"] == 1 and store.bytes_read == 3


def test_a_failing_store_fails_the_nth_call_it_names(tmp_path: Path) -> None:
    local = LocalStore(str(tmp_path / "store"))
    store = FailingStore(local, 2, prefixes=("c/",))
    store.put("c/1", b"1")
    store.put("other", b"x")  # another prefix: not counted
    with pytest.raises(StoreError, match="injected failure of put 'c/2'") as info:
        store.put("c/2", b"2")
    assert not info.value.transient and not local.exists("c/2")  # failed before it landed
    store.put("c/3", b"3")  # only the n-th fails
    assert store.calls == 3 and sorted(local.list()) == ["c/1", "c/3", "other"]

    lost = FailingStore(local, 1, op="delete", prefixes=("c/",), after=True, lasting=True)
    for key in ("c/1", "c/3"):  # the first and every later one
        with pytest.raises(StoreError):
            lost.delete(key)
        assert not local.exists(key)  # it took effect; only its answer was lost
    lost.armed = False
    lost.delete("c/none")
    assert lost.calls == 2
