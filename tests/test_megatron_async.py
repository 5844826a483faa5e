"""Megatron-core's async save with the casnap strategy, two ranks (gloo, CPU).

``dist_checkpointing.save(..., async_sharded_save=True)`` returns Megatron's
``AsyncRequest``; the tests run it with ``execute_sync`` (CPU as is) and
through Megatron's ``AsyncCallsQueue``, whose forked writer process is
Megatron's default. Every save runs under ``FullyParallelSaveStrategyWrapper``
(DP=2), and the live tensors are changed right after ``async_save`` returns:
the snapshot must hold the state as it was then.

``AsyncCallsQueue`` assumes CUDA: it calls ``torch.cuda.synchronize()`` before
forking and all-reduces its done flags on ``torch.cuda.current_device()``. The
queue test patches exactly those two (a no-op, and the CPU device); casnap's
strategy itself runs unpatched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_helpers import (
    build,
    check_loaded,
    env_quiet,
    full_tensors,
    main_boxes,
    megatron_missing,
    sharded_state,
)

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(megatron_missing() is not None, reason=str(megatron_missing())),
]


def _gathered_full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    boxes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(boxes, main_boxes(sd))
    return full_tensors(boxes)


def _train(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _async_save(model: Any, root: str, it: int, strategy: Any) -> tuple[Any, dict[str, Any]]:
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(root, f"iter_{it:07d}")
    os.makedirs(ckpt, exist_ok=True)
    sd = sharded_state(model, it)
    full = _gathered_full(sd)
    request = dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
    return request, full


def _async(rank: int, world: int, root: str) -> dict[str, Any]:
    env_quiet()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from casnap.integrations.megatron import CasnapLoadStrategy, CasnapSaveStrategy
    from casnap.settings import override

    model = build(tp=1)  # DP=2
    base = CasnapSaveStrategy()
    strategy = FullyParallelSaveStrategyWrapper(base)
    out: dict[str, Any] = {}
    fulls = {}

    # 1. execute_sync: the request runs in this process
    request, fulls[1] = _async_save(model, root, 1, strategy)
    _train(model)  # after async_save returned: not in the snapshot
    request.execute_sync()
    out["stats1"] = base.last_write_stats

    # 2. a memory budget too small to stage everything: the rest is written before returning
    with override(memory_budget=200_000):
        request, fulls[2] = _async_save(model, root, 2, strategy)
    out["written_now"] = len(request.async_fn.args[0].written_now)
    out["staged"] = len(request.async_fn.args[0].staged_plan.items)
    _train(model)
    request.execute_sync()

    # 3. Megatron's async queue: the write runs in a forked process
    queue = AsyncCallsQueue()
    cuda = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a device name
    try:
        request, fulls[3] = _async_save(model, root, 3, strategy)
        queue.schedule_async_request(request)
        _train(model)
        out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = cuda
    out["stats3"] = base.last_write_stats

    # 4. a background write that fails on rank 1 fails the save on every rank, before a ref
    request, _ = _async_save(model, root, 4, strategy)
    if rank == 1:
        request.async_fn.args[0].staged_planner.data.clear()
    try:
        request.execute_sync()
        out["failure"] = None
    except CheckpointingException as exc:
        out["failure"] = str(exc)

    out["checked"] = {}
    for it, full in fulls.items():
        template = sharded_state(model, 0)
        loaded = dist_checkpointing.load(
            sharded_state(model, 0), os.path.join(root, f"iter_{it:07d}"), CasnapLoadStrategy()
        )
        out["checked"][it] = check_loaded(loaded, template, full)
        assert loaded["step"] == it
    return out


@pytest.fixture(scope="module")
def async_run(megatron_two_ranks: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    return megatron_two_ranks["async"]  # one launch with test_megatron_dist.py's scenario


def test_async_saves_are_point_in_time_and_load_bit_exact(async_run: Any) -> None:
    _, out = async_run
    for rank in out:
        assert rank["checked"] == {
            1: rank["checked"][1],
            2: rank["checked"][1],
            3: rank["checked"][1],
        }
        assert rank["checked"][1] > 20


def test_past_the_staging_share_items_are_written_before_async_save_returns(async_run: Any) -> None:
    _, out = async_run
    assert any(r["written_now"] > 0 for r in out)
    assert any(r["staged"] > 0 for r in out)


def test_megatron_async_queue_finalizes_the_forked_write(async_run: Any) -> None:
    _, out = async_run
    assert all(r["finalized"] == [0] for r in out)
    stats = [r["stats3"] for r in out]
    assert all(s.raw_bytes > 50_000 for s in stats)  # written from both ranks: still balanced
    assert sum(s.raw_bytes_written for s in stats) > 100_000  # trained since: all new


def test_a_failed_background_write_fails_every_rank_and_commits_nothing(async_run: Any) -> None:
    from casnap.api.repository import Repository

    root, out = async_run
    for rank in out:
        assert rank["failure"] is not None and "rank 1: KeyError" in rank["failure"]
    repo = Repository(str(root))
    assert repo.snapshots() == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert not (root / "iter_0000004" / "metadata.json").exists()
    assert repo.verify(read_data=True).ok
