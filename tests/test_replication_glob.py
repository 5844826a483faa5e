"""Which entries are ``replicated`` when ranks declare different globs (``-m dist``).

torchsnapshot 0.1.0's tests/test_replication_glob.py and
tests/test_ddp_replication_glob.py, on two gloo ranks: a key is replicated only
when every rank declared it so (its ``replicated=`` globs or the globs inferred
for a ``DistributedDataParallel`` value matched it there). casnap keeps every
rank's keys (``"1/my_stateful/foo"``, docs/distributed.md), so each set is
checked for rank 0 and rank 1 alike; a replica that differs still warns.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = pytest.mark.dist

STATEFUL = ["foo", "bar", "baz/0", "baz/1", "qux/quux", "qux/quuz"]

# (globs of rank 0, globs of rank 1) -> the keys below my_stateful that are replicated
GLOB_CASES: list[tuple[list[list[str]], list[str]]] = [
    ([["**"], ["**"]], STATEFUL),
    ([["my_stateful/baz/*", "my_stateful/qux/*"]] * 2, ["baz/0", "baz/1", "qux/quux", "qux/quuz"]),
    (
        [["my_stateful/foo", "my_stateful/qux/*"], ["my_stateful/foo", "my_stateful/bax/*"]],
        ["foo"],
    ),
    ([["my_stateful/foo"], ["my_stateful/qux/*"]], []),
]
DDP_CASES: list[tuple[list[str] | None, list[str]]] = [
    ([], ["ddp/module.weight", "ddp/module.bias"]),
    (None, ["ddp/module.weight", "ddp/module.bias"]),
    (["**"], ["ddp/module.weight", "ddp/module.bias", "nonddp/weight", "nonddp/bias"]),
]


class _TestStateful:
    def __init__(self, foo: float = 1.0) -> None:
        self.foo = foo

    def state_dict(self) -> dict[str, Any]:
        return {
            "foo": torch.full((1,), self.foo),
            "bar": torch.ones(1),
            "baz": [torch.ones(1), torch.ones(1)],
            "qux": {"quux": torch.ones(1), "quuz": torch.ones(1)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError()


def _replicated(snapshot: Any) -> set[str]:
    return {path for path, entry in snapshot.get_manifest().items() if entry.replicated}


def take_with_globs(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from casnap import Snapshot
    from casnap.errors import ReplicaMismatchWarning

    out: dict[str, Any] = {"globs": [], "ddp": []}
    for i, (globs, _) in enumerate(GLOB_CASES):
        snapshot = Snapshot.take(
            f"{root}/g{i}", {"my_stateful": _TestStateful()}, replicated=globs[rank]
        )
        out["globs"].append(_replicated(snapshot))
    for i, (ddp_globs, _) in enumerate(DDP_CASES):
        torch.manual_seed(0)  # the same non-DDP module on both ranks
        app_state = {"ddp": DDP(torch.nn.Linear(4, 3)), "nonddp": torch.nn.Linear(3, 2)}
        snapshot = Snapshot.take(f"{root}/d{i}", app_state, replicated=ddp_globs)
        out["ddp"].append(_replicated(snapshot))
    # Declared on every rank but different on rank 1: the warning names it, and only it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_globs = [["**"], ["my_stateful/foo", "my_stateful/bar"]][rank]
        snapshot = Snapshot.take(
            f"{root}/w", {"my_stateful": _TestStateful(foo=float(rank))}, replicated=rank_globs
        )
    out["warned"] = [
        str(w.message) for w in caught if issubclass(w.category, ReplicaMismatchWarning)
    ]
    out["warn_replicated"] = _replicated(snapshot)
    out["read_foo"] = [snapshot.read_object(f"{r}/my_stateful/foo").item() for r in range(world)]
    return out


def _both_ranks(keys: list[str]) -> set[str]:
    return {f"{r}/{k}" for r in range(2) for k in keys}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_only_keys_every_rank_declared_are_replicated(tmp_path: Path) -> None:
    out = values(run_ranks(2, take_with_globs, str(tmp_path / "repo")))
    for o in out:  # every rank sees the same manifest
        for (_, expected), got in zip(GLOB_CASES, o["globs"], strict=True):
            assert got == _both_ranks([f"my_stateful/{k}" for k in expected])
        for (_, expected), got in zip(DDP_CASES, o["ddp"], strict=True):
            assert got == _both_ranks(expected)
        (message,) = o["warned"]
        assert "my_stateful/foo: ranks [0] vs [1]" in message, message
        assert "bar" not in message and "qux" not in message, message
        assert o["warn_replicated"] == _both_ranks(["my_stateful/bar"])
        assert o["read_foo"] == [0.0, 1.0]  # each rank's own value is kept
