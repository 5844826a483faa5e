"""``dcp.save``/``dcp.load`` by ``checkpoint_id="casnap://..."`` on several ranks (gloo, CPU).

Every rank's DCP writes its own files through its own ``casnap://`` file
system; rank 0 commits them as one snapshot (docs/dcp.md, "By checkpoint id
alone"). A rank that fails or is killed mid-save leaves no checkpoint.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::UserWarning")]

ROWS, COLS = 64, 48


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _state(world: int, seed: int, fill: bool = True) -> dict[str, Any]:
    """A row-sharded weight, a replicated bias and a value, as ``world`` ranks hold them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = _full(seed) if fill else torch.zeros(ROWS, COLS)
    bias = torch.arange(COLS, dtype=torch.float32) * seed if fill else torch.zeros(COLS)
    return {
        "model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": bias},
        "step": seed if fill else -1,
    }


def _same(state: dict[str, Any], seed: int) -> bool:
    return (
        torch.equal(state["model"]["w"].full_tensor(), _full(seed))
        and torch.equal(state["model"]["b"], torch.arange(COLS, dtype=torch.float32) * seed)
        and state["step"] == seed
    )


def _protocol() -> None:
    import fsspec

    from casnap.integrations.dcp_fs import CasnapFileSystem

    warnings.simplefilter("ignore")
    fsspec.register_implementation("casnap", CasnapFileSystem, clobber=True)


def _stored(repo: Path) -> int:
    meta = repo / ".casnap"
    return sum(f.stat().st_size for d in ("chunks", "packs") for f in (meta / d).rglob("*"))


