"""casnap's Megatron-core strategies on two ranks (gloo, CPU): layouts, replicas, resharding.

One pair of rank processes goes through Megatron layouts in turn (its parallel
state is rebuilt between them): a tensor-parallel save (TP=2) is loaded into a
data-parallel layout (TP=1, DP=2) and the other way round, each bit-exact
against whole tensors assembled from the saving ranks' own boxes.
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


def _relayout(tp: int, seed: int) -> Any:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return build(tp=tp, seed=seed)


def _save(sd: dict[str, Any], root: str, it: int, strategy: Any) -> Any:
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(root, f"iter_{it:07d}")
    os.makedirs(ckpt, exist_ok=True)
    dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
    return getattr(strategy, "base_strategy", strategy).last_write_stats


def _load_and_check(
    root: str, it: int, tp: int, full: dict[str, torch.Tensor], same_layout: bool = False
) -> int:
    from megatron.core import dist_checkpointing

    from casnap.integrations.megatron import CasnapLoadStrategy

    model = _relayout(tp, seed=99)
    template = sharded_state(model, 0, rng=same_layout)
    loaded = dist_checkpointing.load(
        sharded_state(model, 0, rng=same_layout),
        os.path.join(root, f"iter_{it:07d}"),
        CasnapLoadStrategy(),
    )
    if same_layout:  # each TP rank gets its own ShardedObject back
        tp_rank = torch.distributed.get_rank() if tp == 2 else 0
        assert loaded["rng"] == {"tp_rank": tp_rank, "seed": 7 + tp_rank}
    return check_loaded(loaded, template, full)


def _layouts(rank: int, world: int, root: str) -> dict[str, Any]:
    env_quiet()
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from casnap.integrations.megatron import CasnapSaveStrategy

    out: dict[str, Any] = {}
    # TP=2: each rank holds half of every parallel linear layer
    model = build(tp=2)
    strategy = CasnapSaveStrategy()
    sd = sharded_state(model, 1)
    full1 = _gathered_full(sd)
    out["tp2_first"] = _save(sd, root, 1, strategy)
    with torch.no_grad():  # a step that changed a few tensors
        model.decoder.layers[0].self_attention.linear_qkv.weight.mul_(2.0)
    sd = sharded_state(model, 2)
    full2 = _gathered_full(sd)
    out["tp2_step"] = _save(sd, root, 2, strategy)
    out["tp2_unchanged"] = _save(sharded_state(model, 2), root, 3, strategy)
    # ... loaded into TP=1, DP=2: every rank reads whole tensors from both ranks' shards
    out["tp2_to_dp2"] = [
        _load_and_check(root, it, 1, full) for it, full in ((1, full1), (2, full2))
    ]
    out["tp2_to_tp2"] = _load_and_check(root, 2, 2, full2, same_layout=True)

    # TP=1, DP=2: replicas; the main one (DP rank 0) is written, once
    model = _relayout(1, seed=5)
    sd = sharded_state(model, 4)
    full4 = _gathered_full(sd)
    out["dp2_plain"] = _save(sd, root, 4, CasnapSaveStrategy())
    wrapped = FullyParallelSaveStrategyWrapper(CasnapSaveStrategy())
    _save(sharded_state(model, 4), root, 5, wrapped)
    out["dp2_fully_parallel"] = wrapped.base_strategy.last_write_stats
    # ... loaded into TP=2
    out["dp2_to_tp2"] = [_load_and_check(root, it, 2, full4) for it in (4, 5)]
    out["dp2_to_dp2"] = _load_and_check(root, 5, 1, full4, same_layout=True)
    return out


@pytest.fixture(scope="module")
def layouts(megatron_two_ranks: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    return megatron_two_ranks["layouts"]  # one launch with test_megatron_async.py's scenario


def test_tensor_parallel_save_loads_bit_exact_into_data_parallel(layouts: Any) -> None:
    _, out = layouts
    for rank in out:
        assert rank["tp2_to_dp2"][0] == rank["tp2_to_dp2"][1] > 20
        assert rank["tp2_to_tp2"] > 20  # and into its own layout, ShardedObjects included


def test_data_parallel_save_loads_bit_exact_into_tensor_parallel(layouts: Any) -> None:
    _, out = layouts
    for rank in out:
        assert rank["dp2_to_tp2"][0] == rank["dp2_to_tp2"][1] > 20
        assert rank["dp2_to_dp2"] > 20


def test_each_rank_writes_its_own_shards_and_only_changes_after_a_step(layouts: Any) -> None:
    _, out = layouts
    first = [r["tp2_first"] for r in out]
    step = [r["tp2_step"] for r in out]
    assert all(s.raw_bytes_written > 50_000 for s in first)  # each rank its half
    for f, s in zip(first, step):  # qkv of layer 0 (a quarter of this rank's layer 0 weights)
        assert 0 < s.raw_bytes_written < f.raw_bytes_written / 3
    assert all(r["tp2_unchanged"].chunks_written == 0 for r in out)


def test_a_replica_is_written_once_and_fully_parallel_save_balances_it(layouts: Any) -> None:
    _, out = layouts
    plain = [r["dp2_plain"].raw_bytes for r in out]
    assert plain[0] > 100_000 and plain[1] == 0  # DP rank 1 holds replicas only
    balanced = [r["dp2_fully_parallel"].raw_bytes for r in out]
    assert sum(balanced) == sum(plain)  # still one copy of the model
    assert max(balanced) < 0.75 * sum(balanced), balanced  # and split between the ranks
    # the same state as the plain save before it: nothing new to write
    assert all(r["dp2_fully_parallel"].raw_bytes_written == 0 for r in out)


def test_every_save_is_one_snapshot(layouts: Any) -> None:
    from casnap.api.repository import Repository

    root, _ = layouts
    repo = Repository(str(root))
    assert repo.snapshots() == [f"iter_{i:07d}" for i in range(1, 6)]
    assert repo.verify(read_data=True).ok
    line = {x.name: x for x in repo.log()}
    assert line["iter_0000003"].new_bytes == 0
    assert line["iter_0000005"].step == 5
