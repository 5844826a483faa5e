"""Hugging Face Accelerate's ``save_state`` / ``load_state`` as casnap snapshots.

Example::

    from accelerate.utils import ProjectConfiguration
    from casnap.integrations.accelerate import CasnapAccelerator   # an accelerate.Accelerator

    config = ProjectConfiguration("/ckpt/run1", automatic_checkpoint_naming=True, total_limit=3)
    accelerator = CasnapAccelerator(project_config=config)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.save_state()           # /ckpt/run1/checkpoints/checkpoint_<i>
    accelerator.load_state()           # the newest complete one

``.../checkpoints/checkpoint_3`` becomes snapshot ``checkpoint_3`` of the
repository ``.../checkpoints``; the folder keeps a ``casnap.json`` pointer
(:mod:`casnap.integrations.pointer`). ``total_limit`` rotates the folders as
Accelerate does and their snapshots go with them. Models, optimizers,
schedulers, data loader states, the gradient scaler, objects registered with
``register_for_checkpointing``, each process's RNG states and ``step`` are in
the snapshot; the save and load pre-hooks run as in Accelerate. Single
process, DDP (several processes, any device) and FSDP2 with sharded state
dicts (the models and optimizers in a DCP snapshot ``<S>.fsdp`` beside the
folder's snapshot ``S``, :mod:`casnap.integrations.accelerate_fsdp`); with FSDP1, a full FSDP state
dict, DeepSpeed, Megatron-LM or XLA Accelerate's own ``save_state`` runs (a
warning says so; docs/accelerate.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from casnap.api.snapshot import Snapshot
from casnap.errors import ConfigError
from casnap.integrations import accelerate_fsdp
from casnap.integrations.pointer import (
    Pointer,
    Retirer,
    read_pointer,
    retire_unpointed,
    take_versioned,
    write_pointer,
)
from casnap.integrations.rng import NumpyRNGState
from casnap.take.session import Session
from casnap.torch_io.stateful import RNGState, StateDict

log = logging.getLogger(__name__)

__all__ = ["POINTER_FILE", "POINTER_KIND", "CasnapAccelerator", "CasnapAcceleratorMixin"]

POINTER_KIND = "accelerate-checkpoint"
POINTER_FILE = "casnap.json"  # in each checkpoint folder
_META = "accelerate"  # metadata of a snapshot this integration took: {"folder": name}
_SUPPORTED = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_SDAA,
}


def _number(name: str) -> int | None:
    """Accelerate's order of checkpoint folders: the first number in the name."""
    found = re.findall(r"[0-9]+", name)
    return int(found[0]) if found else None


def checkpoint_folders(root: str) -> list[str]:
    """The folders automatic naming made under ``root``, oldest first (``.casnap`` is not one)."""
    if not os.path.isdir(root):
        return []
    names = [
        n
        for n in os.listdir(root)
        if not n.startswith(".") and _number(n) is not None and os.path.isdir(os.path.join(root, n))
    ]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: _number(n) or 0)]


def _pointer(folder: str) -> Pointer | None:
    path = os.path.join(folder, POINTER_FILE)
    return read_pointer(path, POINTER_KIND) if os.path.isfile(path) else None


class _Weights:
    """A model's state dict as Accelerate hands it to the save hooks, and its loading."""

    def __init__(self, weights: dict[str, Any] | None, model: Any, kwargs: dict[str, Any]) -> None:
        self.weights, self.model, self.kwargs = weights, model, kwargs

    def state_dict(self) -> dict[str, Any]:
        assert self.weights is not None
        return self.weights

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state, **self.kwargs)