def _on_two(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from casnap.integrations.dcp_fs import CasnapFileSystem

    _protocol()
    run = Path(root, "run")
    out: dict[str, Any] = {}
    dcp.save(_state(world, 1), checkpoint_id=f"casnap://{run}/step_1")
    got = _state(world, 0, fill=False)
    dcp.load(got, checkpoint_id=f"casnap://{run}/step_1")
    out["loaded"] = _same(got, 1)
    dist.barrier()
    before = _stored(run)
    dcp.save(_state(world, 1), checkpoint_id=f"casnap://{run}/step_2")  # unchanged
    dist.barrier()
    out["resave_grew"] = _stored(run) - before
    original = CasnapFileSystem._store
    if rank == 1:  # one rank's file fails to be stored: no rank's save may show

        def broken(self: Any, save: Any, file: str, segments: Any) -> None:
            raise OSError("the store refused a chunk")

        CasnapFileSystem._store = broken  # type: ignore[method-assign]
    try:
        dcp.save(_state(world, 3), checkpoint_id=f"casnap://{run}/step_3")
    except CheckpointException as exc:
        out["failed"] = sorted(exc.failures)
    CasnapFileSystem._store = original  # type: ignore[method-assign]
    dcp.save(_state(world, 4), checkpoint_id=f"casnap://{run}/step_4")  # the next one goes on
    return out


def _on_three(rank: int, world: int, root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    _protocol()
    got = _state(world, 0, fill=False)
    dcp.load(got, checkpoint_id=f"casnap://{Path(root, 'run')}/step_4")  # DCP reshards
    return _same(got, 4)


def _killed(rank: int, world: int, root: str) -> str:
    import torch.distributed.checkpoint as dcp

    from casnap.integrations.dcp_fs import CasnapFileSystem

    _protocol()
    original = CasnapFileSystem._store
    if rank == 1:

        def store_then_die(self: Any, save: Any, file: str, segments: Any) -> None:
            original(self, save, file, segments)  # every chunk of its file written
            os.kill(os.getpid(), signal.SIGKILL)

        CasnapFileSystem._store = store_then_die  # type: ignore[method-assign]
    try:
        dcp.save(_state(world, 5), checkpoint_id=f"casnap://{Path(root, 'run')}/step_5")
    except Exception as exc:  # rank 0: DCP's gather finds its peer gone
        return type(exc).__name__
    return "returned"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcpfs-dist")
    return root, values(run_ranks(2, _on_two, str(root)))


def test_a_save_by_id_on_two_ranks_is_one_snapshot_that_loads_bit_exact(two):
    import casnap

    root, ranks = two
    assert [r["loaded"] for r in ranks] == [True, True]
    repo = casnap.Repository(str(root / "run"))
    manifest = repo.storage.read_manifest(repo.resolve("step_1"))
    assert manifest.world_size == 2
    files = sorted(k for k in manifest.entries if k.endswith(".distcp"))
    assert files == ["0/__0_0.distcp", "0/__1_0.distcp"]  # each rank's file, one snapshot
    assert repo.verify(read_data=True).ok


def test_an_unchanged_resave_by_id_on_two_ranks_writes_no_chunk(two):
    _, ranks = two
    assert [r["resave_grew"] for r in ranks] == [0, 0]


def test_a_rank_that_fails_leaves_no_checkpoint_and_the_next_save_commits(two):
    import casnap

    root, ranks = two
    assert [r["failed"] for r in ranks] == [[1], [1]]  # DCP names rank 1 on every rank
    repo = casnap.Repository(str(root / "run"))
    assert repo.snapshots() == ["step_1", "step_2", "step_4"]


def test_a_save_by_id_on_two_ranks_loads_on_three_and_in_one_process(two):
    import torch.distributed.checkpoint as dcp

    _protocol()
    root, _ = two
    assert values(run_ranks(3, _on_three, str(root))) == [True] * 3
    plain: dict[str, Any] = {
        "model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)},
        "step": -1,
    }
    dcp.load(plain, checkpoint_id=f"casnap://{root / 'run'}/step_4", no_dist=True)
    assert torch.equal(plain["model"]["w"], _full(4)) and plain["step"] == 4


def test_a_rank_killed_mid_save_leaves_no_checkpoint(tmp_path):
    import casnap

    one = values(run_ranks(2, _on_two, str(tmp_path)))
    assert len(one) == 2
    outcomes = run_ranks(2, _killed, str(tmp_path))
    assert outcomes[1].error_type == "NoReport"  # SIGKILLed after its chunks were written
    assert outcomes[0].value != "returned", outcomes[0].error_text
    repo = casnap.Repository(str(tmp_path / "run"))
    assert repo.snapshots() == ["step_1", "step_2", "step_4"]
    assert values(run_ranks(3, _on_three, str(tmp_path))) == [True] * 3
    assert repo.verify(read_data=True).ok


def _process_async(rank: int, world: int, root: str, kind: str) -> bool:
    """``dcp.async_save`` through DCP's spawned daemon on every rank (its own gloo group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from casnap.integrations.dcp import CasnapReader, CasnapWriter

    _protocol()
    ckpt = f"{Path(root, 'run')}/step_6"
    process = AsyncCheckpointerType.PROCESS
    if kind == "fs":
        fut = dcp.async_save(
            _state(world, 6), checkpoint_id=f"casnap://{ckpt}", async_checkpointer_type=process
        )
    else:
        writer = CasnapWriter(ckpt)
        fut = dcp.async_save(
            _state(world, 6), storage_writer=writer, async_checkpointer_type=process
        )
    fut.result(timeout=180)  # type: ignore[union-attr]  # a Future: no stager given
    got = _state(world, 0, fill=False)
    if kind == "fs":
        dcp.load(got, checkpoint_id=f"casnap://{ckpt}")
    else:
        dcp.load(got, storage_reader=CasnapReader(ckpt))
    return _same(got, 6)


@pytest.mark.parametrize("kind", ["fs", "writer"])
def test_process_based_async_save_on_two_ranks(tmp_path, kind):
    import casnap

    outcomes = run_ranks(2, _process_async, str(tmp_path), kind, timeout=300)
    assert values(outcomes) == [True, True]
    repo = casnap.Repository(str(tmp_path / "run"))
    assert repo.snapshots() == ["step_6"]
    assert repo.storage.read_manifest(repo.resolve("step_6")).world_size == 2
    assert repo.verify(read_data=True).ok
