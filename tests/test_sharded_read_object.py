"""read_object of a sharded entry into a plain tensor, and prepare funcs on shards (``-m dist``).

torchsnapshot 0.1.0 (tests/test_read_object.py) reads a ShardedTensor's entry
into one plain tensor on one rank, after a take whose
``_custom_tensor_prepare_func`` converted every shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

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
    from casnap import ShapeMismatchError, Snapshot, StateDict

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
    assert half.get_manifest()[f"{rank}/state/st"].dtype == "float16"
    out16 = torch.zeros(SHAPE, dtype=torch.float16)
    half.read_object("0/state/st", obj_out=out16)
    assert torch.equal(out16, _full().half())
    assert torch.equal(half.read_object("0/state/dt"), _full().half())

    def quantize(path: str, tensor: torch.Tensor, tracing: bool) -> torch.Tensor:
        return torch.quantize_per_tensor(tensor, 0.1, 10, torch.qint8)

    error = ""
    try:
        Snapshot.take(
            f"{root}/s3",
            {"state": StateDict(_sharded(world))},
            _custom_tensor_prepare_func=quantize,
        )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_entry_into_a_plain_tensor_and_prepared_shards(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = values(run_ranks(2, read_into_plain, str(root)))
    for o in out:  # quantized shards are refused on every rank, naming the key; no ref
        assert "state/st" in o["error"] and "quantized" in o["error"], o["error"]
    assert not (root / ".casnap" / "refs" / "s3").exists()
