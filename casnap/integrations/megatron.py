"""Megatron-core ``dist_checkpointing`` over casnap: a save and a load strategy.

Pass them where Megatron-core takes a sharded strategy and each
``dist_checkpointing.save`` becomes a casnap snapshot (docs/megatron.md)::

    from megatron.core import dist_checkpointing
    from casnap.integrations.megatron import CasnapLoadStrategy, CasnapSaveStrategy

    save_strategy = CasnapSaveStrategy()          # one per run: successive saves share chunks
    dist_checkpointing.save(model.sharded_state_dict(), "/ckpt/run1/iter_0000100",
                            sharded_strategy=save_strategy)
    state = dist_checkpointing.load(model.sharded_state_dict(), "/ckpt/run1/iter_0000100",
                                    sharded_strategy=CasnapLoadStrategy())

They keep Megatron's ``torch_dist`` translation and DCP planners and swap
DCP's file system writer and reader for casnap's
:class:`~casnap.integrations.dcp.CasnapWriter` and
:class:`~casnap.integrations.dcp.CasnapReader`; docs/megatron.md, "What a save
is", maps Megatron's objects to snapshot entries. Importing this module imports
Megatron-core (extra ``megatron``) and registers the strategies as Megatron's
defaults for the backend ``casnap``.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from casnap.chunks.frames import WriteStats
from casnap.errors import ConfigError, UnsupportedValueError
from casnap.integrations.dcp_reader import CasnapReader
from casnap.integrations.dcp_writer import HISTORY_SEP, CasnapWriter
from casnap.integrations.pointer import Pointer, read_pointer, write_pointer
from casnap.repo.locate import locate
from casnap.take.session import Session

__all__ = [
    "BACKEND",
    "COMMON_KEY",
    "POINTER_FILE",
    "VERSION",
    "CasnapLoadStrategy",
    "CasnapSaveStrategy",
    "register_casnap_strategies",
]

BACKEND = "casnap"  # metadata.json's sharded_backend
VERSION = 1
COMMON_KEY = "__megatron_common__.pt"  # the DCP key of common.pt's bytes in a snapshot
POINTER_FILE = "casnap.json"  # in the checkpoint directory: the snapshot it is
POINTER_KIND = "megatron-checkpoint"
MEGATRON_METADATA = "megatron"  # the key of this integration's record in a manifest's metadata
_ITERATION = re.compile(r"iter_(\d+)$")


def _dir(checkpoint_dir: str | os.PathLike[str]) -> str:
    path = os.fspath(checkpoint_dir)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"a Megatron checkpoint directory must be a path, got {path!r}")
    return path.rstrip("/") or path


def snapshot_path(checkpoint_dir: str | os.PathLike[str], repository: str | None) -> str:
    """The casnap snapshot path of a Megatron checkpoint directory.

    Without ``repository`` it is the directory itself (casnap's rules make its
    parent the repository); with one, the directory's last component below it.
    """
    path = _dir(checkpoint_dir)
    if repository is None:
        return path
    return f"{repository.rstrip('/')}/{os.path.basename(path)}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CasnapSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]
    """Save Megatron-core sharded state dicts as casnap snapshots (sync and async).

    ``repository``: where the snapshots go (a path or URL); by default the
    parent of each checkpoint directory. ``storage_options`` (the store's,
    fsspec's) and ``settings`` (``chunk_size``, ``compression``, ...): those of
    a casnap take. ``metadata``: JSON
    put into every manifest (``{"step": N}`` is added from an ``iter_N``
    directory name unless given). Keep one instance for the run: its session
    makes each save the child of the previous one and reuses staging buffers.

    After a save, ``last_write_stats`` says what this rank wrote
    (``stored_bytes_written`` is 0 for an unchanged re-save) and, on rank 0,
    ``last_manifest`` the manifest hash committed.

    Example::

        strategy = CasnapSaveStrategy()
        dist_checkpointing.save(sharded_sd, "/ckpt/run1/iter_0000100", sharded_strategy=strategy)
    """

    def __init__(
        self,
        repository: str | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        session: Session | None = None,
    ) -> None:
        super().__init__(BACKEND, VERSION)
        self.repository = repository
        self.storage_options = dict(storage_options or {})
        self.settings = dict(settings or {})
        self.metadata = dict(metadata or {})
        if MEGATRON_METADATA in self.metadata:
            raise UnsupportedValueError(f"metadata key {MEGATRON_METADATA!r} is the strategy's own")
        self.session = session if session is not None else Session()
        self.last_write_stats: WriteStats | None = None
        self.last_manifest: str | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    # -- Megatron's SaveShardedStrategy ------------------------------------
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """(all ranks) Save now: one DCP save through ``CasnapWriter``, then the pointer."""
        writer, state, planner = self.prepare(sharded_state_dict, checkpoint_dir)
        dcp_save(state, storage_writer=writer, planner=planner)
        self.last_write_stats = writer.last_write_stats
        self.committed(writer, checkpoint_dir)

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> AsyncRequest:
        """(all ranks) Plan and copy this rank's items point-in-time now; the returned
        request writes, and its finalize commits (docs/megatron.md, "Async save").
        Training may change the tensors once this returns."""
        from casnap.integrations.megatron_async import plan_async_save

        writer, state, planner = self.prepare(sharded_state_dict, checkpoint_dir)
        return plan_async_save(self, writer, state, planner, checkpoint_dir)

    # -- shared by both --------------------------------------------------
    def prepare(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> tuple[CasnapWriter, dict[str, Any], MCoreSavePlanner]:
        """Megatron's translation to a DCP state dict, plus common.pt (rank 0), and a writer."""
        path = _dir(checkpoint_dir)
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        state = mcore_to_pyt_state_dict(sharded, False)
        if COMMON_KEY in state:
            raise UnsupportedValueError(f"the sharded key {COMMON_KEY!r} is the strategy's own")
        common = _read_common(path) if _rank() == 0 else None
        if common is not None:
            state[COMMON_KEY] = io.BytesIO(common)
        metadata = dict(self.metadata)
        match = _ITERATION.search(os.path.basename(path))
        if match and "step" not in metadata:
            metadata["step"] = int(match.group(1))
        metadata[MEGATRON_METADATA] = {
            "backend": BACKEND,
            "version": VERSION,
            "common": COMMON_KEY if common is not None else None,
        }
        writer = CasnapWriter(
            snapshot_path(path, self.repository),
            storage_options=self.storage_options,
            settings=self.settings,
            repository=self.repository,
            metadata=metadata,
            session=self.session,
        )
        planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        return writer, state, planner

    def committed(self, writer: CasnapWriter, checkpoint_dir: str | Path) -> None:
        """(all ranks, after the commit) Rank 0 points the checkpoint directory at the snapshot."""
        self.last_manifest = writer.last_manifest
        if writer.last_manifest is None:
            return  # not the coordinator
        path = _dir(checkpoint_dir)
        where = snapshot_path(path, self.repository)
        repo, name = locate(where, self.storage_options, create=False, repository=self.repository)
        pointer = Pointer(repo.url, name, writer.last_manifest)
        write_pointer(os.path.join(path, POINTER_FILE), pointer, POINTER_KIND)


def _read_common(checkpoint_dir: str) -> bytes | None:
    """common.pt as Megatron's common strategy just wrote it (rank 0), or None."""
    try:
        with open(os.path.join(checkpoint_dir, COMMON_STATE_FNAME), "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


class CasnapLoadStrategy(LoadShardedStrategy):  # type: ignore[misc]
    """Load what :class:`CasnapSaveStrategy` saved, into any parallel layout.

    The snapshot is the one the checkpoint directory's ``casnap.json`` names
    (refused if that snapshot was replaced since and its earlier version is
    gone), else the directory's own snapshot path under ``repository``. Every
    chunk read is verified against its hash; only the chunks overlapping this
    rank's boxes are fetched.

    Example::

        state = dist_checkpointing.load(model.sharded_state_dict(), "/ckpt/run1/iter_0000100",
                                        sharded_strategy=CasnapLoadStrategy())
    """

    def __init__(
        self, repository: str | None = None, *, storage_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.repository = repository
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        if loaded_version != BACKEND:
            raise CheckpointingException(
                f"the checkpoint was saved with the {loaded_version!r} backend, not {BACKEND!r}: "
                "load it with its own strategy (or `casnap import` it first, docs/megatron.md)"
            )

    def check_version_compatibility(self, loaded_version: Any) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"casnap backend version {loaded_version} is not {VERSION}"
            )

    def reader(self, checkpoint_dir: str | Path) -> tuple[CasnapReader, Metadata]:
        """The reader of the checkpoint's snapshot and its DCP metadata (manifest hash-checked)."""
        path = _dir(checkpoint_dir)
        try:
            pointer = read_pointer(os.path.join(path, POINTER_FILE), POINTER_KIND)
        except FileNotFoundError:
            pointer = None
        if pointer is None:
            where = snapshot_path(path, self.repository)
            reader = CasnapReader(
                where, storage_options=self.storage_options, repository=self.repository
            )
            return reader, reader.read_metadata()
        for name in (pointer.snapshot, f"{pointer.snapshot}{HISTORY_SEP}{pointer.manifest[:12]}"):
            path = f"{pointer.repository.rstrip('/')}/{name}"
            reader = CasnapReader(
                path, storage_options=self.storage_options, repository=pointer.repository
            )
            try:
                metadata = reader.read_metadata()
            except FileNotFoundError:
                continue
            if reader.manifest_hash == pointer.manifest:
                return reader, metadata
        raise CheckpointingException(
            f"{path}: snapshot {pointer.snapshot!r} in {pointer.repository} is no longer the "
            f"version this checkpoint directory names ({pointer.manifest[:12]})"
        )

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """(all ranks) Megatron's torch_dist load (its planner reshards) over ``CasnapReader``."""
        flexible = [
            sh
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and not sh.allow_shape_mismatch
        ]
        mismatch = {
            sh.key: sh
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch
        }
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        state = mcore_to_pyt_state_dict(sharded, True)
        reader, _ = self.reader(checkpoint_dir)
        dcp_load(
            state,
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=flexible,
                allow_shape_mismatch_sharded_tensors=mismatch,
            ),
        )
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        out = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(out, original)
        result: StateDict = out
        return result

    def load_tensors_metadata(
        self, checkpoint_dir: str | Path, metadata: Metadata | None = None
    ) -> dict[str, ShardedTensor]:
        """Global shapes and dtypes of the checkpoint's tensors (Megatron's own helper)."""
        if metadata is None:
            metadata = self.reader(checkpoint_dir)[1]
        out: dict[str, ShardedTensor] = TorchDistLoadShardedStrategy().load_tensors_metadata(
            Path(_dir(checkpoint_dir)), metadata
        )
        return out

    def load_sharded_metadata(
        self, checkpoint_dir: str | Path
    ) -> dict[str, ShardedTensor | ShardedObject]:
        """Tensors and ShardedObjects of the checkpoint (the common state is not one)."""
        metadata = self.reader(checkpoint_dir)[1]
        out: dict[str, ShardedTensor | ShardedObject] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and key != COMMON_KEY:
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out


def load_common(checkpoint_dir: str | Path, repository: str | None = None) -> Any:
    """The common state dict kept in the checkpoint's snapshot (``torch.load``: trusted input).

    Megatron reads ``common.pt`` from the directory; this reads the snapshot's
    copy, for a directory whose ``common.pt`` is gone.
    """
    reader, metadata = CasnapLoadStrategy(repository).reader(checkpoint_dir)
    if COMMON_KEY not in metadata.state_dict_metadata:
        raise CheckpointingException(f"{_dir(checkpoint_dir)}: the snapshot holds no common state")
    state: dict[str, Any] = {COMMON_KEY: io.BytesIO()}

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            state[COMMON_KEY] = torch.load(value, map_location="cpu", weights_only=False)

    dcp_load({COMMON_KEY: io.BytesIO()}, storage_reader=reader, planner=_Planner(), no_dist=True)
    return state[COMMON_KEY]


def register_casnap_strategies() -> None:
    """Make these Megatron's default strategies for the ``casnap`` backend (done on import)."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, CasnapLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, CasnapSaveStrategy())


register_casnap_strategies()
