"""Quantized tensors and ``_custom_tensor_prepare_func``, as a torchsnapshot user meets them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tensor_entry

from casnap import Snapshot, StateDict
from casnap.errors import ShapeMismatchError
from casnap.format.parse import parse_manifest

# torch deprecates creating quantized tensors; the tensors still exist and must be stored.
pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")

QDTYPES = [torch.qint8, torch.quint8, torch.qint32]


def _per_tensor(dtype: torch.dtype, seed: int = 0, scale: float = 0.1, zp: int = 10) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.quantize_per_tensor(torch.rand(8, 5, generator=g), scale, zp, dtype)


def _per_channel(dtype: torch.dtype, seed: int = 0, axis: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(8, 5, generator=g)
    n = x.shape[axis]
    scales = torch.rand(n, generator=g, dtype=torch.float64) / 10 + 1e-3  # not round numbers
    zero_points = torch.arange(n) % 7
    return torch.quantize_per_channel(x, scales, zero_points, axis, dtype)


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, qscheme, integers and quantization parameters, bit for bit."""
    assert got.is_quantized and got.dtype == want.dtype and got.qscheme() == want.qscheme()
    assert torch.equal(got.int_repr(), want.int_repr())
    if want.qscheme() == torch.per_tensor_affine:
        assert got.q_scale() == want.q_scale() and got.q_zero_point() == want.q_zero_point()
    else:
        assert got.q_per_channel_axis() == want.q_per_channel_axis()
        assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())
        assert torch.equal(got.q_per_channel_zero_points(), want.q_per_channel_zero_points())


def _manifest_json(repo: Path) -> dict[str, Any]:
    (path,) = (repo / ".casnap" / "manifests").glob("*/*")
    return json.loads(path.read_bytes())


CASES = [(f"{dt}".split(".")[1], lambda dt=dt: _per_tensor(dt)) for dt in QDTYPES] + [
    ("per_channel_qint8_axis1", lambda: _per_channel(torch.qint8, axis=1)),
    ("per_channel_quint8_axis0", lambda: _per_channel(torch.quint8, axis=0)),
]


@pytest.mark.parametrize(("name", "make"), CASES, ids=[c[0] for c in CASES])
def test_round_trip_in_place_fresh_and_read_object(tmp_path: Path, name: str, make: Any) -> None:
    value = make()
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value)})
    snap = Snapshot(str(tmp_path / "repo" / "s1"))
    # read_object: a fresh quantized tensor, identical.
    assert_identical(snap.read_object("0/m/q"), value)
    # restore into a quantized target of the same kind (other values and parameters): in place.
    other = (
        _per_tensor(value.dtype, seed=9, scale=1.0, zp=0)
        if value.qscheme() == torch.per_tensor_affine
        else _per_channel(value.dtype, seed=9, axis=value.q_per_channel_axis())
    )
    assert not torch.equal(other.int_repr(), value.int_repr())
    target = StateDict(q=other)
    snap.restore({"m": target})
    assert target["q"] is other  # filled in place, parameters included
    assert_identical(other, value)
    # restore where the state dict holds something else of that shape: replaced.
    fresh = StateDict(q=torch.quantize_per_tensor(torch.rand(8, 5), 1.0, 0, torch.qint32))
    if value.dtype == torch.qint32 and value.qscheme() == torch.per_tensor_affine:
        fresh = StateDict(q=_per_channel(torch.qint8))
    snap.restore({"m": fresh})
    assert_identical(fresh["q"], value)


def test_the_manifest_records_the_quantization(tmp_path: Path) -> None:
    value = _per_channel(torch.qint8, axis=1)
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value, f=torch.ones(3))})
    entry = tensor_entry(snap.get_manifest(), "0/m/q")
    assert entry.dtype == "int8" and entry.quantized is not None
    assert entry.quantized.dtype == "qint8" and entry.quantized.qscheme == "per_channel_affine"
    assert entry.quantized.axis == 1 and len(entry.quantized.scales or ()) == 5
    raw = _manifest_json(tmp_path / "repo")
    assert raw["format_version"] == "1.0"  # one format, with quantized entries or without
    assert "quantized" not in raw["entries"]["0/m/f"]  # other tensors' JSON is unchanged


def test_a_float_target_receives_the_dequantized_values(tmp_path: Path) -> None:
    value = _per_tensor(torch.quint8)
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value)})
    out = torch.zeros(8, 5)
    assert snap.read_object("0/m/q", obj_out=out) is out
    assert torch.equal(out, value.dequantize())  # as torchsnapshot's tensor_copy does


def test_a_target_that_cannot_hold_it_is_refused_before_anything_changes(tmp_path: Path) -> None:
    value = _per_tensor(torch.qint8)
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value, w=torch.ones(2))})
    w = torch.zeros(2)
    for bad in (torch.zeros(8, 5, dtype=torch.int64), _per_tensor(torch.qint8)[:4]):
        with pytest.raises(ShapeMismatchError, match="0/m/q"):
            snap.restore({"m": StateDict(q=bad, w=w)})
        assert torch.equal(w, torch.zeros(2))


def test_unchanged_quantized_tensors_are_deduplicated(tmp_path: Path) -> None:
    value = torch.quantize_per_tensor(torch.rand(256, 256), 0.01, 3, torch.qint8)
    first = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value)})
    second = Snapshot.take(str(tmp_path / "repo" / "s2"), {"m": StateDict(q=value)})
    assert first.last_take_stats.raw_bytes_written >= 256 * 256  # type: ignore[union-attr]
    assert second.last_take_stats.raw_bytes_written == 0  # type: ignore[union-attr]


