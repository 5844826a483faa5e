"""A DeepSpeed ``CheckpointEngine`` that stores each checkpoint as one casnap snapshot.

Example::

    import deepspeed
    from casnap.integrations.deepspeed import CasnapCheckpointEngine

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    engine.checkpoint_engine = CasnapCheckpointEngine()      # the one line to add
    engine.save_checkpoint("/ckpt/run1")                     # tag global_step<N>, as before
    engine.load_checkpoint("/ckpt/run1")                     # the tag in "latest", as before

DeepSpeed chooses its engine by a fixed chain (``create_checkpoint_engine``)
and reads ``engine.checkpoint_engine`` at each use, so it is replaced after
``deepspeed.initialize``. Each ``save_checkpoint(save_dir, tag)`` becomes
snapshot ``tag`` of the repository ``save_dir``: every rank's files
(``mp_rank_00_model_states.pt``, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``)
are held until :meth:`CasnapCheckpointEngine.commit`, where the ranks take the
snapshot together; then each rank leaves a pointer file
(:mod:`casnap.integrations.pointer`) at each path DeepSpeed asked to write, so
its globs and ``latest`` file (written by DeepSpeed after ``commit``) keep
working. docs/deepspeed.md has the details.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from torch.utils._pytree import tree_map_only

from casnap.api.repository import Repository
from casnap.api.snapshot import Snapshot
from casnap.errors import ArgumentTypeError, SnapshotNotFoundError, expect_type
from casnap.format.names import escape_key
from casnap.integrations.pointer import (
    Pointer,
    Retirer,
    read_pointer,
    replace_file,
    retire_unpointed,
    take_versioned,
    write_pointer,
)
from casnap.take.session import Session
from casnap.torch_io.stateful import StateDict

log = logging.getLogger(__name__)

__all__ = ["ENGINE_NAME", "POINTER_KIND", "CasnapCheckpointEngine", "checkpoint_snapshot"]

ENGINE_NAME = "CasnapCheckpointEngine"
POINTER_KIND = "deepspeed-checkpoint"
_META = "deepspeed"  # the metadata key of a snapshot this engine took: {"tag": tag}


def checkpoint_snapshot(path: str) -> tuple[Snapshot, str]:
    """The snapshot a DeepSpeed checkpoint file names, and the file's key in it.

    For reading a checkpoint outside DeepSpeed::

        snap, key = checkpoint_snapshot("/ckpt/run1/global_step10/mp_rank_00_model_states.pt")
        module = snap.read_object(f"{key}/module", allow_pickle=True)
    """
    pointer = read_pointer(path, POINTER_KIND)
    if pointer is None:
        raise ArgumentTypeError(f"{path}: not a casnap DeepSpeed checkpoint file", path)
    return _snapshot_key(path, pointer)


def _snapshot_key(path: str, pointer: Pointer) -> tuple[Snapshot, str]:
    snap = pointer.open_current(path).snapshot(pointer.snapshot)
    name = escape_key(os.path.basename(path))
    for key in snap.get_manifest():  # which rank saved this file: "<rank>/<file>/..."
        rank, _, rest = key.partition("/")
        if rest == name or rest.startswith(f"{name}/"):
            return snap, f"{rank}/{name}"
    raise SnapshotNotFoundError(f"{path}: snapshot {pointer.snapshot!r} holds no such file", path)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CasnapCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """DeepSpeed checkpoints as deduplicated, verified casnap snapshots.

    ``allow_pickle`` (default True: DeepSpeed's own engine loads with
    ``weights_only=False``, and its states hold ``torch.Size``, loss scalers and
    fragment addresses) stores the values that are not tensors, primitives or
    containers. ``keep_last`` (DeepSpeed has no retention of its own) removes,
    after each commit, the tag folders and snapshots of all but the newest
    ``keep_last`` checkpoints; without it, a tag folder removed by hand or by
    a wrapper's rotation (the Hugging Face Trainer's ``save_total_limit``) has
    its snapshot deleted and its space reclaimed at the next commit.
    ``memory_budget_bytes`` bounds the in-flight copies of a take or read.

    Every rank of the data-parallel world calls :meth:`commit` (DeepSpeed
    does, in ``save_checkpoint``), which is a collective take.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        allow_pickle: bool = True,
        keep_last: int | None = None,
        memory_budget_bytes: int | None = None,
    ) -> None:
        super().__init__(config_params)
        expect_type(allow_pickle, bool, "allow_pickle", "True or False")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ArgumentTypeError(f"keep_last must be a positive int, got {keep_last!r}")
        self.name = ENGINE_NAME
        self.allow_pickle = allow_pickle
        self.keep_last = keep_last
        self.memory_budget_bytes = memory_budget_bytes
        self._session = Session()
        self._retirer = Retirer()
        self._info: CheckpointCommitInfo | None = None
        self._files: dict[str, Any] = {}  # path -> state dict, this rank's since create()
        self._read: dict[tuple[str, Pointer], tuple[Snapshot, str]] = {}  # what load found

    # -- saving ----------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """Start checkpoint ``info.tag``: what :meth:`save` is given until :meth:`commit`."""
        self._info = info
        self._files = {}

    def save(self, state_dict: Any, path: str) -> None:
        """Hold ``state_dict`` for the snapshot; it is taken at :meth:`commit`.

        DeepSpeed runs no training step between its saves and ``commit`` (both in
        ``save_checkpoint``), so the live tensors it hands over still hold the
        checkpoint's values when the take reads them.
        """
        if self._info is None:
            raise ArgumentTypeError(f"save({path!r}) before create(): not called by DeepSpeed?")
        self._files[os.fspath(path)] = state_dict

    def preserves_storage_sharing(self) -> bool:
        return False  # a snapshot stores a view's bytes only: DeepSpeed need not clone

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Take the snapshot (every rank), then point each file's path at it (each rank its own).

        The snapshot's ref is the commit point: killed before it, nothing of
        this checkpoint is visible and DeepSpeed has not yet written ``latest``.
        """
        files, self._files, self._info = self._files, {}, None
        folder = os.path.join(info.save_dir, info.tag)
        rank, world = _world()
        app_state = {os.path.basename(p): StateDict(sd) for p, sd in files.items()}
        metadata: dict[str, Any] = {_META: {"tag": info.tag}}
        step = _global_steps(files)
        if step is not None:
            metadata["step"] = step
        old = self._pointers(folder) if rank == 0 else set()
        snap = take_versioned(
            folder,
            app_state,
            metadata=metadata,
            allow_pickle=self.allow_pickle,
            memory_budget_bytes=self.memory_budget_bytes,
            session=self._session,
        )
        pointer = Pointer(snap.repository.url, snap.name, snap.manifest_hash)
        for path in files:
            write_pointer(path, pointer, POINTER_KIND)
        if world > 1:
            dist.barrier()  # every rank's pointers name the new snapshot before any retiring
        if rank == 0 and info.save_latest:
            # DeepSpeed writes ``latest`` next, not synced: a power cut could leave it
            # empty (a new file's data is written back later). Written durably first,
            # its rewrite by DeepSpeed truncates a file ext4 then writes back on close.
            replace_file(os.path.join(info.save_dir, "latest"), info.tag.encode())
        if rank == 0:
            repo = snap.repository
            for stale in old - {(pointer.repository, pointer.snapshot)}:
                self._retirer.retire(repo, stale[1], None)
            self._sync(repo, info.save_dir, snap.name.removesuffix(snap.name.split("/")[-1]))
        return True

    @staticmethod
    def _pointers(folder: str) -> set[tuple[str, str]]:
        """(repository, snapshot) of the pointers in ``folder`` now."""
        found = set()
        if os.path.isdir(folder):
            for entry in os.scandir(folder):
                if entry.is_file() and entry.stat().st_size < 4096:
                    p = read_pointer(entry.path, POINTER_KIND)
                    if p is not None:
                        found.add((p.repository, p.snapshot))
        return found

    def _sync(self, repo: Repository, save_dir: str, prefix: str) -> None:
        """Retire the snapshots whose tag folder is gone or points elsewhere; apply keep_last."""

        def pointed(name: str, meta: dict[str, Any]) -> bool:
            tag = meta.get("tag")
            folder = os.path.join(save_dir, tag) if isinstance(tag, str) else ""
            return isinstance(tag, str) and (repo.url, name) in self._pointers(folder)

        live = retire_unpointed(repo, self._retirer, _META, prefix, pointed)
        if self.keep_last is not None and len(live) > self.keep_last:
            for name in live[: len(live) - self.keep_last]:  # oldest first
                tag = repo.snapshot(name).metadata[_META]["tag"]
                shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
                self._retirer.retire(repo, name, None)

    # -- loading ---------------------------------------------------------------
    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict saved at ``path``, every chunk verified as it is read.

        A file that is not a casnap pointer (a checkpoint from before the
        switch) is loaded with ``torch.load``, as DeepSpeed's own engine does.
        """
        path = os.fspath(path)
        pointer = read_pointer(path, POINTER_KIND)
        if pointer is None:
            return torch.load(path, map_location=map_location, weights_only=False)
        if (path, pointer) not in self._read:  # a re-save moves the pointer: looked up anew
            self._read[(path, pointer)] = _snapshot_key(path, pointer)
        snap, key = self._read[(path, pointer)]
        state = snap.read_object(
            key, memory_budget_bytes=self.memory_budget_bytes, allow_pickle=self.allow_pickle
        )
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        if device is None or torch.device(device).type == "cpu":
            return state  # read to CPU; a callable map_location is DeepSpeed's "stay put"
        return tree_map_only(torch.Tensor, lambda t: t.to(device), state)

    def cleanup(self) -> None:
        """Finish the reclaims earlier commits had to defer (waiting for them this time)."""
        self._retirer.flush(wait_seconds=60.0)


def _global_steps(files: dict[str, Any]) -> int | None:
    for state in files.values():
        if isinstance(state, dict) and isinstance(state.get("global_steps"), int):
            return int(state["global_steps"])
    return None
