"""DCP over casnap on several ranks (gloo on CPU): DTensor, ShardedTensor, FSDP2, resharding.

Each scenario saves on one world size and loads on another (or with another
placement) through DCP's own planners, so the reader must serve any box DCP
asks for out of the stored shards.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]

ROWS, COLS = 12, 10


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _save_dtensor(rank: int, world: int, path: str, dim: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from casnap.integrations.dcp import CasnapWriter

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(_full(), mesh, [Shard(dim)])
    bias = distribute_tensor(torch.ones(COLS), mesh, [Shard(0)])
    writer = CasnapWriter(path, settings={"chunk_size": 4096})
    dcp.save({"model": {"w": w, "b": bias}, "step": 7}, storage_writer=writer)
    stats = writer.last_write_stats
    assert stats is not None
    return {"written": stats.stored_bytes_written}


def _load_dtensor(rank: int, world: int, path: str, dim: int) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from casnap.integrations.dcp import CasnapReader

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)])
    bias = distribute_tensor(torch.zeros(COLS), mesh, [Shard(0)])
    state: dict[str, Any] = {"model": {"w": w, "b": bias}, "step": 0}
    dcp.load(state, storage_reader=CasnapReader(path))
    return (
        torch.equal(state["model"]["w"].full_tensor(), _full())
        and torch.equal(state["model"]["b"].full_tensor(), torch.ones(COLS))
        and state["step"] == 7
    )


def _load_plain(path: str) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    from casnap.integrations.dcp import CasnapReader

    state: dict[str, Any] = {
        "model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)},
        "step": 0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=CasnapReader(path), no_dist=True)
    return state["model"]["w"]


def _sharded_tensor_roundtrip(rank: int, world: int, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.shard import Shard

    from casnap.integrations.dcp import CasnapReader, CasnapWriter

    warnings.simplefilter("ignore")
    rows = ROWS // world

    def sharded(fill: torch.Tensor) -> object:
        meta = ShardMetadata([rank * rows, 0], [rows, COLS], f"rank:{rank}/cpu")
        local = fill[rank * rows : (rank + 1) * rows].clone()
        return init_from_local_shards([Shard(local, meta)], [ROWS, COLS])

    dcp.save({"st": sharded(_full())}, storage_writer=CasnapWriter(path))
    target: dict[str, Any] = {"st": sharded(torch.zeros(ROWS, COLS))}
    dcp.load(target, storage_reader=CasnapReader(path))
    local = target["st"].local_shards()[0].tensor
    return torch.equal(local, _full()[rank * rows : (rank + 1) * rows])


def _fsdp2(rank: int, world: int, path: str, load: bool) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from casnap.integrations.dcp import CasnapReader, CasnapWriter

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    if not load:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=CasnapWriter(path))
        return True
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=CasnapReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return all(torch.equal(got[k], want[k]) for k in want)


def _refused_resave(rank: int, world: int, path: str) -> dict:
    """Saving to an existing id with overwrite=False, caught as DCP code catches it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from casnap.integrations.dcp import CasnapWriter

    warnings.simplefilter("ignore")
    w = distribute_tensor(torch.zeros(ROWS, COLS), init_device_mesh("cpu", (world,)), [Shard(0)])
    try:
        dcp.save({"model": {"w": w}}, storage_writer=CasnapWriter(path, overwrite=False))
    except CheckpointException as exc:
        return {
            "text": str(exc),
            "failures": {r: (type(e).__mro__, str(e)) for r, (e, _) in exc.failures.items()},
        }
    return {"text": "saved"}


def _on_two_ranks(rank: int, world: int, root: str) -> dict:
    """Every 2-rank scenario in one group (starting processes is most of the cost)."""
    out = _save_dtensor(rank, world, f"{root}/run/a", 0)
    out["by_columns"] = _load_dtensor(rank, world, f"{root}/run/a", 1)
    out["resave_written"] = _save_dtensor(rank, world, f"{root}/run/b", 0)["written"]
    out["sharded_tensor"] = _sharded_tensor_roundtrip(rank, world, f"{root}/st/st")
    out["fsdp2_saved"] = _fsdp2(rank, world, f"{root}/fsdp/f", False)
    out["refused"] = _refused_resave(rank, world, f"{root}/run/a")
    return out


def _on_three_ranks(rank: int, world: int, root: str) -> dict:
    return {
        "rows": _load_dtensor(rank, world, f"{root}/run/a", 0),
        "fsdp2": _fsdp2(rank, world, f"{root}/fsdp/f", True),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-dist")
    return root, values(run_ranks(2, _on_two_ranks, str(root)))


@pytest.fixture(scope="module")
def on_three(saved):
    root, _ = saved
    return values(run_ranks(3, _on_three_ranks, str(root)))


def test_dtensor_saved_on_2_ranks_loads_with_another_placement_and_in_one_process(saved):
    root, ranks = saved
    assert all(r["written"] > 0 for r in ranks)  # each rank wrote its own rows
    assert [r["by_columns"] for r in ranks] == [True, True]
    assert torch.equal(_load_plain(str(root / "run" / "a")), _full())  # no group at all
    import casnap

    repo = casnap.Repository(str(root / "run"))
    manifest = repo.storage.read_manifest(repo.resolve("a"))
    assert manifest.world_size == 2 and manifest.entries["0/model/w"].kind == "sharded"
    assert repo.verify(read_data=True).ok


def test_dtensor_saved_on_2_ranks_loads_on_3(on_three):
    assert [r["rows"] for r in on_three] == [True] * 3


def test_an_unchanged_distributed_resave_writes_nothing(saved):
    _, ranks = saved
    assert [r["resave_written"] for r in ranks] == [0, 0]


def test_sharded_tensor_state_roundtrips_and_loads_whole(saved):
    root, ranks = saved
    assert [r["sharded_tensor"] for r in ranks] == [True, True]
    import torch.distributed.checkpoint as dcp

    from casnap.integrations.dcp import CasnapReader

    state = {"st": torch.zeros(ROWS, COLS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=CasnapReader(str(root / "st" / "st")), no_dist=True)
    assert torch.equal(state["st"], _full())


def test_fsdp2_fully_shard_on_cpu_saves_on_2_and_loads_on_3(saved, on_three):
    assert [r["fsdp2_saved"] for r in saved[1]] == [True, True]
    assert [r["fsdp2"] for r in on_three] == [True] * 3


def test_overwrite_false_fails_every_rank_in_dcps_words(saved):
    root, ranks = saved
    import casnap
    from casnap.errors import CheckpointExistsError

    for r in ranks:  # as FileSystemWriter(overwrite=False): every rank's own RuntimeError
        assert "Checkpoint already exists and self.overwrite=False." in r["refused"]["text"]
        assert sorted(r["refused"]["failures"]) == [0, 1]
        for mro, message in r["refused"]["failures"].values():
            assert RuntimeError in mro and CheckpointExistsError in mro, mro
            assert message.startswith("Checkpoint already exists and self.overwrite=False.")
    # The existing checkpoint is untouched: no new version, none moved to the history.
    repo = casnap.Repository(str(root / "run"))
    assert not [n for n in repo.snapshots() if n.startswith("a@")]
    assert torch.equal(_load_plain(str(root / "run" / "a")), _full())
