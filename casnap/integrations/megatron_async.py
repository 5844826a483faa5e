"""Megatron-core's async save over casnap: plan and stage now, write in the background.

Megatron-core splits an async save into three calls (``AsyncRequest``,
docs/megatron.md, "Async save"): ``strategy.async_save`` plans and stages
every item this rank writes into the session's pool
(:meth:`_AsyncWriter.prepare_write_data`); ``async_fn`` (possibly in a forked
process) writes the chunks (:func:`write_staged`) and leaves the results in a
private file; the finalize function gathers them on rank 0, which commits.
A failure anywhere leaves no ref.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from casnap.chunks.frames import WriteStats
from casnap.integrations.dcp_writer import CasnapWriter
from casnap.settings import Settings, default_memory_budget
from casnap.take.target import staging_limit
from casnap.torch_io.staging import StagingFull


class SaveReport(Protocol):
    """What an async save reports to once it commits: the strategy that planned it
    (:class:`casnap.integrations.megatron.CasnapSaveStrategy`, which imports this
    module, never the other way)."""

    last_write_stats: WriteStats | None
    last_manifest: str | None

    def committed(self, writer: CasnapWriter, checkpoint_dir: str | Path) -> None:
        """(all ranks, after the commit) Point the checkpoint directory at the snapshot."""


class StagedPlanner:
    """Stands in for DCP's planner when the staged items are written: their copies, by index."""

    def __init__(self, data: dict[MetadataIndex, torch.Tensor | io.BytesIO]) -> None:
        self.data = data

    def resolve_data(self, item: Any) -> torch.Tensor | io.BytesIO:
        return self.data[item.index]


@dataclass
class _Outcome:
    """What one rank's background write left: results and stats, or the failure."""

    results: list[WriteResult]
    stats: WriteStats | None
    error: str | None = None


def _add(a: WriteStats | None, b: WriteStats | None) -> WriteStats | None:
    if a is None or b is None:
        return a or b
    return WriteStats(**{k: getattr(a, k) + getattr(b, k) for k in a.__dataclass_fields__})


class _AsyncWriter(CasnapWriter):
    """``CasnapWriter`` plus the calls Megatron's async planner makes on its writer."""

    def __init__(self, base: CasnapWriter) -> None:
        super().__init__(
            base.path,
            storage_options=base.storage_options,
            settings=base.options.settings,
            repository=base.options.repository,
            metadata=base.metadata,
            overwrite=base.overwrite,
            session=base.session,
        )
        self.staged_plan: SavePlan | None = None
        self.staged_planner: StagedPlanner | None = None
        self.buffers: list[torch.Tensor] = []
        self.written_now: list[WriteResult] = []
        self.stats_now: WriteStats | None = None

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """(every rank, in ``async_save``) Copy this rank's items point-in-time; write the rest."""
        settings = Settings.from_env()
        limit = staging_limit(default_memory_budget(), settings)
        pool = self.session.staging
        staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
        later, now = [], []
        kept = 0
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    staged[item.index] = io.BytesIO(data.getvalue())  # a copy
                    later.append(item)
                    continue
                assert isinstance(data, torch.Tensor)
                nbytes = data.numel() * data.element_size()
                if kept + nbytes > limit:
                    now.append(item)
                    continue
                try:
                    buf = pool.stage(data, limit)
                except StagingFull:  # buffers of an earlier save still in use
                    now.append(item)
                    continue
                self.buffers.append(buf)
                kept += nbytes
                staged[item.index] = buf
                later.append(item)
            if now:  # past the staging share: written before async_save returns
                self.written_now = self.write_data(replace(plan, items=now), planner).wait()
                self.stats_now = self.last_write_stats
        except BaseException:
            self.give_back()
            raise
        self.staged_plan = replace(plan, items=later)
        self.staged_planner = StagedPlanner(staged)

    def give_back(self) -> None:
        buffers, self.buffers = self.buffers, []
        self.session.staging.give_back(buffers)


def write_staged(writer: _AsyncWriter, results_file: str) -> None:
    """(every rank, ``async_fn``) Write the staged items; leave the outcome in ``results_file``.

    Runs in Megatron's forked background process or in the training process
    (``execute_sync``). Never raises: the failure travels to the finalize step,
    which fails the save on every rank.
    """
    assert writer.staged_plan is not None and writer.staged_planner is not None
    try:
        planner: Any = writer.staged_planner
        results = writer.write_data(writer.staged_plan, planner).wait()
        outcome = _Outcome(results, writer.last_write_stats)
    except BaseException as exc:
        outcome = _Outcome([], None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    tmp = f"{results_file}.tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(outcome, fh)  # our own results, read back by this job only
    os.replace(tmp, results_file)


def _read_outcome(results_file: str) -> _Outcome:
    try:
        with open(results_file, "rb") as fh:
            outcome = pickle.load(fh)  # written by write_staged of this save, never foreign
    except FileNotFoundError:
        return _Outcome([], None, "the background write left no results (it did not run or died)")
    finally:
        for path in (results_file, f"{results_file}.tmp"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    assert isinstance(outcome, _Outcome)
    return outcome


def plan_async_save(
    strategy: SaveReport,
    base: CasnapWriter,
    state: dict[str, Any],
    planner: SavePlanner,
    checkpoint_dir: str | Path,
) -> AsyncRequest:
    """(every rank) Megatron's async planning with casnap's writer; the request to schedule."""
    writer = _AsyncWriter(base)
    ret = save_state_dict_async_plan(state, writer, None, 0, planner=planner)
    _, global_metadata, dist_wrapper = ret[0]
    fd, results_file = tempfile.mkstemp(prefix="casnap-megatron-", suffix=".results")
    os.close(fd)
    os.remove(results_file)  # write_staged creates it: its presence means it finished

    def finalize() -> None:
        outcome = _read_outcome(results_file)
        writer.give_back()
        outcome.results = writer.written_now + outcome.results
        strategy.last_write_stats = _add(writer.stats_now, outcome.stats)
        gathered = dist_wrapper.gather_object(outcome)
        error: str | None = None
        if dist_wrapper.is_coordinator:
            failed = [f"rank {r}: {o.error}" for r, o in enumerate(gathered) if o.error]
            if failed:
                error = "; ".join(failed)
                writer.reset()  # releases the lease: no ref is written
            else:
                try:
                    writer.finish(global_metadata, [o.results for o in gathered])
                    strategy.committed(writer, checkpoint_dir)
                except Exception as exc:
                    error = f"rank 0: commit failed: {type(exc).__name__}: {exc}"
        error = dist_wrapper.broadcast_object(error)
        if error is not None:
            raise CheckpointingException(f"casnap async save to {checkpoint_dir} failed: {error}")
        strategy.last_manifest = writer.last_manifest

    return AsyncRequest(partial(write_staged, writer, results_file), (), [finalize])
