"""Write the golden repository, tests/data/golden (run once per format change; commit it).

It holds format 1.0, every feature in one repository: ``first`` and ``second``
are a 2-rank gloo take on CPU (sharded entries, rank groups, replicated
tensors, per-rank state with a quantized tensor and a pickled object, packs
of small tensors); ``solo-1`` and ``solo-2`` are one process's takes of
:func:`golden_state`, ``solo-2`` storing its one changed chunk as a delta
against ``solo-1``'s whole chunk (depth 1); their entries' JSON is long
enough to be stored in a part (docs/format.md, "Manifest parts"). Every future casnap must read it
bit-exact: tests/test_golden.py rebuilds the expected state from the
functions here and compares.
"""

from __future__ import annotations

import collections
import fractions
import os
import shutil
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden"
SOLO = ("solo-1", "solo-2")
SOLO_OPTS = {"chunk_size": 16 * 1024}


def golden_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(20261122)
    return {
        "weights": torch.randn(64, 300, generator=g),  # several 16 KiB chunks, loose
        "bias": torch.randn(7, generator=g).to(torch.bfloat16),  # packed
        "mask": torch.rand(5, 5, generator=g) > 0.5,
        "ids": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "z": torch.complex(torch.randn(3, generator=g), torch.randn(3, generator=g)),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "many": torch.zeros(100, 4096),  # 100 chunk refs, one stored chunk: the entries in a part
        "meta": collections.OrderedDict(
            step=1234,
            lr=3e-4,
            name="golden/π",
            flags=(True, False, None),
            blob=b"\x00\xff",
            c=complex(1.5, -2.0),
            nan=float("nan"),
            neg0=-0.0,
            nested={"a": [1, 2.5, "x"], 7: "int key"},
        ),
    }


def golden_solo_second(state: dict[str, Any]) -> None:
    """What changed for ``solo-2``: one row of ``weights`` (one chunk, a sparse delta)."""
    state["weights"][3].add_(1.0)


def write_solo() -> None:
    from casnap import Snapshot, StateDict

    state = StateDict(golden_state())
    first = Snapshot.take(
        str(GOLDEN / SOLO[0]),
        {"state": state},
        settings=SOLO_OPTS,
        metadata={"step": 1, "note": "golden solo"},
        parents=[],
    )
    golden_solo_second(state)  # a second snapshot sharing most chunks, its change a delta
    Snapshot.take(
        str(GOLDEN / SOLO[1]),
        {"state": state},
        settings=SOLO_OPTS,
        metadata={"step": 2},
        parents=[first.manifest_hash],
    )


# -- a 2-rank gloo take with sharded entries ---------------------------------

WORLD = 2
OPTS = {"chunk_size": 4096}  # packs below 1 KiB (chunk_size // 4), loose above
REPLICATED = ["model/emb", "model/bias"]  # plain tensors the same on every rank


def golden_globals() -> dict[str, torch.Tensor]:
    """The global (unsharded) value of every ``model`` entry of the golden repository "first"."""
    g = torch.Generator().manual_seed(20261124)
    return {
        "w_row": torch.randn(64, 40, generator=g),  # DTensor Shard(0): 2 x 5120 B, loose
        "w_col": torch.randn(10, 33, generator=g).to(torch.bfloat16),  # Shard(1), uneven 17/16
        "codes": torch.randint(-128, 128, (40, 6), generator=g, dtype=torch.int8),  # Shard(0)
        "rep": torch.randn(20, generator=g).to(torch.float16),  # DTensor Replicate(): 1 shard
        "st": torch.randn(15, 8, generator=g, dtype=torch.float64),  # ShardedTensor, 8/7 rows
        "emb": torch.randn(32, 48, generator=g),  # plain, replicated=: 4096 + 2048 B, loose
        "bias": torch.randn(12, generator=g),  # plain, replicated=, packed
    }


def golden_second(values: dict[str, torch.Tensor]) -> None:
    """What changed for the golden repository "second": one row of rank 0's shard of w_row."""
    values["w_row"][3].add_(1.0)


def golden_rank_state(rank: int, step: int = 1) -> dict[str, Any]:
    """Rank ``rank``'s own (per-rank) state: tensors, primitives and a pickled object."""
    return {
        "x": torch.arange(6, dtype=torch.int64) * (rank + 1) - 2**40,
        "mask": torch.arange(5) % (rank + 2) == 0,
        "step": step,
        "rank": rank,
        "lr": 3e-4 * (rank + 1),
        "name": f"rank-{rank}/π",
        "frac": fractions.Fraction(rank + 1, 7),  # pickled (allow_pickle)
        "q": torch.quantize_per_tensor(  # stored as its int8 values, with its parameters
            torch.arange(8, dtype=torch.float32) * (rank + 1), 0.25, rank - 3, torch.qint8
        ),
    }


def golden_model(
    world: int, values: dict[str, torch.Tensor], layout: str = "save"
) -> dict[str, Any]:
    """The ``model`` state on a ``world``-rank CPU mesh: DTensors, a ShardedTensor, plain tensors.

    ``layout="save"`` is how the golden repository was taken; ``"reshard"`` puts every
    sharded value on other placements (a restore target). Call inside a
    process group.
    """
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    save = layout == "save"
    placements = {  # (as taken, a resharded restore target)
        "w_row": (Shard(0), Shard(1)),
        "w_col": (Shard(1), Shard(0)),
        "codes": (Shard(0), Replicate()),
        "rep": (Replicate(), Shard(0)),
    }
    state: dict[str, Any] = {
        k: distribute_tensor(values[k].clone(), mesh, [p[0] if save else p[1]])
        for k, p in placements.items()
    }
    st_dim = 0 if save else 1
    spec = ChunkShardingSpec(dim=st_dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = empty(spec, *values["st"].shape, dtype=values["st"].dtype)
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(values["st"][o[0] : o[0] + s[0], o[1] : o[1] + s[1]])
    state["st"] = st
    state["emb"], state["bias"] = values["emb"].clone(), values["bias"].clone()
    return state


def _rank(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    from casnap import Snapshot, StateDict

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        values = golden_globals()
        app = {
            "model": StateDict(golden_model(world, values)),
            "rank_state": StateDict(golden_rank_state(rank)),
        }
        first = Snapshot.take(
            str(GOLDEN / "first"),
            app,
            replicated=REPLICATED,
            settings=OPTS,
            allow_pickle=True,
            parents=[],
            metadata={"step": 1, "note": "golden"},
        )
        golden_second(values)
        app = {
            "model": StateDict(golden_model(world, values)),
            "rank_state": StateDict(golden_rank_state(rank, step=2)),
        }
        Snapshot.take(
            str(GOLDEN / "second"),
            app,
            replicated=REPLICATED,
            settings=OPTS,
            allow_pickle=True,
            parents=[first.manifest_hash],
            metadata={"step": 2},
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    if GOLDEN.exists():
        shutil.rmtree(GOLDEN)
    with tempfile.TemporaryDirectory(prefix="casnap-golden-") as tmp:
        os.environ["CASNAP_INDEX_DIR"] = str(Path(tmp, "index"))  # leave no local state behind
        mp.spawn(_rank, args=(WORLD, str(Path(tmp, "init"))), nprocs=WORLD)
        write_solo()
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(GOLDEN.parents[2]))  # this checkout's casnap, also in spawned ranks
    main()
