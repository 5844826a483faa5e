"""Failed takes and restores raise clear errors and change nothing.

Each test checks the exception type (casnap's and the builtin it stands for), that the
message names the offending key, and that the restore target is bit-for-bit what it
was before the failed call.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from casnap import Repository, Snapshot, StateDict
from casnap.errors import (
    CasnapError,
    MissingKeyError,
    PickleNotAllowedError,
    ShapeMismatchError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    UnexpectedKeyError,
    UnsupportedValueError,
)
from casnap.repo.repository import RepoStorage


class Opaque:
    """Neither a tensor, a primitive nor a container: storable only by pickling."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


class ExplodingState:
    """A stateful whose state_dict() fails, as a buggy user object would."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("never restored")


class WithExtra(torch.nn.Module):
    """A Linear(3, 2) plus a parameter that older snapshots do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2, 3), 5.0))
        self.bias = torch.nn.Parameter(torch.full((2,), 6.0))
        self.extra = torch.nn.Parameter(torch.full((4,), 7.0))


# -- helpers ----------------------------------------------------------------


def tensors_of(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``value`` (state dicts, containers), by path."""
    if hasattr(value, "state_dict") and not isinstance(value, dict):
        value = value.state_dict()
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out


def fingerprint(app_state: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Identity, layout and raw bytes of every tensor in ``app_state`` (plus non-tensors' repr)."""
    prints: dict[str, tuple[Any, ...]] = {}
    for key, stateful in app_state.items():
        for path, t in tensors_of(stateful, key).items():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
            prints[path] = (t.data_ptr(), t.dtype, tuple(t.shape), raw)
        if isinstance(stateful, dict):
            prints[f"{key}:repr"] = (
                repr({k: v for k, v in stateful.items() if not isinstance(v, torch.Tensor)}),
            )
    return prints


def assert_unchanged(app_state: dict[str, Any], before: dict[str, tuple[Any, ...]]) -> None:
    after = fingerprint(app_state)
    assert after.keys() == before.keys()
    for path, old in before.items():
        new = after[path]
        assert len(new) == len(old), path
        for a, b in zip(new, old, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{path} changed"
            else:
                assert a == b, f"{path} changed"


def linear(fill: float, bias: bool = True) -> torch.nn.Linear:
    m = torch.nn.Linear(3, 2, bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


# -- missing and existing snapshots ---------------------------------------------


def test_snapshot_path_that_does_not_exist(tmp_path: Any) -> None:
    target = {"model": linear(1.0)}
    before = fingerprint(target)
    missing = f"{tmp_path}/nowhere/snap1"
    with pytest.raises(SnapshotNotFoundError, match="nowhere/snap1") as info:
        Snapshot(missing).restore(target)
    assert isinstance(info.value, FileNotFoundError)
    assert_unchanged(target, before)
    with pytest.raises(FileNotFoundError):
        Snapshot(missing).get_manifest()
    with pytest.raises(FileNotFoundError):
        Snapshot(missing).read_object("0/model/weight")


def test_snapshot_name_missing_from_existing_repository(tmp_path: Any) -> None:
    Snapshot.take(f"{tmp_path}/repo/snap1", {"model": linear(1.0)})
    target = {"model": linear(2.0)}
    before = fingerprint(target)
    with pytest.raises(SnapshotNotFoundError, match="snap2") as info:
        Snapshot(f"{tmp_path}/repo/snap2").restore(target)
    assert isinstance(info.value, FileNotFoundError)
    assert_unchanged(target, before)


def test_taking_twice_to_the_same_path(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": linear(1.0)})
    for take in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(SnapshotExistsError, match="snap1") as info:
            take(path, {"model": linear(2.0)})
        assert isinstance(info.value, FileExistsError)
    assert Repository(f"{tmp_path}/repo").snapshots() == ["snap1"]

    target = linear(3.0)
    Snapshot(path).restore({"model": target})
    assert torch.equal(target.weight, torch.full((2, 3), 1.0))
    assert torch.equal(target.bias, torch.full((2,), 1.0))


def test_read_object_of_a_missing_key(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": linear(1.0)})
    with pytest.raises(MissingKeyError, match="0/model/nope") as info:
        Snapshot(path).read_object("0/model/nope")
    assert isinstance(info.value, KeyError)
    # A path without the rank prefix gets a hint at the right one.
    with pytest.raises(MissingKeyError, match="did you mean '0/model/weight'"):
        Snapshot(path).read_object("model/weight")


# -- shapes and dtypes ------------------------------------------------------------


def test_shape_mismatch_names_the_key_and_changes_nothing(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"a": StateDict(x=torch.ones(3)), "model": torch.nn.Linear(3, 2)})

    # "a" matches and comes first: a restore that wrote as it went would change it.
    target = {"a": StateDict(x=torch.zeros(3)), "model": torch.nn.Linear(3, 4)}
    before = fingerprint(target)
    with pytest.raises(ShapeMismatchError, match=r"0/model/weight") as info:
        Snapshot(path).restore(target)
    assert isinstance(info.value, ValueError)
    assert "[2, 3]" in str(info.value) and "[4, 3]" in str(info.value)
    assert info.value.key == "0/model/weight"
    assert_unchanged(target, before)

    with pytest.raises(ShapeMismatchError, match="0/model/weight"):
        Snapshot(path).read_object("0/model/weight", obj_out=torch.zeros(3, 2))


def test_dtype_mismatch_names_the_key_and_changes_nothing(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": StateDict(ok=torch.ones(2), x=torch.ones(4, dtype=torch.float32))})
    target = {"s": StateDict(ok=torch.zeros(2), x=torch.zeros(4, dtype=torch.float64))}
    before = fingerprint(target)
    with pytest.raises(ShapeMismatchError, match="0/s/x") as info:
        Snapshot(path).restore(target)
    assert "float32" in str(info.value) and "float64" in str(info.value)
    assert_unchanged(target, before)


# -- strictness ---------------------------------------------------------------------


def test_app_state_key_absent_from_snapshot(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": linear(1.0)})
    target = {"model": linear(2.0), "progress": StateDict(step=5)}
    before = fingerprint(target)
    for strict in (False, True):  # torchsnapshot refuses it too: restore a subset of app_state
        with pytest.raises(MissingKeyError, match="'progress'") as info:
            Snapshot(path).restore(target, strict=strict)
        assert isinstance(info.value, KeyError)
        assert_unchanged(target, before)


def test_model_with_extra_parameter(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": linear(1.0)})
    model = WithExtra()
    target = {"model": model}
    before = fingerprint(target)
    with pytest.raises(MissingKeyError, match="0/model/extra") as info:
        Snapshot(path).restore(target, strict=True)
    assert isinstance(info.value, KeyError)
    assert "weight" not in str(info.value)
    assert_unchanged(target, before)

    # Without strict=True the module's own load_state_dict decides (torchsnapshot's
    # behaviour): it refuses the missing key after the reads filled its tensors in place.
    with pytest.raises(RuntimeError, match="extra"):
        Snapshot(path).restore(target)
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))
    assert torch.equal(model.bias, torch.full((2,), 1.0))
    assert torch.equal(model.extra, torch.full((4,), 7.0))  # kept its value


def test_model_lacking_a_parameter_the_snapshot_holds(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": linear(1.0)})
    model = linear(2.0, bias=False)
    target = {"model": model}
    before = fingerprint(target)
    with pytest.raises(UnexpectedKeyError, match="0/model/bias") as info:
        Snapshot(path).restore(target, strict=True)
    assert isinstance(info.value, KeyError)
    assert_unchanged(target, before)

    with pytest.raises(RuntimeError, match="bias"):  # nn.Module's own strictness
        Snapshot(path).restore(target)
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))
    assert model.bias is None


def test_nested_container_mismatch_is_reported_under_strict(tmp_path: Any) -> None:
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": StateDict(t=torch.ones(2), cfg={"a": 1, "b": [1, 2, 3]})})
    target = {"s": StateDict(t=torch.zeros(2), cfg={"a": 0, "b": [0, 0]})}
    before = fingerprint(target)
    with pytest.raises(UnexpectedKeyError, match="0/s/cfg/b/2"):
        Snapshot(path).restore(target, strict=True)
    assert_unchanged(target, before)
    Snapshot(path).restore(target)  # the snapshot's structure replaces the target's
    assert target["s"]["cfg"] == {"a": 1, "b": [1, 2, 3]}


# -- pickled objects ------------------------------------------------------------------


def test_arbitrary_object_needs_allow_pickle(tmp_path: Any) -> None:
    repo = f"{tmp_path}/repo"
    state = StateDict(w=torch.arange(4.0), obj=Opaque(3))
    with pytest.raises(PickleNotAllowedError, match="0/s/obj") as info:
        Snapshot.take(f"{repo}/refused", {"s": state})
    assert isinstance(info.value, TypeError) and not isinstance(info.value, OSError)
    assert "Opaque" in str(info.value) and "allow_pickle" in str(info.value)
    assert not RepoStorage.exists_at(repo)  # refused before anything was created

    path = f"{repo}/allowed"
    Snapshot.take(path, {"s": state}, allow_pickle=True)
    assert Repository(repo).snapshots() == ["allowed"]

    target = {"s": StateDict(w=torch.zeros(4), obj=Opaque(0))}
    before = fingerprint(target)
    with pytest.raises(PickleNotAllowedError, match="0/s/obj") as info:
        Snapshot(path).restore(target)
    assert "allow_pickle" in str(info.value)
    assert_unchanged(target, before)
    assert target["s"]["obj"] == Opaque(0)
    with pytest.raises(PickleNotAllowedError, match="0/s/obj"):
        Snapshot(path).read_object("0/s/obj")

    Snapshot(path).restore(target, allow_pickle=True)
    assert type(target["s"]["obj"]) is Opaque
    assert target["s"]["obj"] == Opaque(3)
    assert torch.equal(target["s"]["w"], torch.arange(4.0))
    assert Snapshot(path).read_object("0/s/obj", allow_pickle=True) == Opaque(3)


# -- values that are not stateful ------------------------------------------------------


@pytest.mark.parametrize(
    "value", [5, {"plain": "dict"}, torch.ones(2)], ids=["int", "dict", "tensor"]
)
def test_non_stateful_value_in_app_state(tmp_path: Any, value: Any) -> None:
    repo = f"{tmp_path}/repo"
    with pytest.raises(UnsupportedValueError, match="'bad'") as info:
        Snapshot.take(f"{repo}/snap1", {"good": StateDict(x=1), "bad": value})
    assert isinstance(info.value, TypeError)
    assert "StateDict" in str(info.value)  # says how to fix it
    assert not RepoStorage.exists_at(repo)  # refused before anything was created

    Snapshot.take(f"{repo}/snap2", {"good": StateDict(x=1), "bad": StateDict(y=2)})
    good = StateDict(x=0)
    with pytest.raises(UnsupportedValueError, match="'bad'"):
        Snapshot(f"{repo}/snap2").restore({"good": good, "bad": value})
    assert good == {"x": 0}


# -- failed takes leave no ref ---------------------------------------------------------------


def _disk_full(self: Repository, manifest: Any, jsonable: Any = None) -> str:
    raise OSError(28, "disk full")


def test_failed_take_leaves_no_ref_and_earlier_snapshots_restore(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = f"{tmp_path}/repo"
    model = linear(1.0)
    Snapshot.take(f"{repo}/good", {"model": model})
    with torch.no_grad():
        model.weight.fill_(9.0)

    with pytest.raises(RuntimeError, match="state_dict exploded"):
        Snapshot.take(f"{repo}/exploded", {"model": model, "boom": ExplodingState()})
    with pytest.raises(PickleNotAllowedError):
        Snapshot.take(f"{repo}/pickle", {"model": model, "s": StateDict(o=Opaque(1))})
    # Refused before anything is written, for take and async_take alike.
    sparse = torch.zeros(8).to_sparse()  # (quantized tensors are stored: test_quantized.py)
    for take in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(UnsupportedValueError, match="0/q/t"):
            take(f"{repo}/quantized", {"model": model, "q": StateDict(t=sparse)})
    # Fails after the chunks are written, before the commit point (the ref).
    monkeypatch.setattr(RepoStorage, "write_manifest", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        Snapshot.take(f"{repo}/late", {"model": model})
    pending = Snapshot.async_take(f"{repo}/async", {"model": model})
    with pytest.raises(OSError, match="disk full"):
        pending.wait(timeout=60)
    assert pending.done()
    monkeypatch.undo()

    assert Repository(repo).snapshots() == ["good"]
    for name in ("exploded", "pickle", "quantized", "late", "async"):
        with pytest.raises(SnapshotNotFoundError, match=name):
            Snapshot(f"{repo}/{name}").restore({"model": linear(0.0)})

    target = linear(0.0)
    Snapshot(f"{repo}/good").restore({"model": target})
    assert torch.equal(target.weight, torch.full((2, 3), 1.0))

    # A failed take does not burn its name.
    Snapshot.take(f"{repo}/exploded", {"model": model})
    assert Repository(repo).snapshots() == ["exploded", "good"]


def test_errors_share_one_root(tmp_path: Any) -> None:
    with pytest.raises(CasnapError):
        Snapshot(f"{tmp_path}/none/snap").restore({})
    Snapshot.take(f"{tmp_path}/repo/s", {"s": StateDict(x=torch.ones(2))})
    for target in ({"s": StateDict(x=torch.ones(3))}, {"t": StateDict()}, {"s": 1}):
        with pytest.raises(CasnapError), warnings.catch_warnings():
            warnings.simplefilter("error")
            Snapshot(f"{tmp_path}/repo/s").restore(target)
