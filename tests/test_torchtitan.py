"""torchtitan 0.3.0's checkpointing through casnap (docs/torchtitan.md).

The real torchtitan classes on CPU with gloo: ``CasnapCheckpointManager.Config(...).build``
with the arguments torchtitan's ``Trainer`` passes, its ``OptimizersContainer``
(AdamW), ``LRSchedulersContainer`` (warmup), ``ParallelAwareDataloader`` (a
``StatefulDataLoader``) and a train state ``Stateful`` like the Trainer's. The
model is a small ``nn.Module`` (torchtitan's llama3 debug model imports triton).
Killed saves and power cuts: tests/test_torchtitan_crash.py.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import default_adamw  # noqa: E402
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter  # noqa: E402

import casnap  # noqa: E402
from casnap.integrations.dcp import CasnapWriter  # noqa: E402
from casnap.integrations.torchtitan import CasnapCheckpointManager  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dist_harness import run_ranks, values  # noqa: E402
from test_cli_contract import casnap as run_cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)
MODES = ["disabled", "async", "async_with_pinned_mem"]


class Tokens(torch.utils.data.IterableDataset):
    def __iter__(self):
        gen = torch.Generator().manual_seed(7)
        for _ in range(10_000):
            yield torch.randn(16, generator=gen)


class Loader(ParallelAwareDataloader):  # type: ignore[misc]
    """torchtitan's data loader, remembering the state a load gave it.

    (A ``StatefulDataLoader``'s own ``state_dict`` after a load counts the
    fast-forward twice, torchdata's quirk; the batches it yields are right.)
    """

    loaded: dict[str, Any] | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = copy.deepcopy(state_dict)
        super().load_state_dict(state_dict)


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``: the step and tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


class Job:
    """The checkpointed parts of a torchtitan training job, and its loop."""

    def __init__(
        self,
        base: Path,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        fsdp: bool = False,
        **cfg: Any,
    ):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 16))
        if fsdp:  # FSDP2 over every rank, as torchtitan's data_parallel_shard applies it
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=100
        )
        self.dataloader = Loader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=4)
        self.data: Any = None
        self.train_state = TrainState()
        manager = cfg.pop("manager", CasnapCheckpointManager)
        adapter = cfg.pop("sd_adapter", None)
        config = manager.Config(**{"enable": True, "interval": 1, "keep_latest_k": 0, **cfg})
        self.ckpt = config.build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=adapter,
            base_folder=str(base),
        )

    def train(self, steps: int, save: bool = True) -> None:
        if self.data is None:
            self.data = iter(self.dataloader)
        for _ in range(steps):
            batch = next(self.data)
            self.optimizers.zero_grad()
            (self.model(batch) - batch).pow(2).mean().backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.train_state.step += 1
            self.train_state.ntokens_seen += batch.numel()
            if save:
                self.ckpt.save(self.train_state.step)
                self.ckpt.maybe_wait_for_staging()

    def state(self) -> dict[str, Any]:
        """Everything a resume must restore, as plain values."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optim": self.optimizers.state_dict(),
                "lr": self.lr_schedulers.state_dict(),
                "lr_now": [g["lr"] for o in self.optimizers for g in o.param_groups],
                "data": self.dataloader.loaded or self.dataloader.state_dict(),
                "train": (self.train_state.step, self.train_state.ntokens_seen),
            }
        )


