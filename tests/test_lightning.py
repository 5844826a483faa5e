"""CasnapCheckpointIO with a real lightning.Trainer on CPU (casnap.integrations.lightning)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import casnap  # noqa: E402
from casnap.integrations.lightning import CasnapCheckpointIO, checkpoint_snapshot  # noqa: E402

STEPS_PER_EPOCH = 4


class TinyModel(L.LightningModule):
    """A frozen "backbone" (shared by every checkpoint) and a trained head, Adam + StepLR."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = torch.nn.Linear(width, width)
        self.backbone.requires_grad_(False)
        self.head = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(torch.tanh(self.backbone(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.head.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * STEPS_PER_EPOCH, 64, generator=g), torch.randn(16, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)  # no shuffle: a resumed run sees the same


def _model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel()


def _trainer(root, plugin, max_epochs: int, **ckpt) -> tuple[L.Trainer, ModelCheckpoint]:
    options: dict[str, Any] = {"save_top_k": 2, "monitor": "step", "mode": "max"} | ckpt
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), **options)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        plugins=[plugin] if plugin else None,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        logger=False,
        accelerator="cpu",
        default_root_dir=root,
        enable_model_summary=False,
    )
    return trainer, checkpoint


def _files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if not f.startswith("."))


def _disk_bytes(folder) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(os.path.join(folder, ".casnap"))
        for f in files
        if "/index" not in d
    )


def test_top_k_keeps_two_snapshots_and_frees_the_rest(tmp_path):
    trainer, ckpt = _trainer(tmp_path, CasnapCheckpointIO(), max_epochs=4)
    trainer.fit(_model(), _data())
    folder = tmp_path / "ckpt"
    # What Lightning sees: two checkpoint files, as with torch.save checkpoints.
    assert _files(folder) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    assert ckpt.best_model_path == str(folder / "epoch=3-step=16.ckpt")
    repo = casnap.Repository(str(folder))
    assert repo.snapshots() == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    assert [line.step for line in repo.log()] == [12, 16]
    usage = repo.du()
    # The frozen backbone is stored once for both checkpoints.
    assert usage.stored_bytes < usage.logical_bytes
    # The two evicted checkpoints' space is already freed: nothing left for gc.
    assert usage.unreferenced.bytes == 0
    on_disk = _disk_bytes(folder)
    assert repo.gc(grace_seconds=0).bytes_freed == 0
    assert _disk_bytes(folder) == on_disk
    assert repo.verify(read_data=True).ok


def test_resume_from_best_continues_as_an_uninterrupted_run(tmp_path):
    straight, _ = _trainer(tmp_path / "straight", None, max_epochs=6)
    model = _model()
    straight.fit(model, _data())
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    first, ckpt = _trainer(tmp_path / "run", CasnapCheckpointIO(), max_epochs=4)
    first.fit(_model(), _data())
    best = ckpt.best_model_path
    saved = CasnapCheckpointIO().load_checkpoint(best)
    assert saved["global_step"] == 16

    seen = {}

    class Probe(Callback):
        def on_train_start(self, trainer, module):
            seen["step"] = trainer.global_step
            seen["head"] = module.head.weight.detach().clone()
            seen["exp_avg"] = trainer.optimizers[0].state_dict()["state"][0]["exp_avg"].clone()
            seen["lr"] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()

    resumed, _ = _trainer(tmp_path / "run", CasnapCheckpointIO(), max_epochs=6)
    resumed.callbacks.append(Probe())  # type: ignore[attr-defined]  # set by its CallbackConnector
    model = _model()
    resumed.fit(model, _data(), ckpt_path=best)
    assert seen["step"] == 16
    assert torch.equal(seen["head"], saved["state_dict"]["head.weight"])
    assert torch.equal(seen["exp_avg"], saved["optimizer_states"][0]["state"][0]["exp_avg"])
    assert seen["lr"] == saved["lr_schedulers"][0]["_last_lr"]
    assert resumed.global_step == 24
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_save_last_link_and_resume_last(tmp_path):
    trainer, ckpt = _trainer(tmp_path, CasnapCheckpointIO(), max_epochs=3, save_last="link")
    trainer.fit(_model(), _data())
    folder = tmp_path / "ckpt"
    last = folder / "last.ckpt"
    assert os.path.islink(last)
    assert os.path.realpath(last) == str(folder / "epoch=2-step=12.ckpt")
    # The link is a file name only: removing it never deletes the snapshot it points at.
    repo = casnap.Repository(str(folder))
    assert "epoch=2-step=12.ckpt" in repo.snapshots()

    resumed, _ = _trainer(tmp_path, CasnapCheckpointIO(), max_epochs=4, save_last="link")
    resumed.fit(_model(), _data(), ckpt_path="last")
    assert resumed.global_step == 16
    assert _files(folder) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    assert os.path.realpath(last) == str(folder / "epoch=3-step=16.ckpt")
    assert repo.snapshots() == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]


def test_resaving_one_path_keeps_one_snapshot(tmp_path):
    # save_last=True writes last.ckpt again at every save: one snapshot stays, the
    # pointer moves to each new one, and the replaced ones are reclaimed.
    trainer, _ = _trainer(
        tmp_path, CasnapCheckpointIO(), max_epochs=4, save_top_k=1, save_last=True
    )
    trainer.fit(_model(), _data())
    folder = tmp_path / "ckpt"
    assert _files(folder) == ["epoch=3-step=16.ckpt", "last.ckpt"]
    repo = casnap.Repository(str(folder))
    names = repo.snapshots()
    assert len(names) == 2 and names[0] == "epoch=3-step=16.ckpt"
    assert names[1].startswith("last.ckpt")
    assert checkpoint_snapshot(str(folder / "last.ckpt")).metadata["step"] == 16
    assert repo.du().unreferenced.bytes == 0


def test_async_checkpoint_io_wrapping_casnap(tmp_path):
    plugin = CasnapCheckpointIO()
    trainer, ckpt = _trainer(tmp_path, AsyncCheckpointIO(plugin), max_epochs=4)
    trainer.fit(_model(), _data())  # AsyncCheckpointIO.teardown waits for the last save
    plugin.teardown()  # the wrapper does not forward teardown: reclaim what a save deferred
    folder = tmp_path / "ckpt"
    assert _files(folder) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    repo = casnap.Repository(str(folder))
    assert repo.snapshots() == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    assert repo.du().unreferenced.bytes == 0

    resumed, _ = _trainer(tmp_path, AsyncCheckpointIO(CasnapCheckpointIO()), max_epochs=5)
    resumed.fit(_model(), _data(), ckpt_path=ckpt.best_model_path)
    assert resumed.global_step == 20


def test_loads_and_removes_torch_checkpoints_from_before_the_switch(tmp_path):
    trainer, ckpt = _trainer(tmp_path, TorchCheckpointIO(), max_epochs=1)
    trainer.fit(_model(), _data())
    old = ckpt.best_model_path
    plugin = CasnapCheckpointIO()
    assert plugin.load_checkpoint(old)["global_step"] == 4

    resumed, _ = _trainer(tmp_path, plugin, max_epochs=4)
    resumed.fit(_model(), _data(), ckpt_path=old)
    folder = tmp_path / "ckpt"
    # The torch.save file was the resume path: Lightning keeps it, as it always does.
    assert _files(folder) == ["epoch=0-step=4.ckpt", "epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    plugin.remove_checkpoint(old)
    assert not os.path.exists(old)


def test_missing_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        CasnapCheckpointIO().load_checkpoint(str(tmp_path / "ckpt" / "nothing.ckpt"))
