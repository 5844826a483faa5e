"""torch_checkpointing's own ``CheckpointManager`` over casnap (docs/torch_checkpointing.md).

The real library (0.1.1) saves and loads, its async saver writing from its own
spawned process; casnap is only its ``storage_config``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from torch_checkpointing import CheckpointManager, ItemSpec  # noqa: E402
from torch_checkpointing.config import (  # noqa: E402
    AsyncCheckpointSaverConfig,
    SyncCheckpointSaverConfig,
)

import casnap  # noqa: E402
from casnap.errors import IntegrityError  # noqa: E402
from casnap.integrations.torch_checkpointing import CasnapStorageConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dist_harness import run_ranks, values  # noqa: E402
from helpers import flip_byte, kill_when_ready  # noqa: E402
from test_cli_contract import casnap as run_cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
HERE = Path(__file__).parent


def _manager(
    root: Path, sync: bool = True, options: dict[str, Any] | None = None, **items: ItemSpec
) -> CheckpointManager:
    save = SyncCheckpointSaverConfig() if sync else AsyncCheckpointSaverConfig()
    storage = CasnapStorageConfig(str(root), options or {})
    config = CheckpointManager.Config(save=save, storage_config=storage, items=items)
    return config.build()


class _Run:
    """A model, optimizer, scheduler and RNG, trained a step at a time."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.step = 0

    def train(self, n: int) -> None:
        for _ in range(n):
            loss = self.model(torch.randn(4, 32)).square().mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1

    def payload(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def restore(self, loaded: Any) -> None:
        self.model.load_state_dict(loaded["model"])
        self.opt.load_state_dict(loaded["optim"])
        self.sched.load_state_dict(loaded["sched"])
        torch.set_rng_state(loaded["rng"])
        self.step = loaded["step"]


def _load(manager: CheckpointManager, ckpt: Path) -> Any:
    return manager.load(str(ckpt), dict.fromkeys(["model", "optim", "sched", "rng", "step"]))


def _params(run: _Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def _stored(root: Path) -> int:
    meta = root / ".casnap"
    return sum(f.stat().st_size for d in ("chunks", "packs") for f in (meta / d).rglob("*"))


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_resume_is_bit_exact_and_an_unchanged_resave_writes_no_chunk(tmp_path, sync):
    root = tmp_path / "run"
    manager = _manager(root, sync=sync)
    try:
        run = _Run()
        run.train(3)
        done = manager.save(str(root / "step_3"), run.payload())
        if done is not None:
            done.result(timeout=120)  # the library's write future: the commit happened
        before = _stored(root)
        done = manager.save(str(root / "step_3_again"), run.payload())
        if done is not None:
            done.result(timeout=120)
        assert _stored(root) == before  # not one chunk or pack more
        run.train(3)
        want = _params(run)
        resumed = _Run(seed=1)
        resumed.restore(_load(manager, root / "step_3"))
        assert resumed.step == 3
        resumed.train(3)  # same optimizer moments, lr schedule and random batches
        assert all(torch.equal(a, b) for a, b in zip(_params(resumed), want, strict=True))
    finally:
        manager.close()
    repo = casnap.Repository(str(root))
    assert repo.snapshots() == ["step_3", "step_3_again"]  # tmp_* folders never shown
    assert sorted(os.listdir(root)) == [".casnap"]
    code, out, err = run_cli(tmp_path, "verify", "--read-data", str(root))
    assert code == 0, out + err


def test_a_sparse_change_writes_only_what_changed(tmp_path):
    root = tmp_path / "run"
    manager = _manager(root, options={"chunk_size": 64 * 1024})  # a take's option
    try:
        state = {f"layer{i}": torch.randn(256, 256) for i in range(8)}
        manager.save(str(root / "a"), {"model": state})
        before = _stored(root)
        state["layer7"] = state["layer7"] + 1
        manager.save(str(root / "b"), {"model": state})
        grew = _stored(root) - before
        assert 0 < grew < 2 * 256 * 256 * 4  # about one layer of eight (256 KiB each)
        loaded = manager.load(str(root / "b"), {"model": None})
        assert all(torch.equal(loaded["model"][k], v) for k, v in state.items())
    finally:
        manager.close()


def test_a_file_that_fails_to_store_fails_the_save_and_frees_its_lease(tmp_path, monkeypatch):
    from casnap.integrations import torch_checkpointing as casnap_tc

    root = tmp_path / "run"
    manager = _manager(root)
    try:
        manager.save(str(root / "a"), {"model": {"w": torch.ones(64, 64)}})

        def refused(*args: Any) -> None:
            raise OSError("the store refused a chunk")

        monkeypatch.setattr(casnap_tc, "store_segments", refused)
        with pytest.raises(OSError, match="refused"):
            manager.save(str(root / "b"), {"model": {"w": torch.zeros(64, 64)}})
        assert not list((root / ".casnap" / "leases").iterdir())  # released at the failure
        assert casnap.Repository(str(root)).snapshots() == ["a"]
        monkeypatch.undo()
        manager.save(str(root / "b"), {"model": {"w": torch.zeros(64, 64)}})  # afresh
        loaded = manager.load(str(root / "b"), {"model": None})
        assert torch.equal(loaded["model"]["w"], torch.zeros(64, 64))
    finally:
        manager.close()


def test_a_damaged_chunk_fails_the_load(tmp_path):
    root = tmp_path / "run"
    manager = _manager(root)
    try:
        manager.save(str(root / "a"), {"model": {"w": torch.randn(128, 128)}})
        meta = root / ".casnap"
        stored = [f for d in ("chunks", "packs") for f in (meta / d).rglob("*") if f.is_file()]
        biggest = max(stored, key=lambda f: f.stat().st_size)  # the weight's bytes
        flip_byte(biggest, biggest.stat().st_size // 2, 0xFF)
        with pytest.raises(IntegrityError):
            manager.load(str(root / "a"), {"model": None})
    finally:
        manager.close()


def test_removing_a_checkpoint_folder_drops_its_snapshot_and_gc_reclaims(tmp_path):
    root = tmp_path / "run"
    manager = _manager(root)
    try:
        for step in range(3):
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((64, 64), step)}})
        storage = CasnapStorageConfig(str(root)).create_storage()
        assert storage.ls(root) == ["step_0", "step_1", "step_2"]
        storage.rmdir(root / "step_0")  # what a purge of old checkpoints calls
        assert storage.ls(root) == ["step_1", "step_2"] and not storage.exists(root / "step_0")
        repo = casnap.Repository(str(root))
        assert repo.gc(grace_seconds=0).bytes_freed > 0
        loaded = manager.load(str(root / "step_1"), {"model": None})
        assert torch.equal(loaded["model"]["w"], torch.full((64, 64), 1))
        with pytest.raises(FileNotFoundError):
            manager.load(str(root / "step_0"), {"model": None})
    finally:
        manager.close()