def differs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The top-level keys whose values are not bit-identical."""
    return [k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k])]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def stored(folder: Path) -> list[Path]:
    """The chunk objects and packs in a repository."""
    meta = folder / ".casnap"
    return sorted(f for d in ("chunks", "packs") for f in (meta / d).rglob("*") if f.is_file())


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def verify_clean(tmp_path: Path, folder: Path, env: dict[str, str] | None = None) -> None:
    code, out, err = run_cli(tmp_path, "verify", "--read-data", str(folder), env=env)
    assert code == 0, out + err


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_job_continues_bit_exact(tmp_path, world_of_one, mode):
    job = Job(tmp_path, async_mode=mode, interval=2)
    job.train(4)
    job.ckpt.maybe_wait_for_saving()
    at_4 = job.state()
    job.train(2, save=False)
    at_6 = job.state()
    job.ckpt.close()
    assert casnap.Repository(str(tmp_path / "checkpoint")).snapshots() == ["step-2", "step-4"]

    fresh = Job(tmp_path, seed=1, async_mode=mode, interval=2)
    assert fresh.ckpt.load() is True  # the newest step: 4
    assert differs(fresh.state(), at_4) == []
    fresh.train(2, save=False)  # the data loader resumes where it was: the same batches
    assert differs(fresh.state(), at_6) == ["data"]  # the data loader resumed where it was too
    fresh.ckpt.close()
    verify_clean(tmp_path, tmp_path / "checkpoint")


def test_an_unchanged_resave_writes_no_chunk(tmp_path, world_of_one):
    job = Job(tmp_path)
    job.train(1)
    before = stored(tmp_path / "checkpoint")
    job.ckpt.save(2)  # the same state as step 1 (torchtitan's step counter aside)
    assert stored(tmp_path / "checkpoint") == before
    repo = casnap.Repository(str(tmp_path / "checkpoint"))
    assert repo.snapshots() == ["step-1", "step-2"]
    assert repo.show("step-2").parents == (repo.resolve("step-1"),)
    job.ckpt.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_keep_latest_k_deletes_old_steps_and_their_space(tmp_path, world_of_one, mode):
    job = Job(tmp_path, async_mode=mode, keep_latest_k=2)
    job.train(5)
    job.ckpt.maybe_wait_for_saving()
    job.ckpt.close()  # the purge thread's queue drained, deferred reclaims done
    repo = casnap.Repository(str(tmp_path / "checkpoint"))
    assert repo.snapshots() == ["step-4", "step-5"]
    usage = repo.du()
    assert {u.name for u in usage.per_snapshot} == {"step-4", "step-5"}
    assert usage.unreferenced.count == 0, usage  # steps 1-3 reclaimed, not left to gc
    verify_clean(tmp_path, tmp_path / "checkpoint")
    again = Job(tmp_path, seed=3, keep_latest_k=2)
    assert again.ckpt.load() is True
    assert again.train_state.step == 5
    again.ckpt.close()


def test_deleting_a_step_never_removes_what_a_save_in_flight_reuses(
    tmp_path, world_of_one, monkeypatch
):
    """keep_latest_k retires step 1 while step 3, whose tensors are step 1's again, is
    still being saved in the background: step 3 skipped writing those chunks (they
    exist), so step 1's reclaim must wait for the save's lease, not delete them."""
    job = Job(tmp_path, async_mode="async", keep_latest_k=2, reclaim_wait_seconds=0.2)
    first = {k: v.clone() for k, v in job.model.state_dict().items()}
    job.ckpt.save(1)
    job.ckpt.maybe_wait_for_saving()
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)
    job.ckpt.save(2)
    job.ckpt.maybe_wait_for_saving()
    with torch.no_grad():  # back to step 1's values: step 2 (the parent) lacks them
        for name, p in job.model.named_parameters():
            p.copy_(first[name])

    release, reached = threading.Event(), threading.Event()
    finish = CasnapWriter.finish

    def held_finish(self, metadata, results):  # chunks written, the ref not yet
        reached.set()
        assert release.wait(60)
        finish(self, metadata, results)

    monkeypatch.setattr(CasnapWriter, "finish", held_finish)
    retirer = job.ckpt._retirer
    retire, retired = retirer.retire, threading.Event()

    def late_retire(*args):  # the purge thread, once step 3 decided what to reuse
        assert reached.wait(60)
        retire(*args)
        retired.set()

    monkeypatch.setattr(retirer, "retire", late_retire)
    before = stored(tmp_path / "checkpoint")
    job.ckpt.save(3)  # queues step 1 for the purge thread while step 3 uploads
    assert retired.wait(60)
    repo = casnap.Repository(str(tmp_path / "checkpoint"))
    assert "step-1" not in repo.snapshots()
    assert retirer.pending == 1  # its reclaim saw step 3's lease and deferred
    assert stored(tmp_path / "checkpoint") == before  # step 1's chunks are all still there
    release.set()
    job.ckpt.maybe_wait_for_saving()
    job.ckpt.close()  # the deferred reclaim runs now; step 3 holds step 1's chunks
    assert retirer.pending == 0
    assert repo.snapshots() == ["step-2", "step-3"]
    verify_clean(tmp_path, tmp_path / "checkpoint")
    fresh = Job(tmp_path, seed=5)
    assert fresh.ckpt.load() is True
    assert same(dict(fresh.model.state_dict()), first)
    fresh.ckpt.close()


def test_load_step_picks_that_step_and_refuses_a_missing_one(tmp_path, world_of_one):
    job = Job(tmp_path, interval=2)
    job.train(2)
    at_2 = job.state()
    job.train(2)
    job.ckpt.close()
    fresh = Job(tmp_path, seed=9)
    assert fresh.ckpt._find_load_step() == 4
    assert fresh.ckpt.load(step=2) is True
    got = fresh.state()
    assert same(
        {k: got[k] for k in ("model", "optim", "lr", "train")},
        {k: at_2[k] for k in ("model", "optim", "lr", "train")},
    )
    with pytest.raises(FileNotFoundError, match="step-3"):
        fresh.ckpt.load(step=3)
    fresh.ckpt.close()


def test_an_empty_folder_is_a_fresh_start(tmp_path, world_of_one):
    job = Job(tmp_path)
    assert job.ckpt.load() is False
    job.ckpt.close()


def test_initial_load_path_reads_a_plain_dcp_folder(tmp_path, world_of_one):
    """A DCP checkpoint torchtitan's own manager wrote starts a casnap run."""
    old = Job(tmp_path / "old", manager=CheckpointManager)
    old.train(2)
    old.ckpt.close()
    assert (tmp_path / "old" / "checkpoint" / "step-2" / ".metadata").is_file()
    want = old.state()
    job = Job(
        tmp_path / "new",
        seed=4,
        initial_load_path=str(tmp_path / "old" / "checkpoint" / "step-2"),
        initial_load_model_only=False,
    )
    assert job.ckpt.load() is True
    assert same(
        {k: job.state()[k] for k in ("model", "optim", "train")},
        {k: want[k] for k in ("model", "optim", "train")},
    )
    job.train(1)
    job.ckpt.close()
    assert casnap.Repository(str(tmp_path / "new" / "checkpoint")).snapshots() == ["step-3"]


