"""A PyTorch Lightning ``CheckpointIO`` that stores checkpoints as casnap snapshots.

Example::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from casnap.integrations.lightning import CasnapCheckpointIO

    trainer = L.Trainer(plugins=[CasnapCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath="/ckpt/run1", save_top_k=2,
                                                   monitor="val_loss")])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="last")       # or a path ModelCheckpoint wrote

``/ckpt/run1/epoch=0-step=10.ckpt`` becomes snapshot ``epoch=0-step=10.ckpt``
of the repository ``/ckpt/run1``, and a pointer file
(:mod:`casnap.integrations.pointer`) is left at the path so that Lightning's
file checks keep working; docs/lightning-hf.md has the details.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from casnap.api.snapshot import Snapshot
from casnap.errors import (
    ArgumentTypeError,
    expect_type,
)
from casnap.integrations.pointer import (
    Pointer,
    Retirer,
    is_url,
    read_pointer,
    take_versioned,
    write_pointer,
)
from casnap.settings import take_overrides
from casnap.take.session import Session
from casnap.torch_io.stateful import StateDict

log = logging.getLogger(__name__)

__all__ = ["POINTER_KIND", "CasnapCheckpointIO", "checkpoint_snapshot"]

POINTER_KIND = "lightning-checkpoint"
_KEY = "checkpoint"  # the app_state key the whole checkpoint dict is stored under


def _fs_path(path: Any) -> str:
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


def _exists(path: str) -> bool:
    if is_url(path):
        import fsspec

        fs, stripped = fsspec.core.url_to_fs(path)
        return bool(fs.exists(stripped))
    return os.path.lexists(path)


def checkpoint_snapshot(path: str) -> Snapshot:
    """The snapshot a checkpoint path names: through its pointer file, else by casnap's rules.

    For reading a checkpoint outside a ``Trainer``::

        snap = checkpoint_snapshot("/ckpt/run1/epoch=0-step=10.ckpt")
        state_dict = snap.read_object("0/checkpoint/state_dict")
        model.load_state_dict(state_dict)
    """
    path = _fs_path(path)
    pointer = read_pointer(path, POINTER_KIND) if _exists(path) else None
    if pointer is None:
        return Snapshot(path)  # SnapshotNotFoundError (a FileNotFoundError) if none
    return pointer.open_current(path).snapshot(pointer.snapshot)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class CasnapCheckpointIO(CheckpointIO):
    """Lightning checkpoints as deduplicated, verified casnap snapshots.

    ``Trainer(plugins=[CasnapCheckpointIO()])`` and, for saving in a
    background thread, ``Trainer(plugins=[AsyncCheckpointIO(CasnapCheckpointIO())])``.
    ``allow_pickle`` stores (and loads, unless Lightning asks for
    ``weights_only=True``) values that are neither tensors, primitives nor
    containers; ``memory_budget_bytes`` bounds the in-flight copies;
    ``reclaim_wait_seconds`` is how long deleting a checkpoint waits for a save
    in flight; ``repository`` (a URL or a :class:`casnap.Repository`) names the
    repository and ``settings`` override the takes' settings, as for
    ``casnap.Snapshot.take``. ``save_checkpoint``'s ``storage_options`` (the
    store's, fsspec's) go to the take. A
    ``torch.save`` checkpoint from before the switch is loaded and removed as
    Lightning would (docs/lightning-hf.md, "Lightning: CasnapCheckpointIO").
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        memory_budget_bytes: int | None = None,
        reclaim_wait_seconds: float = 1.0,
        repository: Any = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        expect_type(allow_pickle, bool, "allow_pickle", "True or False")
        self.repository = repository
        self.settings = take_overrides(settings)
        self.allow_pickle = allow_pickle
        self.memory_budget_bytes = memory_budget_bytes
        self._session = Session()
        self._retirer = Retirer(reclaim_wait_seconds)
        self._lock = threading.Lock()
        self._saving: set[str] = set()  # paths whose save is running (AsyncCheckpointIO's thread)
        self._remove_after_save: set[str] = set()  # removed while their save was running
        # AsyncCheckpointIO saves in its own thread, in the order Lightning asked, and
        # may still hold saves queued when ModelCheckpoint removes one of them: a
        # removal of a path with no pointer yet, from a thread that never saved, is
        # remembered, and that path's queued save is skipped.
        self._save_threads: set[int] = set()
        self._removed_before_save: set[str] = set()

    # -- saving ------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Take ``checkpoint`` as a snapshot named by ``path``'s file name; point ``path`` at it.

        A path saved again (``last.ckpt``) gets a new snapshot (``last.ckpt@1``,
        then ``last.ckpt`` again, ...); the pointer moves to it atomically and
        the old one is deleted and reclaimed, so a crash at any point leaves a
        pointer to a complete checkpoint.
        """
        path = _fs_path(path)
        expect_type(checkpoint, dict, "checkpoint", "a dict")
        if storage_options is not None:
            expect_type(storage_options, dict, "storage_options", "a dict or None")
        with self._lock:
            self._save_threads.add(threading.get_ident())
            if path in self._removed_before_save:
                self._removed_before_save.discard(path)
                log.info("casnap: %s was removed before its queued save ran; not saved", path)
                return
            self._saving.add(path)
        try:
            self._save(checkpoint, path, storage_options)
        finally:
            with self._lock:
                self._saving.discard(path)
                removed = path in self._remove_after_save
                self._remove_after_save.discard(path)
        if removed:
            self.remove_checkpoint(path)
        self._retirer.flush()  # what earlier removals had to leave to a later reclaim

    def _save(self, checkpoint: dict[str, Any], path: str, storage_options: Any) -> None:
        old = (
            read_pointer(path, POINTER_KIND) if _exists(path) and not os.path.islink(path) else None
        )
        if not is_url(path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        metadata = {
            "step": int(checkpoint.get("global_step", 0)),
            "epoch": int(checkpoint.get("epoch", 0)),
            "lightning": {"path": os.path.basename(path)},
        }
        app_state = {_KEY: StateDict(checkpoint)}
        snap = take_versioned(
            path,
            app_state,
            storage_options=storage_options,
            settings=self.settings,
            repository=self.repository,
            metadata=metadata,
            allow_pickle=self.allow_pickle,
            memory_budget_bytes=self.memory_budget_bytes,
            session=self._session,
        )
        repo = snap.repository
        write_pointer(path, Pointer(repo.url, snap.name, snap.manifest_hash), POINTER_KIND)
        if old is not None and (old.repository, old.snapshot) != (repo.url, snap.name):
            self._retire(old)

    # -- loading -----------------------------------------------------------
    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict ``path`` names, every chunk verified as it is read.

        Tensors load to CPU, or to ``map_location`` when it is a device or a
        device string (Lightning moves the state to the model's device itself).
        A file that is not a casnap pointer is loaded by ``TorchCheckpointIO``.
        """
        path = _fs_path(path)
        if _exists(path) and read_pointer(path, POINTER_KIND) is None:
            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
        snap = checkpoint_snapshot(path)
        allow = self.allow_pickle and weights_only is not True
        checkpoint = snap.read_object(
            f"0/{_KEY}", memory_budget_bytes=self.memory_budget_bytes, allow_pickle=allow
        )
        if not isinstance(checkpoint, dict):
            raise ArgumentTypeError(f"{path}: snapshot holds no Lightning checkpoint", path)
        device = _device(map_location)
        return _to_device(checkpoint, device) if device is not None else checkpoint

    # -- removing ----------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: its pointer, its snapshot, and its space at once.

        A symbolic link (``save_last="link"``) is removed alone, as is a pointer
        whose snapshot another pointer in the directory still names (a copied
        ``last.ckpt``). A path whose save is still running in another thread
        (``AsyncCheckpointIO``) is removed when that save ends, and one whose
        save is still queued there is not saved at all.
        """
        path = _fs_path(path)
        with self._lock:
            if path in self._saving:
                self._remove_after_save.add(path)
                return
        if not _exists(path):
            with self._lock:
                if self._save_threads and threading.get_ident() not in self._save_threads:
                    self._removed_before_save.add(path)
            return
        if not is_url(path) and os.path.islink(path):
            os.remove(path)
            return
        pointer = read_pointer(path, POINTER_KIND)
        if pointer is None:  # a torch.save file: remove it as Lightning does
            TorchCheckpointIO().remove_checkpoint(path)
            return
        _remove_file(path)  # first: no pointer may name a snapshot that is gone
        if not self._named_elsewhere(path, pointer):
            self._retire(pointer)

    def _retire(self, pointer: Pointer) -> None:
        try:
            repo = pointer.open_repository()
        except FileNotFoundError:
            return
        self._retirer.retire(repo, pointer.snapshot, pointer.manifest)

    @staticmethod
    def _named_elsewhere(path: str, pointer: Pointer) -> bool:
        """Whether another pointer file beside ``path`` names the same snapshot."""
        if is_url(path):
            return False
        folder = os.path.dirname(os.path.abspath(path))
        for entry in os.scandir(folder):
            if entry.is_file() and entry.path != os.path.abspath(path):
                try:
                    if entry.stat().st_size > 4096:
                        continue
                    other = read_pointer(entry.path, POINTER_KIND)
                except OSError:
                    continue
                if other is not None and other == pointer:
                    return True
        return False

    def teardown(self) -> None:
        """Finish the reclaims deferred by saves in flight (waiting for them this time)."""
        self._retirer.flush(wait_seconds=60.0)

    @property
    def bytes_freed(self) -> int:
        """Bytes the removals of this plugin have freed so far."""
        return self._retirer.bytes_freed


def _remove_file(path: str) -> None:
    if is_url(path):
        import fsspec

        fs, stripped = fsspec.core.url_to_fs(path)
        fs.rm(stripped)
    else:
        os.remove(path)


_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|meta)(:\d+)?$")


def _device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, torch.device):
        return map_location
    if isinstance(map_location, str) and _DEVICE.match(map_location):
        return torch.device(map_location)
    if map_location is None or isinstance(map_location, (dict, Callable)):  # type: ignore[arg-type]
        return None  # storage-level remapping: tensors stay on CPU, Lightning moves them
    raise ArgumentTypeError(
        f"map_location must be a device, a device string, a dict or a callable, "
        f"got {map_location!r:.80}",
        "map_location",
    )
