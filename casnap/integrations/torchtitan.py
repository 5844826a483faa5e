"""A torchtitan checkpoint manager whose checkpoints are casnap snapshots.

Select it in the job's config (torchtitan 0.3.0)::

    from casnap.integrations.torchtitan import CasnapCheckpointManager

    config.checkpoint = CasnapCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=5,
        async_mode="async",            # or "disabled", "async_with_pinned_mem"
    )

``<dump_folder>/checkpoint`` becomes a casnap repository and ``step-N`` a
snapshot in it, saved by :class:`~casnap.integrations.dcp.CasnapWriter` and
loaded by :class:`~casnap.integrations.dcp.CasnapReader` (only the chunks a
save changed are written; every read is verified). Everything else is
torchtitan's own ``CheckpointManager`` (which steps save, what is saved, the
last step's model-only export, ``load_step``, ``exclude_from_loading``).
``keep_latest_k`` deletes snapshots and reclaims their space at once, never
what a save still in flight reuses; the latest step is the newest committed
snapshot, so a save that was killed is never picked. DCP step folders from
before the switch (same folder, or ``initial_load_path``) are loaded with
DCP's own reader. docs/torchtitan.md has the details and the limits.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torchtitan.components.checkpointer.base import MODEL, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

from casnap.api.repository import Repository
from casnap.errors import ConfigError, SnapshotNotFoundError
from casnap.integrations.dcp import HISTORY_SEP, CasnapReader, CasnapWriter
from casnap.integrations.pointer import Retirer

log = logging.getLogger(__name__)

__all__ = ["CasnapCheckpointManager"]

_STEP = re.compile(r"step-(\d+)")  # torchtitan's own name of a step's checkpoint
_DCP_METADATA = ".metadata"  # what makes a folder a DCP checkpoint (torchtitan's test too)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _accelerator() -> bool:
    return torch.accelerator.is_available()


def _is_dcp_folder(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder DCP's own writer made."""
    return bool(filesystem.isfile(filesystem.join(path, _DCP_METADATA)))


def _step_of(name: str) -> int | None:
    """The step a snapshot (``step-N``, or a history version ``step-N@<hex>``) belongs to."""
    base = name.split(HISTORY_SEP, 1)[0]
    match = _STEP.fullmatch(base)
    return int(match.group(1)) if match else None


class CasnapCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager`` with each checkpoint a casnap snapshot.

    Built by torchtitan from ``config.checkpoint = CasnapCheckpointManager.Config(...)``
    with the arguments it gives every manager. ``Config`` is torchtitan's
    ``CheckpointManager.Config`` plus ``storage_options`` (the store's fsspec
    options), ``settings`` (what ``casnap.Snapshot.take(settings=...)`` overrides:
    ``chunk_size``, ``compression``, ``delta``; JSON values) and
    ``reclaim_wait_seconds`` (how long a retention reclaim waits for a save in
    flight before leaving the space to the next one).

    Example::

        config.checkpoint = CasnapCheckpointManager.Config(enable=True, keep_latest_k=3)
        # then, as torchtitan's trainer does:
        manager = config.checkpoint.build(dataloader=dl, model_parts=[model],
                                          optimizers=opts, lr_schedulers=scheds,
                                          states={"train_state": trainer},
                                          sd_adapter=None, base_folder="/runs/1")
        manager.load()            # the newest committed step, if any
        manager.save(curr_step=500)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """The store's fsspec options (``casnap.Snapshot.take``'s ``storage_options``)."""

        settings: dict[str, Any] = dataclasses.field(default_factory=dict)
        """What each save overrides (``chunk_size``, ``compression``, ``delta``)."""

        reclaim_wait_seconds: float = 1.0
        """How long deleting a step waits for a save in flight before deferring."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.reclaim_wait_seconds < 0:
                raise ValueError("reclaim_wait_seconds cannot be negative.")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's purge thread would rmtree step folders: ours retires snapshots.
        no_purge = dataclasses.replace(config, keep_latest_k=0)  # type: ignore[call-arg]
        super().__init__(no_purge, **kwargs)
        if not self.enable:
            return
        self.storage_options = dict(config.storage_options)
        self.settings = dict(config.settings)
        self.keep_latest_k = config.keep_latest_k
        self._retirer = Retirer(config.reclaim_wait_seconds)
        self._saved_step: int | None = None  # the last save dispatched (maybe in flight)
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and not _accelerator():
            # torchtitan's stager asks for pinned memory and non-blocking copies, which need
            # an accelerator; on CPU the same process-based save stages to shared memory.
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        if self.keep_latest_k > 0:
            self.purge_queue: queue.Queue[str | None] = queue.Queue()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._remove), daemon=True
            )
            self.purge_thread.start()

    # -- saving ------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Save ``state_dict`` as snapshot ``checkpoint_id`` (``<folder>/step-N``).

        ``to_hf`` (the last step's ``last_save_in_hf`` export) is torchtitan's
        own: safetensors files in the folder ``<folder>/step-N``, outside casnap.
        """
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        step = _step_of(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
        writer = CasnapWriter(
            checkpoint_id,
            storage_options=self.storage_options,
            settings=self.settings,
            metadata={"step": step} if step is not None else None,
        )
        self._saved_step = step
        ret: Any = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
            if isinstance(ret, Future):  # staged already (the CPU stager above): say so
                staged: Future[None] = Future()
                staged.set_result(None)
                ret = AsyncSaveResponse(staging_completion=staged, upload_completion=ret)
        else:
            dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            gc.collect(1)
        return ret

    # -- loading -----------------------------------------------------------
    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load snapshot ``checkpoint_id``; a DCP folder or an HF one as torchtitan does."""
        if from_hf or _is_dcp_folder(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = CasnapReader(checkpoint_id, storage_options=self.storage_options)
        dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:  # the model's keys are flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        steps = self._steps()
        if step != -1 and step not in steps:
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} not found: no snapshot step-{step} in "
                f"{self.folder} (steps there: {sorted(steps)[-5:] or 'none'})"
            )
        load_step = step if step != -1 else max(steps, default=-1)
        if load_step == -1:
            initial = self.initial_load_path
            if initial and not filesystem.isdir(initial) and self._is_snapshot(initial):
                return self._load_from(initial, self.initial_load_model_only)
            # torchtitan's own: initial_load_path (a DCP or HF folder), HF assets, or a fresh
            # start; _find_load_step answers -1 there, so its resume branch is not taken.
            return bool(super()._load(-1))
        # torchtitan resumes a step-0 (seed) checkpoint as the model only
        return self._load_from(steps[load_step], model_only=load_step == 0)

    def _load_from(self, checkpoint_id: str, model_only: bool) -> bool:
        log.info("casnap: loading the checkpoint from %s", checkpoint_id)
        states = self._states_to_load(model_only)
        self.dcp_load(states, checkpoint_id, from_hf=False, from_quantized=False)
        gc.collect(1)
        return True

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed step in the repository (or DCP step folder) at ``folder``."""
        return max(self._steps(folder), default=-1)

    # -- the folder: a repository, and DCP folders from before the switch --
    def _repository(self, folder: str = "") -> tuple[Repository, str] | None:
        """The repository a save of ``<folder>/step-0`` uses and the names' prefix there."""
        probe = filesystem.join(folder or self.folder, "step-0")
        try:
            repo, name = Repository.locate(probe, self.storage_options, must_exist=False)
        except (SnapshotNotFoundError, ConfigError):
            return None  # no repository yet: nothing saved
        return repo, name[: -len("step-0")]

    def _snapshots(self, folder: str = "") -> dict[int, list[str]]:
        """Step -> its snapshot names in the repository, ``step-N`` first, then history."""
        found = self._repository(folder)
        if found is None:
            return {}
        repo, prefix = found
        out: dict[int, list[str]] = {}
        for name in repo.snapshots():
            if not name.startswith(prefix) or "/" in name[len(prefix) :]:
                continue
            step = _step_of(name[len(prefix) :])
            if step is not None:
                out.setdefault(step, []).append(name)
        for names in out.values():
            names.sort(key=lambda n: HISTORY_SEP in n)
        return out

    def _steps(self, folder: str = "") -> dict[int, str]:
        """Step -> the checkpoint id to load it from: committed snapshots, else DCP folders."""
        folder = folder or self.folder
        steps: dict[int, str] = {}
        if filesystem.isdir(folder):
            for entry in filesystem.listdir(folder):
                match = _STEP.fullmatch(entry)
                path = filesystem.join(folder, entry)
                if match and _is_dcp_folder(path):
                    steps[int(match.group(1))] = path
        for step, names in self._snapshots(folder).items():
            if HISTORY_SEP not in names[0]:  # a committed step-N (a killed save has no ref)
                steps[step] = filesystem.join(folder, f"step-{step}")
        return steps

    def _is_snapshot(self, path: str) -> bool:
        try:
            Repository.locate(path, self.storage_options)
        except (SnapshotNotFoundError, ConfigError):
            return False
        return True

    # -- retention: keep_latest_k ------------------------------------------
    def _should_purge(self) -> bool:
        return bool(self.keep_latest_k > 0 and _rank() == 0)

    def _purge_stale_checkpoints(self) -> None:
        """Queue every step but the newest ``keep_latest_k``, counting the save just
        dispatched (perhaps still in flight), as torchtitan counts its folder."""
        if not self._should_purge():
            return
        steps = set(self._steps()) | set(self._snapshots())
        if self._saved_step is not None:
            steps.add(self._saved_step)
        for step in sorted(steps)[: -self.keep_latest_k]:
            self.purge_queue.put(filesystem.join(self.folder, f"step-{step}"))

    def _remove(self, checkpoint_id: str) -> None:
        """(the purge thread) Delete a step: its snapshot and history, or its DCP folder.

        The reclaim that frees the space waits ``reclaim_wait_seconds`` for a save in
        flight (whose lease it sees) and otherwise leaves it to the next purge: what a
        running save reuses is never deleted (docs/gc.md, "Reclaim after retention").
        """
        if _is_dcp_folder(checkpoint_id):
            filesystem.rmtree(checkpoint_id)
            return
        step = _step_of(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
        found = self._repository()
        if found is None or step is None or step == self._in_flight_step():
            return  # never the save still running (keep_latest_k >= 2 keeps it anyway)
        for name in self._snapshots().get(step, []):
            self._retirer.retire(found[0], name, None)

    def _in_flight_step(self) -> int | None:
        future = self.save_future
        return self._saved_step if future is not None and not future.done() else None

    # -- the rest ----------------------------------------------------------
    def _close(self) -> None:
        future: Future[Any] | None = getattr(self, "save_future", None)
        if future is not None:
            try:
                future.result()  # a save still uploading commits before we stop
            except Exception as exc:  # noqa: BLE001 (close runs from __del__ too)
                log.warning("casnap: the last asynchronous save failed: %s", exc)
            self.save_future = None
        super()._close()
        retirer = getattr(self, "_retirer", None)
        if retirer is not None and retirer.pending:
            retirer.flush(wait_seconds=60.0)