def test_switching_managers_in_one_folder_resumes_and_purges_the_dcp_steps(tmp_path, world_of_one):
    old = Job(tmp_path, manager=CheckpointManager)
    old.train(2)
    old.ckpt.close()
    want = old.state()
    job = Job(tmp_path, seed=4, keep_latest_k=2)
    assert job.ckpt.load() is True  # DCP's step-2 folder, by DCP's own reader
    assert same(job.state()["model"], want["model"])
    job.train(2)  # steps 3 and 4 as snapshots; step-1 and step-2 folders purged
    job.ckpt.close()
    assert not (tmp_path / "checkpoint" / "step-1").exists()
    assert not (tmp_path / "checkpoint" / "step-2").exists()
    assert casnap.Repository(str(tmp_path / "checkpoint")).snapshots() == ["step-3", "step-4"]


def test_an_initial_load_path_may_be_a_casnap_snapshot(tmp_path, world_of_one):
    base = Job(tmp_path / "base")
    base.train(1)
    base.ckpt.close()
    job = Job(
        tmp_path / "ft", seed=2, initial_load_path=str(tmp_path / "base" / "checkpoint" / "step-1")
    )
    assert job.ckpt.load() is True  # the model only (initial_load_model_only's default)
    assert same(job.state()["model"], base.state()["model"])
    assert job.train_state.step == 0
    job.ckpt.close()


def test_a_remote_folder_is_a_repository_there(tmp_path, world_of_one):
    import fsspec

    url = f"memory://{tmp_path.name}"
    try:
        job = Job(tmp_path, folder=f"{url}/ckpt", keep_latest_k=2)
        job.train(3)
        job.ckpt.close()
        assert casnap.Repository(f"{url}/ckpt").snapshots() == ["step-2", "step-3"]
        fresh = Job(tmp_path, seed=1, folder=f"{url}/ckpt")
        assert fresh.ckpt.load() is True and fresh.train_state.step == 3
        fresh.ckpt.close()
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


class HfNames(BaseStateDictAdapter):  # type: ignore[misc]
    """A state-dict adapter as a torchtitan model has one: native keys <-> HF keys."""

    def __init__(self) -> None:
        self.fqn_to_index_mapping, self.hf_assets_path = None, None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"hf.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("hf."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
        return HuggingFaceStorageReader(path)


