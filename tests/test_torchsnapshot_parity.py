"""torchsnapshot 0.1.0's restore, RNGState, StateDict and manifest behaviour, as a user meets it.

Each test follows one of torchsnapshot's own tests (tests/test_snapshot.py,
tests/test_rng_state.py, tests/test_ddp_replication_glob.py at tag 0.1.0) or
the behaviour of its ``Snapshot.restore``: the state dict handed to
``load_state_dict`` is the snapshot's, tensors load in place, and the
stateful's ``load_state_dict`` decides. casnap's own guarantees stay: what
casnap can validate fails before anything changes, and ``strict=True`` checks
keys first.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from casnap import RNGState, Snapshot, StateDict
from casnap.errors import (
    MissingKeyError,
    PickleNotAllowedError,
    ShapeMismatchError,
    UnexpectedKeyError,
)
from casnap.format.entries import ContainerEntry, ObjectEntry, PrimitiveEntry, TensorEntry


def snap_path(tmp_path: Path, name: str = "s1") -> str:
    return str(tmp_path / "repo" / name)


def linear(value: float, bias: bool = True) -> torch.nn.Linear:
    m = torch.nn.Linear(3, 2, bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


# -- StateDict ---------------------------------------------------------------------


def test_statedict_state_dict_is_a_plain_dict_and_round_trips(tmp_path: Path) -> None:
    def make() -> StateDict:
        return StateDict(
            {
                "a": torch.rand(40, 40),
                "b": torch.rand(40, 40),
                "c": 42,
                "d/e": 43,
                "[@x]->&y^%": {"(z)": 44},
            }
        )

    foo, bar = make(), make()
    assert type(foo.state_dict()) is dict
    assert foo.state_dict() == dict(foo) and foo.state_dict()["a"] is foo["a"]
    Snapshot.take(snap_path(tmp_path), {"foo": foo}).restore({"foo": bar})
    assert torch.equal(bar["a"], foo["a"]) and torch.equal(bar["b"], foo["b"])
    assert bar["c"] == 42 and bar["d/e"] == 43 and bar["[@x]->&y^%"] == {"(z)": 44}


# -- restore builds the snapshot's state dict --------------------------------------------


def test_none_placeholders_receive_the_stored_values(tmp_path: Path) -> None:
    state = StateDict(
        int_key=100,
        float_key=3.14,
        str_key="some_string",
        bool_key=True,
        bytes_key=b"\x00\x10",
        tensor_key=torch.arange(6.0).view(2, 3),
    )
    snap = Snapshot.take(snap_path(tmp_path), {"key": state})
    restored = StateDict(dict.fromkeys(state))  # every value None
    snap.restore({"key": restored})
    assert {k: v for k, v in restored.items() if k != "tensor_key"} == {
        k: v for k, v in state.items() if k != "tensor_key"
    }
    assert torch.equal(restored["tensor_key"], state["tensor_key"])


def test_keys_the_target_lacks_are_materialized(tmp_path: Path) -> None:
    class Holder:
        """torchsnapshot's test_different_state_dict_structure_on_load."""

        def __init__(self) -> None:
            self.objs: list[Any] = []

        def state_dict(self) -> dict[str, Any]:
            return {"objs": self.objs}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.objs = state_dict["objs"]

    src, dst = Holder(), Holder()
    src.objs = [torch.rand(8, 8) for _ in range(3)] + [[torch.rand(4) for _ in range(2)]]
    progress = StateDict(step=7, cfg={"lr": 0.1, "betas": [0.9, 0.99]})
    snap = Snapshot.take(snap_path(tmp_path), {"state": src, "progress": progress})

    target_progress = StateDict(step=0)  # no "cfg" at all
    snap.restore({"state": dst, "progress": target_progress})
    assert len(dst.objs) == 4 and all(torch.equal(a, b) for a, b in zip(dst.objs[:3], src.objs))
    assert all(torch.equal(a, b) for a, b in zip(dst.objs[3], src.objs[3], strict=True))
    assert target_progress == {"step": 7, "cfg": {"lr": 0.1, "betas": [0.9, 0.99]}}


def test_keys_only_the_target_has_are_left_to_load_state_dict(tmp_path: Path) -> None:
    snap = Snapshot.take(snap_path(tmp_path), {"s": StateDict(a=1)})
    target = StateDict(a=0, added_later=torch.ones(2))
    snap.restore({"s": target})  # StateDict.load_state_dict updates: the new key stays
    assert target["a"] == 1 and torch.equal(target["added_later"], torch.ones(2))


def test_in_place_restore_keeps_tensor_identity(tmp_path: Path) -> None:
    snap = Snapshot.take(
        snap_path(tmp_path), {"model": linear(1.0), "s": StateDict(t=torch.ones(5))}
    )
    model, t = linear(2.0), torch.zeros(5)
    weight, ptr = model.weight, model.weight.data_ptr()
    target = StateDict(t=t)
    snap.restore({"model": model, "s": target})
    assert model.weight is weight and model.weight.data_ptr() == ptr
    assert torch.equal(model.weight, torch.ones(2, 3))
    assert target["t"] is t and torch.equal(t, torch.ones(5))