class CasnapAcceleratorMixin:
    """Makes an ``accelerate.Accelerator`` (subclass) save and load state through casnap.

    ``casnap_allow_pickle`` (class attribute, default False) permits pickled
    values in the state (a scheduler or registered object holding a Python object).
    """

    casnap_allow_pickle: bool = False

    def _casnap(self) -> tuple[Session, Retirer]:
        found = self.__dict__.get("_casnap_parts")
        if found is None:
            found = self.__dict__["_casnap_parts"] = (Session(), Retirer(), Session())
        return found[0], found[1]

    def _casnap_fsdp_session(self) -> Session:
        self._casnap()
        session: Session = self.__dict__["_casnap_parts"][2]
        return session

    def _casnap_enabled(self) -> bool:
        a: Any = self
        if a.distributed_type in _SUPPORTED or accelerate_fsdp.handled(a):
            return True
        log.warning("casnap: %s: Accelerate's own save_state is used", a.distributed_type)
        return False

    # -- saving ----------------------------------------------------------------
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Any:
        """Take the state as a snapshot named by the checkpoint folder; point the folder at it.

        With ``automatic_checkpoint_naming`` the folder is Accelerate's
        ``checkpoint_<iteration>`` and ``total_limit`` removes the oldest
        folders first, as Accelerate does. Every process calls it.
        """
        if not self._casnap_enabled():
            return super().save_state(output_dir, safe_serialization, **kwargs)  # type: ignore[misc]
        a: Any = self
        folder = self._casnap_folder(output_dir)
        fsdp = accelerate_fsdp.handled(a)
        # Under FSDP Accelerate's hooks see no weights too (the shards go by DCP).
        weights = [] if fsdp else [a.get_state_dict(m, unwrap=False) for m in a._models]
        for hook in a._save_model_state_pre_hook.values():
            hook(a._models, weights, folder)  # a hook may pop weights it saves itself
        step = int(a.step)
        meta = {"step": step, _META: {"folder": os.path.basename(folder)}}
        state: dict[str, Any] = {"rng": RNGState(), "numpy_rng": NumpyRNGState()}
        state["accelerate"] = StateDict(step=step)
        if a.is_main_process:
            state |= self._casnap_shared(weights, fsdp)
        session, retirer = self._casnap()
        old = _pointer(folder) if a.is_main_process else None
        snap = take_versioned(
            folder,
            state,
            metadata=meta,
            allow_pickle=self.casnap_allow_pickle,
            session=session,
        )
        if fsdp:  # snapshot <name>.fsdp, before the pointer names <name>
            path = accelerate_fsdp.fsdp_path(folder, snap.name)
            accelerate_fsdp.save(a, path, meta, self._casnap_fsdp_session())
        if a.is_main_process:
            pointer = Pointer(snap.repository.url, snap.name, snap.manifest_hash)
            write_pointer(os.path.join(folder, POINTER_FILE), pointer, POINTER_KIND)
            if old is not None and (old.repository, old.snapshot) != (
                pointer.repository,
                snap.name,
            ):
                retirer.retire(old.open_repository(), old.snapshot, old.manifest)
            self._casnap_sync(snap, os.path.dirname(folder))
        a.wait_for_everyone()
        a.project_configuration.iteration += 1
        return Path(folder)

    def _casnap_folder(self, output_dir: str | None) -> str:
        a: Any = self
        config = a.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ConfigError("save_state: no output_dir and automatic naming is off")
            folder = os.fspath(output_dir)
            os.makedirs(folder, exist_ok=True)
            return folder
        root = os.path.join(a.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        folders = checkpoint_folders(root)
        limit = config.total_limit
        if limit is not None and len(folders) + 1 > limit and a.is_main_process:
            for old in folders[: len(folders) + 1 - limit]:
                shutil.rmtree(old)  # its snapshot is retired after this save
        folder = os.path.join(root, f"checkpoint_{a.save_iteration}")
        if os.path.exists(folder):
            raise ValueError(
                f"Checkpoint directory {folder} ({a.save_iteration}) already exists. Please "
                "manually override `self.save_iteration` with what iteration to start with."
            )
        a.wait_for_everyone()
        os.makedirs(folder, exist_ok=True)
        return folder

    def _casnap_shared(self, weights: list[Any], fsdp: bool) -> dict[str, Any]:
        """What the main process saves for all (Accelerate's files without a rank in the name)."""
        a: Any = self
        state: dict[str, Any] = {}
        for i, w in enumerate(weights):
            state[f"model_{i}"] = StateDict(w)
        for i, opt in enumerate([] if fsdp else a._optimizers):
            state[f"optimizer_{i}"] = opt
        for i, sched in enumerate(a._schedulers):
            state[f"scheduler_{i}"] = sched
        for i, loader in enumerate(a._dataloaders):
            if getattr(loader, "use_stateful_dataloader", False):
                state[f"dataloader_{i}"] = StateDict(loader.state_dict())
            sampler = _seedable_sampler(loader)
            if sampler is not None:
                state[f"sampler_{i}"] = StateDict(epoch=sampler.epoch, seed=sampler.initial_seed)
        if a.scaler is not None:
            state["scaler"] = a.scaler
        for i, obj in enumerate(a._custom_objects):
            state[f"custom_{i}"] = obj
        return state

    def _casnap_sync(self, snap: Snapshot, root: str) -> None:
        """Retire the snapshots whose folder rotation removed (or a re-save re-pointed)."""
        repo = snap.repository
        prefix = snap.name.removesuffix(snap.name.split("/")[-1])

        def pointed(name: str, meta: dict[str, Any]) -> bool:
            folder = meta.get("folder")
            p = _pointer(os.path.join(root, folder)) if isinstance(folder, str) else None
            if p is None or p.repository != repo.url:
                return False
            return name in (p.snapshot, p.snapshot + accelerate_fsdp.SUFFIX)

        retire_unpointed(repo, self._casnap()[1], _META, prefix, pointed)

    # -- loading ---------------------------------------------------------------
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Restore what :meth:`save_state` took, every chunk verified as it is read.

        ``input_dir=None`` with automatic naming picks the newest folder whose
        snapshot is complete (one a killed save left has no pointer). A folder
        without a pointer (Accelerate's own files) is loaded by Accelerate.
        """
        a: Any = self
        if input_dir is None and a.project_configuration.automatic_checkpoint_naming:
            folders = checkpoint_folders(os.path.join(a.project_dir, "checkpoints"))
            complete = [f for f in folders if _pointer(f) is not None]
            if complete or folders:
                input_dir = (complete or folders)[-1]
        pointer = _pointer(os.fspath(input_dir)) if input_dir is not None else None
        if pointer is None or not self._casnap_enabled():
            super().load_state(input_dir, load_kwargs, **kwargs)  # type: ignore[misc]
            return
        assert input_dir is not None
        repo = pointer.open_current(input_dir)
        snap = repo.snapshot(pointer.snapshot)
        models = list(a._models)
        for hook in a._load_model_state_pre_hook.values():
            hook(models, input_dir)  # a hook may remove models it loads itself
        kwargs.pop("map_location", None)  # tensors are restored in place, on their device
        shared: dict[str, Any] = {}
        entries = {k.split("/", 2)[1] for k in snap.get_manifest() if k.startswith("0/")}
        if accelerate_fsdp.handled(a):
            if "model_0" in entries:
                raise ConfigError(f"{snap.name} was saved without FSDP: load it without FSDP")
            path = accelerate_fsdp.fsdp_path(os.fspath(input_dir), pointer.snapshot)
            accelerate_fsdp.load(a, path, models)
        else:
            shared |= {f"model_{i}": _Weights(None, m, kwargs) for i, m in enumerate(models)}
            shared |= {f"optimizer_{i}": o for i, o in enumerate(a._optimizers)}
        shared |= {f"scheduler_{i}": s for i, s in enumerate(a._schedulers)}
        if a.scaler is not None:
            shared["scaler"] = a.scaler
        shared |= {f"custom_{i}": o for i, o in enumerate(a._custom_objects)}
        for key, target in shared.items():
            self._casnap_read(snap, f"0/{key}", target, key in entries)
        for i, loader in enumerate(a._dataloaders):
            if getattr(loader, "use_stateful_dataloader", False) and f"dataloader_{i}" in entries:
                loader.load_state_dict(self._casnap_object(snap, f"0/dataloader_{i}"))
            sampler = _seedable_sampler(loader)
            if sampler is not None and f"sampler_{i}" in entries:
                saved = self._casnap_object(snap, f"0/sampler_{i}")
                sampler.epoch, sampler.initial_seed = saved["epoch"], saved["seed"]
        rank = a.process_index
        own = {"rng": RNGState(), "numpy_rng": NumpyRNGState()}
        for key, target in own.items():
            self._casnap_read(snap, f"{rank}/{key}", target, True)
        a.step = int(self._casnap_object(snap, f"{rank}/accelerate")["step"])

    def _casnap_object(self, snap: Snapshot, key: str) -> Any:
        return snap.read_object(key, allow_pickle=self.casnap_allow_pickle)

    def _casnap_read(self, snap: Snapshot, key: str, target: Any, present: bool) -> None:
        if not present:
            raise ConfigError(
                f"{snap.name} holds no {key.split('/', 1)[1]}: it was saved with other "
                "models, optimizers, schedulers or registered objects than are prepared now"
            )
        target.load_state_dict(self._casnap_object(snap, key))


def _seedable_sampler(loader: Any) -> Any:
    """The sampler Accelerate saves for a data loader (as it does: iterable shards only)."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    if isinstance(getattr(loader, "dataset", None), IterableDatasetShard):
        sampler = loader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            return sampler
    return None


class CasnapAccelerator(CasnapAcceleratorMixin, Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` use casnap (module doc)."""