def test_last_save_in_hf_writes_torchtitans_safetensors_folder_outside_casnap(
    tmp_path, world_of_one
):
    job = Job(tmp_path, sd_adapter=HfNames(), last_save_in_hf=True, keep_latest_k=2)
    job.train(2)
    assert job.ckpt.save(3, last_step=True) is True
    job.ckpt.close()
    folder = tmp_path / "checkpoint"
    export = folder / "step-3"
    assert list(export.glob("*.safetensors"))  # torchtitan's HuggingFaceStorageWriter's files
    from safetensors.torch import load_file

    (file,) = export.glob("*.safetensors")
    assert same(dict(sorted(load_file(file).items())), HfNames().to_hf(job.state()["model"]))
    assert casnap.Repository(str(folder)).snapshots() == ["step-1", "step-2"]
    fresh = Job(tmp_path, seed=2)
    assert fresh.ckpt._find_load_step() == 2  # the model-only export is no resume point
    fresh.ckpt.close()


def test_last_save_in_hf_with_a_remote_folder_is_refused_by_torchtitan(tmp_path):
    with pytest.raises(ValueError, match="last_save_in_hf is not supported with a remote"):
        CasnapCheckpointManager.Config(
            enable=True, folder="memory://run/ckpt", last_save_in_hf=True
        )


# -- two ranks -------------------------------------------------------------------
def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    job = Job(Path(root), rank=rank, world=world, async_mode="async", keep_latest_k=2)
    job.train(3)
    job.ckpt.maybe_wait_for_saving()
    want = job.state()
    job.ckpt.close()
    fresh = Job(Path(root), seed=rank + 10, rank=rank, world=world)
    assert fresh.ckpt.load() is True
    got = fresh.state()
    fresh.ckpt.close()
    return {"same": same(got, want), "data_keys": sorted(got["data"])}


def _full(value: Any) -> Any:
    """A state with each DTensor gathered whole (every rank calls it)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def _fsdp_ranks(rank: int, world: int, root: str, save: bool) -> dict[str, Any]:
    """``save``: FSDP2 on ``world`` ranks trains and saves steps 1-2; else a fresh job
    on ``world`` ranks (FSDP2 when more than one) resumes it. Returns the full state."""
    # torchtitan refuses to reshard its data loader's state: a new world size skips it
    skip = {"exclude_from_loading": ["dataloader"]} if world == 1 else {}
    job = Job(Path(root), seed=0 if save else 20 + rank, rank=rank, world=world,
              fsdp=world > 1, async_mode="async", **skip)  # fmt: skip
    if save:
        job.train(2)
        job.ckpt.maybe_wait_for_saving()
    else:
        assert job.ckpt.load() is True
    state = job.state()
    job.ckpt.close()
    return {k: _full(state[k]) for k in ("model", "optim", "lr", "train")}


@pytest.mark.dist
def test_fsdp_sharded_state_resumes_on_two_ranks_and_reshards_to_one(tmp_path):
    saved = values(run_ranks(2, _fsdp_ranks, str(tmp_path), True))
    assert isinstance(saved[0]["model"]["0.weight"], torch.Tensor)
    show = casnap.Repository(str(tmp_path / "checkpoint")).show("step-2")
    assert show.entries["0/0.weight"].kind == "sharded"  # one shard per rank
    two = values(run_ranks(2, _fsdp_ranks, str(tmp_path), False))
    assert differs(two[0], saved[0]) == [] and differs(two[1], saved[1]) == []
    one = values(run_ranks(1, _fsdp_ranks, str(tmp_path), False))
    assert differs(one[0], saved[0]) == []  # DCP reshards the DTensor shards onto one rank
    verify_clean(tmp_path, tmp_path / "checkpoint")


@pytest.mark.dist
def test_two_ranks_save_and_resume_each_ranks_state(tmp_path):
    out = values(run_ranks(2, _two_ranks, str(tmp_path)))
    assert [o["same"] for o in out] == [True, True]
    assert out[0]["data_keys"] == ["dp_rank_0", "world_size"]
    assert out[1]["data_keys"] == ["dp_rank_1", "world_size"]
    assert casnap.Repository(str(tmp_path / "checkpoint")).snapshots() == ["step-2", "step-3"]
    verify_clean(tmp_path, tmp_path / "checkpoint")