def test_module_lacking_a_stored_key_gets_it_and_its_strictness_decides(tmp_path: Path) -> None:
    path = snap_path(tmp_path)
    Snapshot.take(path, {"model": linear(1.0)})

    # A stateful whose load_state_dict accepts what it does not know receives it.
    class Migrating(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 3))
            self.seen: dict[str, Any] = {}

        def load_state_dict(
            self, state_dict: Any, strict: bool = True, assign: bool = False
        ) -> Any:
            self.seen = dict(state_dict)
            return super().load_state_dict(state_dict, strict=False)

    migrating = Migrating()
    Snapshot(path).restore({"model": migrating})
    assert torch.equal(migrating.weight, torch.ones(2, 3))
    assert torch.equal(migrating.seen["bias"], torch.ones(2))  # materialized from the snapshot

    # A plain nn.Module's strict load_state_dict refuses the unexpected key, as in torchsnapshot.
    plain = linear(2.0, bias=False)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*bias") as info:
        Snapshot(path).restore({"model": plain})
    assert any("strict=True" in note for note in info.value.__notes__)
    assert torch.equal(plain.weight, torch.ones(2, 3))  # loaded in place before torch refused

    # strict=True is casnap's opt-in check: it refuses before anything changes.
    plain = linear(2.0, bias=False)
    with pytest.raises(UnexpectedKeyError, match="0/model/bias"):
        Snapshot(path).restore({"model": plain}, strict=True)
    assert torch.equal(plain.weight, torch.full((2, 3), 2.0))


def test_module_with_a_key_the_snapshot_lacks(tmp_path: Path) -> None:
    path = snap_path(tmp_path)
    Snapshot.take(path, {"model": linear(1.0, bias=False)})
    model = linear(2.0)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*bias"):
        Snapshot(path).restore({"model": model})
    with pytest.raises(MissingKeyError, match="0/model/bias"):
        Snapshot(path).restore({"model": linear(2.0)}, strict=True)


def test_a_load_state_dict_that_raises_leaves_what_the_note_says(tmp_path: Path) -> None:
    path = snap_path(tmp_path)
    Snapshot.take(
        path,
        {
            "a": StateDict(t=torch.ones(3), n=1),
            "model": linear(1.0, bias=False),
            "c": StateDict(t=torch.ones(3), n=1),
        },
    )
    a, c, model = StateDict(t=torch.zeros(3), n=0), StateDict(t=torch.zeros(3), n=0), linear(2.0)
    with pytest.raises(RuntimeError, match="Missing key") as info:
        Snapshot(path).restore({"a": a, "model": model, "c": c})
    note = " ".join(info.value.__notes__)
    assert "app_state['model'].load_state_dict() raised" in note and "'a' were loaded" in note
    assert a == {"t": a["t"], "n": 1} and torch.equal(a["t"], torch.ones(3))  # loaded
    assert c["n"] == 0 and torch.equal(c["t"], torch.ones(3))  # read in place, not loaded
    assert torch.equal(model.weight, torch.ones(2, 3))
    assert torch.equal(model.bias, torch.full((2,), 2.0))


def test_invalid_app_state_is_a_type_error_before_storage_is_touched(tmp_path: Path) -> None:
    # torchsnapshot's test_invalid_app_state: the take fails, so no snapshot exists,
    # and a restore through Snapshot(path) still raises TypeError, not "not found".
    path = snap_path(tmp_path)
    app_state: dict[str, Any] = {"optim": 1}
    with pytest.raises(TypeError, match="'optim'"):
        Snapshot.take(path=path, app_state=app_state)
    snapshot = Snapshot(path=path)
    with pytest.raises(TypeError, match="'optim'.*state_dict"):
        snapshot.restore(app_state=app_state)
    assert not (tmp_path / "repo").exists()  # neither call created anything
    # Where the snapshot exists, the same value is refused before anything is read or changed.
    model = linear(2.0)
    Snapshot.take(path, {"model": linear(1.0), "optim": StateDict(lr=0.1)})
    with pytest.raises(TypeError, match="'optim'"):
        Snapshot(path).restore({"model": model, "optim": 1})
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))


def test_app_state_key_absent_from_the_snapshot_is_refused_first(tmp_path: Path) -> None:
    path = snap_path(tmp_path)
    Snapshot.take(path, {"model": linear(1.0)})
    model = linear(2.0)
    with pytest.raises(MissingKeyError, match="'progress'"):
        Snapshot(path).restore({"model": model, "progress": StateDict(step=5)})
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))