def test_a_save_killed_before_its_rename_leaves_no_checkpoint(tmp_path):
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    # killed with step_2's files all stored, its rename next
    argv = [sys.executable, str(HERE / "torch_checkpointing_child.py"), str(tmp_path)]
    kill_when_ready(argv, tmp_path / "ready", env)
    storage = CasnapStorageConfig(str(root)).create_storage()
    assert storage.ls(root) == ["step_1"] and not storage.exists(root / "tmp_step_2")
    manager = _manager(root)
    try:
        loaded = manager.load(str(root / "step_1"), {"model": None})
        assert torch.equal(loaded["model"]["w"], torch.ones(256, 256))
        with pytest.raises(FileNotFoundError):
            manager.load(str(root / "step_2"), {"model": None})
    finally:
        manager.close()
    code, out, err = run_cli(tmp_path, "verify", "--read-data", str(root))
    assert code == 0, out + err


ROWS, COLS = 32, 24


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _dtensor_manager(root: str) -> CheckpointManager:
    from torch_checkpointing.default_resharder import DefaultResharder  # DTensor's

    return _manager(Path(root), sync=True, model=ItemSpec(resharder=DefaultResharder()))


def _dist_save(rank: int, world: int, root: str) -> int:
    """Each rank saves its own rows (no resharder: the library's multi-rank metadata
    gather is CUDA-only in 0.1.1), then the same again."""
    warnings.simplefilter("ignore")
    manager = _manager(Path(root))
    try:
        rows = _full(1).chunk(world)[rank].clone()
        manager.save(f"{root}/step_1", {"model": {"w": rows}, "step": 1})
        before = _stored(Path(root))
        torch.distributed.barrier()
        manager.save(f"{root}/step_2", {"model": {"w": rows}, "step": 1})  # unchanged
        torch.distributed.barrier()
        grew = _stored(Path(root)) - before
        loaded = manager.load(f"{root}/step_2", {"model": None, "step": None})
        assert torch.equal(loaded["model"]["w"], rows) and loaded["step"] == 1
        return grew
    finally:
        manager.close()


def _dtensor_save(rank: int, world: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    manager = _dtensor_manager(root)
    try:
        w = distribute_tensor(_full(1), mesh, [Shard(0)])
        manager.save(f"{root}/dt", {"model": {"w": w}, "step": 1})
        return True
    finally:
        manager.close()


def _dtensor_load(rank: int, world: int, root: str, dim: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    manager = _dtensor_manager(root)
    try:
        target = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)])
        # only the resharded item: a plain one is per rank (step_<rank>.pt, as saved)
        loaded = manager.load(f"{root}/dt", {"model": {"w": target}})
        return torch.equal(loaded["model"]["w"].full_tensor(), _full(1))
    finally:
        manager.close()


@pytest.mark.dist
def test_two_ranks_save_one_snapshot_and_each_loads_its_own(tmp_path):
    root = str(tmp_path / "run")
    assert values(run_ranks(2, _dist_save, root)) == [0, 0]  # the re-save wrote no chunk
    repo = casnap.Repository(root)
    manifest = repo.storage.read_manifest(repo.resolve("step_1"))
    assert manifest.world_size == 2
    assert {k for k in manifest.entries if k.endswith(".pt")} >= {"0/model_0.pt", "0/model_1.pt"}
    assert repo.snapshots() == ["step_1", "step_2"]
    assert repo.verify(read_data=True).ok


@pytest.mark.dist
def test_the_library_reshards_a_checkpoint_onto_other_ranks_and_placements(tmp_path):
    root = str(tmp_path / "run")
    assert values(run_ranks(1, _dtensor_save, root)) == [True]
    assert values(run_ranks(2, _dtensor_load, root, 0)) == [True, True]  # 1 rank -> 2
    assert values(run_ranks(2, _dtensor_load, root, 1)) == [True, True]  # by columns
    assert casnap.Repository(root).verify(read_data=True).ok
