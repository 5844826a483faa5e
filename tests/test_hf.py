"""CasnapTrainer with a real transformers.Trainer on CPU (casnap.integrations.hf)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import casnap  # noqa: E402
from casnap.integrations.hf import POINTER_FILE, CasnapTrainer  # noqa: E402

MAX_STEPS = 8


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    # Nothing may reach the network or the home directory.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (48, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)  # dropout 0.1: the resumed run needs the RNG state too


def _args(out, **kw) -> TrainingArguments:
    options: dict[str, Any] = (
        dict(
            output_dir=str(out),
            max_steps=MAX_STEPS,
            save_steps=2,
            save_total_limit=2,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to=[],
            use_cpu=True,
            logging_steps=100,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        | kw
    )
    return TrainingArguments(**options)


class _StopAt(TrainerCallback):
    """Ends training after ``step`` (a preemption, with the schedule of the full run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _checkpoints(out) -> list[str]:
    return sorted(
        (p for p in os.listdir(out) if p.startswith("checkpoint-")),
        key=lambda p: int(p.split("-")[1]),
    )


def test_saves_every_save_steps_keeps_total_limit_and_frees_space(tmp_path):
    out = tmp_path / "run"
    trainer = CasnapTrainer(model=_model(), args=_args(out), train_dataset=_Data())
    trainer.train()
    assert _checkpoints(out) == ["checkpoint-6", "checkpoint-8"]
    repo = casnap.Repository(str(out))
    assert repo.snapshots() == ["checkpoint-6", "checkpoint-8"]
    assert [line.step for line in repo.log()] == [6, 8]
    # The directories hold the small files HF's tools read, not the state.
    files = set(os.listdir(out / "checkpoint-8"))
    assert {"trainer_state.json", "config.json", POINTER_FILE} <= files
    assert not files & {"model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt"}
    keys = set(repo.show("checkpoint-8").entries)
    assert {"0/model", "0/optimizer", "0/scheduler", "0/rng", "0/numpy_rng"} <= keys
    # The two rotated-out snapshots are gone and their space freed at once.
    usage = repo.du()
    assert usage.unreferenced.bytes == 0
    assert repo.gc(grace_seconds=0).bytes_freed == 0
    assert repo.verify(read_data=True).ok


def test_resume_continues_as_an_uninterrupted_run(tmp_path):
    straight = Trainer(
        model=_model(), args=_args(tmp_path / "straight", save_strategy="no"), train_dataset=_Data()
    )
    straight.train()
    assert straight.model is not None
    expected = {k: v.clone() for k, v in straight.model.state_dict().items()}

    out = tmp_path / "run"
    first = CasnapTrainer(
        model=_model(), args=_args(out), train_dataset=_Data(), callbacks=[_StopAt(4)]
    )
    first.train()
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert first.model is not None
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}

    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            seen["step"] = state.global_step
            seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            seen["optim_steps"] = {
                s["step"].item() for s in optimizer.state_dict()["state"].values()
            }

    resumed = CasnapTrainer(
        model=_model(), args=_args(out), train_dataset=_Data(), callbacks=[Probe()]
    )
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint: checkpoint-4
    assert seen["step"] == 4
    for key, value in saved.items():
        assert torch.equal(seen["model"][key], value), key
    assert seen["optim_steps"] == {4.0}
    assert resumed.state.global_step == MAX_STEPS
    assert resumed.model is not None
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert _checkpoints(out) == ["checkpoint-6", "checkpoint-8"]
    assert casnap.Repository(str(out)).snapshots() == ["checkpoint-6", "checkpoint-8"]


def test_resumes_from_a_plain_trainer_checkpoint(tmp_path):
    out = tmp_path / "run"
    plain = Trainer(model=_model(), args=_args(out), train_dataset=_Data(), callbacks=[_StopAt(4)])
    plain.train()
    assert os.path.isfile(out / "checkpoint-4" / "model.safetensors")
    resumed = CasnapTrainer(model=_model(), args=_args(out), train_dataset=_Data())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert resumed.state.global_step == MAX_STEPS
    assert casnap.Repository(str(out)).snapshots() == ["checkpoint-6", "checkpoint-8"]
