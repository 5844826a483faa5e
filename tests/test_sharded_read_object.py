"""read_object of a sharded entry into a plain tensor, and prepare funcs on shards (``-m dist``).

torchsnapshot 0.1.0 (tests/test_read_object.py) reads a ShardedTensor's entry
into one plain tensor on one rank, after a take whose
``_custom_tensor_prepare_func`` converted every shard; with ``quantized=True``
the shards are stored quantized and read back into a quantized tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

from casnap.format.entries import ShardedEntry

pytestmark = pytest.mark.dist

SHAPE = (40, 12)


def _full() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))


def _sharded(world: int) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = empty(spec, *SHAPE)
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(_full()[o[0] : o[0] + s[0], o[1] : o[1] + s[1]])
    dt = distribute_tensor(_full(), init_device_mesh("cpu", (world,)), [Shard(1)])
    return {"st": st, "dt": dt}


def read_into_plain(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.errors import ShapeMismatchError

    snap = Snapshot.take(f"{root}/s1", {"state": StateDict(_sharded(world))})
    for key in ("st", "dt"):
        out = torch.zeros(SHAPE)
        got = snap.read_object(f"0/state/{key}", obj_out=out)
        assert got is out and torch.equal(out, _full()), key  # filled in place
        assert torch.equal(snap.read_object(f"{rank}/state/{key}"), _full()), key
    # A plain target of another dtype or shape is refused, untouched.
    for bad in (torch.zeros(SHAPE, dtype=torch.float64), torch.zeros(SHAPE[0], SHAPE[1] + 1)):
        with pytest.raises(ShapeMismatchError, match="state/st"):
            snap.read_object("0/state/st", obj_out=bad)
        assert not bad.any()

    def to_half(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        assert path in ("state/st", "state/dt"), path
        return tensor.half()

    half = Snapshot.take(
        f"{root}/s2", {"state": StateDict(_sharded(world))}, _custom_tensor_prepare_func=to_half
    )
    entry = half.get_manifest()[f"{rank}/state/st"]
    assert isinstance(entry, ShardedEntry) and entry.dtype == "float16"
    out16 = torch.zeros(SHAPE, dtype=torch.float16)
    half.read_object("0/state/st", obj_out=out16)
    assert torch.equal(out16, _full().half())
    assert torch.equal(half.read_object("0/state/dt"), _full().half())
    return {}


def _quantize(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
    return torch.quantize_per_tensor(tensor, 0.1, 10, torch.qint8)  # torchsnapshot's


def _quantize_per_shard(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
    return torch.quantize_per_tensor(tensor, float(tensor.abs().max()) / 100, 0, torch.qint8)


def read_quantized_shards(rank: int, world: int, root: str) -> dict[str, Any]:
    """torchsnapshot's test_read_sharded_tensor_into_tensor(quantized=True), and more."""
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from casnap import Snapshot, StateDict
    from casnap.errors import ShapeMismatchError

    snap = Snapshot.take(
        f"{root}/q", {"state": StateDict(_sharded(world))}, _custom_tensor_prepare_func=_quantize
    )
    want = torch.quantize_per_tensor(_full(), 0.1, 10, torch.qint8)
    out: dict[str, Any] = {"version": snap.manifest.format_version}
    if rank == 0:  # the rank that reads needs no group: read_object is not collective
        for key in ("st", "dt"):
            bar = torch.quantize_per_tensor(torch.rand(SHAPE), 0.1, 10, torch.qint8)
            got = snap.read_object(f"0/state/{key}", obj_out=bar)
            assert got is bar and torch.equal(bar.int_repr(), want.int_repr()), key
            assert torch.allclose(torch.dequantize(bar), torch.dequantize(want)), key
            plain = torch.zeros(SHAPE)  # a float target receives the dequantized values
            assert snap.read_object(f"0/state/{key}", obj_out=plain) is plain
            assert torch.equal(plain, want.dequantize()), key
            fresh = snap.read_object(f"0/state/{key}")  # the quantized tensor itself
            assert fresh.is_quantized and torch.equal(fresh.int_repr(), want.int_repr()), key
            assert (fresh.q_scale(), fresh.q_zero_point()) == (0.1, 10), key
        wrong = torch.zeros(SHAPE, dtype=torch.int32)
        with pytest.raises(ShapeMismatchError, match="state/st"):
            snap.read_object("0/state/st", obj_out=wrong)
        assert not wrong.any()
    # Restoring into the float sharded state it was taken from: each rank's boxes
    # receive the dequantized values.
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    target = StateDict(st=empty(spec, *SHAPE), dt=_sharded(world)["dt"] * 0)
    Snapshot(f"{root}/q").restore({"state": target})
    for shard in target["st"].local_shards():
        o, n = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        assert torch.equal(shard.tensor, want.dequantize()[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    assert torch.equal(target["dt"].full_tensor(), want.dequantize())
    # Each shard quantized with its own scale: a float target assembles them; no single
    # quantized tensor can, and reading without one says what to pass instead.
    per = Snapshot.take(
        f"{root}/p",
        {"state": StateDict(_sharded(world))},
        _custom_tensor_prepare_func=_quantize_per_shard,
    )
    whole = torch.zeros(SHAPE)
    per.read_object("0/state/st", obj_out=whole)
    out["per_shard_error"] = float((whole - _full()).abs().max())
    try:
        per.read_object("0/state/st")
    except ShapeMismatchError as exc:
        out["per_shard_refusal"] = str(exc)
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_entry_into_a_plain_tensor_and_prepared_shards(tmp_path: Path) -> None:
    values(run_ranks(2, read_into_plain, str(tmp_path / "repo")))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_shards_read_into_a_plain_tensor(tmp_path: Path) -> None:
    out = values(run_ranks(2, read_quantized_shards, str(tmp_path / "repo")))
    for o in out:
        assert o["version"] == "1.0"  # the one format
        assert o["per_shard_error"] < float(_full().abs().max()) / 100  # within one step
        assert "different parameters" in o["per_shard_refusal"]
        assert "floating-point" in o["per_shard_refusal"]
