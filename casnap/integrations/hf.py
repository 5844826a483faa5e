"""Hugging Face ``Trainer`` checkpoints as deduplicated, verified casnap snapshots.

Example::

    from casnap.integrations.hf import CasnapTrainer     # a transformers.Trainer

    args = TrainingArguments(output_dir="/ckpt/run1", save_steps=500, save_total_limit=2)
    trainer = CasnapTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    trainer.train(resume_from_checkpoint=True)          # or ".../checkpoint-1000"

For a subclass of ``Trainer`` (``Seq2SeqTrainer``, TRL's ``SFTTrainer``), mix
:class:`CasnapTrainerMixin` in first: ``class MyTrainer(CasnapTrainerMixin, SFTTrainer)``.

``output_dir/checkpoint-N`` becomes snapshot ``checkpoint-N`` of the repository
``output_dir``; the directory keeps the small files Hugging Face's tools read
and a ``casnap.json`` pointer, so ``get_last_checkpoint``, resuming and
``save_total_limit`` work unchanged (docs/lightning-hf.md). Single-process
training; with DeepSpeed, FSDP or several processes the Trainer's own
checkpointing runs unchanged (a warning says so).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from casnap.api.snapshot import Snapshot
from casnap.integrations.pointer import (
    Pointer,
    Retirer,
    read_pointer,
    take_versioned,
    write_pointer,
)
from casnap.integrations.rng import NumpyRNGState
from casnap.take.session import Session
from casnap.torch_io.stateful import RNGState

log = logging.getLogger(__name__)

__all__ = ["POINTER_FILE", "POINTER_KIND", "CasnapTrainer", "CasnapTrainerMixin", "NumpyRNGState"]

POINTER_KIND = "hf-checkpoint"
POINTER_FILE = "casnap.json"  # in each checkpoint-N directory
_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)(@\d+)?$")


class _CasnapState:
    """What the mixin keeps between saves: lineage and the reclaims still to do."""

    def __init__(self) -> None:
        self.session = Session()
        self.retirer = Retirer()
        self.writing_files = True  # False inside _save_checkpoint: the snapshot holds the state
        self.snapshots: dict[str, Snapshot] = {}  # checkpoint dir -> its snapshot, when read


class CasnapTrainerMixin:
    """Makes a ``transformers.Trainer`` (subclass) checkpoint into casnap; mix in first.

    ``casnap_allow_pickle`` (class attribute, default False) permits pickled
    values in the state (a custom scheduler holding a Python object).
    """

    casnap_allow_pickle: bool = False

    # -- helpers ---------------------------------------------------------------
    def _casnap(self) -> _CasnapState:
        state = self.__dict__.get("_casnap_state")
        if state is None:
            state = self.__dict__["_casnap_state"] = _CasnapState()
        return state

    def _casnap_enabled(self) -> bool:
        t: Any = self
        if t.is_deepspeed_enabled or t.is_fsdp_enabled or t.args.world_size > 1:
            log.warning(
                "casnap: DeepSpeed, FSDP or several processes: the Trainer's own "
                "checkpointing is used"
            )
            return False
        return True

    def _casnap_app_state(self, full: bool) -> dict[str, Any]:
        t: Any = self
        state: dict[str, Any] = {"model": t.accelerator.unwrap_model(t.model)}
        if full:
            if t.optimizer is not None:
                state["optimizer"] = t.optimizer
            if t.lr_scheduler is not None:
                state["scheduler"] = t.lr_scheduler
            if t.accelerator.scaler is not None:
                state["scaler"] = t.accelerator.scaler
            state["rng"] = RNGState()
            state["numpy_rng"] = NumpyRNGState()
        return state

    def _casnap_snapshot(self, checkpoint: str | None) -> Snapshot | None:
        """The snapshot of a checkpoint directory with a pointer, else None (a plain one)."""
        if checkpoint is None:
            return None
        cache = self._casnap().snapshots
        if checkpoint in cache:
            return cache[checkpoint]
        pointer_path = os.path.join(checkpoint, POINTER_FILE)
        if not os.path.isfile(pointer_path):
            return None
        pointer = read_pointer(pointer_path, POINTER_KIND)
        if pointer is None:
            return None
        repo = pointer.open_current(checkpoint)
        path = f"{repo.url.rstrip('/')}/{pointer.snapshot}"
        snap = Snapshot(path, repository=repo, session=self._casnap().session)
        cache[checkpoint] = snap
        return snap

    def _casnap_restore(self, checkpoint: str | None, keys: list[str]) -> bool:
        """Restore ``keys`` of the app state from ``checkpoint``'s snapshot; False if plain."""
        snap = self._casnap_snapshot(checkpoint)
        if snap is None:
            return False
        stored = snap.get_manifest()
        state = self._casnap_app_state(full=True)
        wanted = {k: state[k] for k in keys if k in state and f"0/{k}" in stored}
        if wanted:
            snap.restore(wanted, allow_pickle=self.casnap_allow_pickle)
        return True

    # -- saving ----------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        if not self._casnap_enabled():
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        run_dir = t._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}")
        if t.args.should_save:
            self._casnap_take(folder, full=not t.args.save_only_model)
        casnap = self._casnap()
        casnap.writing_files = False
        try:  # trainer_state.json, best checkpoint, rotation: the Trainer's own code
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            casnap.writing_files = True
        if t.args.should_save:
            self._casnap_sync(run_dir, folder)

    def _casnap_take(self, folder: str, *, full: bool) -> None:
        t: Any = self
        os.makedirs(folder, exist_ok=True)
        pointer_path = os.path.join(folder, POINTER_FILE)
        old = read_pointer(pointer_path, POINTER_KIND) if os.path.isfile(pointer_path) else None
        metadata = {"step": int(t.state.global_step), "epoch": float(t.state.epoch or 0.0)}
        if t.state.best_metric is not None:
            metadata["best_metric"] = float(t.state.best_metric)
        snap = take_versioned(
            folder,
            self._casnap_app_state(full),
            metadata=metadata,
            allow_pickle=self.casnap_allow_pickle,
            session=self._casnap().session,
        )
        repo = snap.repository
        # Written before trainer_state.json: a directory the Trainer would resume
        # from always has its pointer.
        write_pointer(pointer_path, Pointer(repo.url, snap.name, snap.manifest_hash), POINTER_KIND)
        self._casnap().snapshots.pop(folder, None)
        if old is not None and (old.repository, old.snapshot) != (repo.url, snap.name):
            self._casnap().retirer.retire(old.open_repository(), old.snapshot, old.manifest)

    def _casnap_sync(self, run_dir: str, folder: str) -> None:
        """Retire the snapshots whose checkpoint directories rotation deleted (or re-pointed)."""
        pointer = read_pointer(os.path.join(folder, POINTER_FILE), POINTER_KIND)
        if pointer is None:
            return
        repo = pointer.open_repository()
        prefix = pointer.snapshot.rsplit("/", 1)[0] + "/" if "/" in pointer.snapshot else ""
        for name in repo.snapshots():
            base = name[len(prefix) :]
            if not name.startswith(prefix) or "/" in base or not _NAME.match(base):
                continue
            directory = os.path.join(run_dir, base.split("@", 1)[0])
            path = os.path.join(directory, POINTER_FILE)
            live = read_pointer(path, POINTER_KIND) if os.path.isfile(path) else None
            if live is None or live.snapshot != name:
                self._casnap().retirer.retire(repo, name, None)
                self._casnap().snapshots.pop(directory, None)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; inside a casnap checkpoint only the model's config."""
        if self._casnap().writing_files or not _internal_call:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        t: Any = self
        if t.args.should_save and output_dir is not None:
            os.makedirs(output_dir, exist_ok=True)
            config = getattr(t.accelerator.unwrap_model(t.model), "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._casnap().writing_files:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _save_scaler(self, output_dir: str) -> None:
        if self._casnap().writing_files:
            super()._save_scaler(output_dir)  # type: ignore[misc]

    def _save_rng_state(self, output_dir: str) -> None:
        if self._casnap().writing_files:
            super()._save_rng_state(output_dir)  # type: ignore[misc]

    # -- resuming --------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if model is not None or not self._casnap_restore(resume_from_checkpoint, ["model"]):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._casnap_restore(checkpoint, ["optimizer", "scheduler"]):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._casnap_restore(checkpoint, ["scaler"]):
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._casnap_restore(checkpoint, ["rng", "numpy_rng"]):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        t: Any = self
        if not self._casnap_restore(t.state.best_model_checkpoint, ["model"]):
            super()._load_best_model()  # type: ignore[misc]


class CasnapTrainer(CasnapTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are casnap snapshots (see the module doc)."""