def test_validation_failure_still_modifies_nothing(tmp_path: Path) -> None:
    path = snap_path(tmp_path)
    Snapshot.take(path, {"s": StateDict(t=torch.ones(4), n=1, extra=7), "m": linear(1.0)})
    s = StateDict(t=torch.zeros(4), n=0)
    bad = linear(2.0)
    bad.weight = torch.nn.Parameter(torch.zeros(3, 3))  # the stored weight is 2x3
    with pytest.raises(ShapeMismatchError, match="0/m/weight"):
        Snapshot(path).restore({"s": s, "m": bad})
    assert s == {"t": s["t"], "n": 0} and torch.equal(s["t"], torch.zeros(4))
    assert torch.equal(bad.bias, torch.full((2,), 2.0))

    pickled = snap_path(tmp_path, "pickled")
    Snapshot.take(
        pickled, {"s": StateDict(t=torch.ones(4), obj=complex_holder())}, allow_pickle=True
    )
    s = StateDict(t=torch.zeros(4))
    with pytest.raises(PickleNotAllowedError, match="0/s/obj"):
        Snapshot(pickled).restore({"s": s})  # obj is materialized only with allow_pickle
    assert s == {"t": s["t"]} and torch.equal(s["t"], torch.zeros(4))
    Snapshot(pickled).restore({"s": s}, allow_pickle=True)
    assert s["obj"] == complex_holder()


class _Holder:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Holder) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def complex_holder() -> _Holder:
    return _Holder(3)


# -- RNGState ---------------------------------------------------------------------------


class DrawsRandomNumbers:
    """torchsnapshot's StatefulWithRNGSideEffect, drawing from torch and Python's random."""

    def state_dict(self) -> dict[str, Any]:
        torch.rand([2])
        random.random()
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.rand([3])
        random.random()


@pytest.mark.parametrize("rng_first", [True, False], ids=["rng-first", "rng-last"])
def test_rng_state_is_not_shifted_by_other_statefuls(tmp_path: Path, rng_first: bool) -> None:
    items = [("rng", RNGState()), ("effectful", DrawsRandomNumbers())]
    app_state = dict(items if rng_first else items[::-1])
    app_state["also_effectful"] = DrawsRandomNumbers()
    torch.manual_seed(0)
    random.seed(0)
    snapshot = Snapshot.take(snap_path(tmp_path), app_state)
    after_take = (torch.rand(1), random.random())
    torch.manual_seed(1)
    random.seed(1)
    snapshot.restore(app_state)
    after_restore = (torch.rand(1), random.random())
    assert torch.equal(after_take[0], after_restore[0]) and after_take[1] == after_restore[1]


def test_take_leaves_the_rng_where_it_was(tmp_path: Path) -> None:
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    Snapshot.take(snap_path(tmp_path), {"e": DrawsRandomNumbers(), "rng": RNGState()})
    assert torch.equal(torch.rand(4), expected)


# -- get_manifest and metadata -----------------------------------------------------------


def test_get_manifest_entries_carry_torchsnapshot_fields(tmp_path: Path) -> None:
    state = StateDict(w=torch.ones(2, 3), n=1, f=3.14, cfg={"a": [1]}, obj=complex_holder())
    snap = Snapshot.take(snap_path(tmp_path), {"s": state}, allow_pickle=True)
    manifest = snap.get_manifest()
    assert all(getattr(e, "replicated", None) is False for e in manifest.values())
    w = manifest["0/s/w"]
    assert isinstance(w, TensorEntry) and w.type == "Tensor"
    assert w.dtype == "float32" and w.shape == [2, 3]
    f = manifest["0/s/f"]
    assert isinstance(f, PrimitiveEntry) and f.type == "float" and f.readable == str(3.14)
    n = manifest["0/s/n"]
    assert isinstance(n, PrimitiveEntry) and n.type == "int" and n.readable is None
    assert isinstance(manifest["0/s/cfg"], ContainerEntry) and manifest["0/s/cfg"].type == "dict"
    obj = manifest["0/s/obj"]
    assert isinstance(obj, ObjectEntry) and obj.type == "object" and obj.serializer == "pickle"
    assert obj.obj_type.endswith("_Holder")
    # Properties, not stored: the manifest a take writes is unchanged.
    assert "replicated" not in manifest["0/s/n"].model_dump()


def test_snapshot_metadata_is_the_user_dict_with_torchsnapshot_fields(tmp_path: Path) -> None:
    state = StateDict(int_key=100, float_key=3.14)
    snap = Snapshot.take(snap_path(tmp_path), {"key": state}, metadata={"step": 100})
    for meta in (snap.metadata, Snapshot(snap_path(tmp_path)).metadata):
        assert meta == {"step": 100} and meta["step"] == 100
        assert meta.world_size == 1 and meta.version == snap.manifest.format_version
        entry = meta.manifest["0/key/float_key"]
        assert isinstance(entry, PrimitiveEntry) and entry.type == "float"
        assert entry.readable == str(state["float_key"])
        assert meta.manifest == snap.get_manifest()