def test_an_async_take_of_a_quantized_tensor_is_point_in_time(tmp_path: Path) -> None:
    value = _per_tensor(torch.qint8)
    want = value.clone()
    pending = Snapshot.async_take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=value)})
    value.copy_(torch.quantize_per_tensor(torch.zeros(8, 5), 0.5, 1, torch.qint8))
    assert_identical(pending.wait().read_object("0/m/q"), want)


# -- _custom_tensor_prepare_func -------------------------------------------------------------


def test_prepare_func_half_precision_is_what_is_stored(tmp_path: Path) -> None:
    seen: list[tuple[str, torch.Size, bool]] = []

    def to_half(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        seen.append((path, tensor.shape, tracing))
        return tensor.half()

    w = torch.randn(4, 3)
    state = {"model": StateDict(w=w, n=3)}
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), state, _custom_tensor_prepare_func=to_half)
    # The path is torchsnapshot's logical path (no rank); tracing=False yields the bytes.
    assert seen == [("model/w", torch.Size([4, 3]), False)]
    assert tensor_entry(snap.get_manifest(), "0/model/w").dtype == "float16"
    assert torch.equal(snap.read_object("0/model/w"), w.half())
    assert w.dtype == torch.float32  # the live tensor is untouched
    target = StateDict(w=torch.zeros(4, 3, dtype=torch.float16), n=0)
    snap.restore({"model": target})
    assert torch.equal(target["w"], w.half()) and target["n"] == 3


def test_prepare_func_quantizing_restores_quantized(tmp_path: Path) -> None:
    # torchsnapshot's own example (tests/test_read_object.py, test_tensor_io_preparer.py).
    def quantize(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        return torch.quantize_per_tensor(tensor, 0.1, 10, torch.qint8)

    w = torch.rand(20, 16)
    snap = Snapshot.take(
        str(tmp_path / "repo" / "s1"), {"s": StateDict(w=w)}, _custom_tensor_prepare_func=quantize
    )
    assert snap.get_manifest()["0/s/w"].quantized.dtype == "qint8"  # type: ignore[union-attr]
    assert_identical(snap.read_object("0/s/w"), quantize("s/w", w, False))
    bar = torch.quantize_per_tensor(torch.rand(20, 16), 0.1, 10, torch.qint8)
    snap.read_object("0/s/w", obj_out=bar)
    assert torch.allclose(bar.dequantize(), quantize("s/w", w, False).dequantize())


def test_prepare_func_must_keep_the_shape(tmp_path: Path) -> None:
    def view(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        return tensor[:1]

    with pytest.raises(ShapeMismatchError, match="must not change the shape"):
        Snapshot.take(
            str(tmp_path / "repo" / "s1"),
            {"s": StateDict(w=torch.rand(3, 2))},
            _custom_tensor_prepare_func=view,
        )
    assert not (tmp_path / "repo" / ".casnap" / "refs" / "s1").exists()


def test_a_stored_quantized_manifest_parses_and_validates(tmp_path: Path) -> None:
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(q=_per_channel(torch.qint8))})
    (path,) = (tmp_path / "repo" / ".casnap" / "manifests").glob("*/*")
    data = path.read_bytes()
    manifest = parse_manifest(data, path.name)
    assert manifest.entries["0/m/q"].quantized is not None  # type: ignore[union-attr]
    # A record whose per-channel parameters do not match the shape is refused.
    broken = json.loads(data)
    broken["entries"]["0/m/q"]["quantized"]["scales"] = ["0x1p-3"]
    broken["entries"]["0/m/q"]["quantized"]["zero_points"] = [0]
    from casnap.errors import ManifestValidationError
    from casnap.format.json_text import canonical_json
    from casnap.format.names import hash_bytes

    body = canonical_json(broken)
    with pytest.raises(ManifestValidationError, match="per-channel"):
        parse_manifest(body, hash_bytes(body))


def test_quantized_shard_records_are_checked_with_the_manifest() -> None:
    from casnap.format.entries import Quantization, ShardedEntry

    q = {"dtype": "qint8", "qscheme": "per_tensor_affine", "scale": "0x1.0p-3", "zero_point": 0}
    shard = {"chunk_size": 4, "chunks": [], "sizes": [0, 2]}

    def entry(*quantized: dict | None, dtype: str = "int8") -> ShardedEntry:
        shards = [
            {**shard, "offsets": [0, 2 * i], **({"quantized": x} if x else {})}
            for i, x in enumerate(quantized)
        ]
        return ShardedEntry.model_validate(
            {"layout": "dtensor", "dtype": dtype, "shape": [0, 4], "shards": shards}
        )

    assert entry(q, {**q, "scale": "0x1.0p-2"}).quantized_shards  # each shard its own parameters
    assert entry(q, q).shards[0].quantized == Quantization.model_validate(q)
    assert not entry(None, None).quantized_shards
    assert "quantized" not in entry(None).model_dump(mode="json")["shards"][0]  # left out
    for bad, why in (
        (lambda: entry(q, None), "mix"),
        (lambda: entry(q, {**q, "dtype": "quint8"}), "mix"),
        (lambda: entry(q, dtype="uint8"), "stored as int8"),
    ):
        with pytest.raises(ValueError, match=why):
            bad()
