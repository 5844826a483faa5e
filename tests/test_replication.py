"""Replicated state: which entries are replicated, and values declared so that differ.

- The check id ranks compare for a large replicated chunk
  (casnap.distributed.replica_check). What it sees and what it cannot, as
  docs/distributed.md states: any change of one 8-byte word, moves between
  512-byte rows, the bytes past the last row; not words swapped inside one row.
- ``replicated=`` in a single-process take, as torchsnapshot treats it: the
  entries matching it are marked replicated even when one process takes the
  snapshot, so a job that trained on one process and resumes on several finds
  them on every rank. Per-rank state (not replicated) restores only onto the
  rank that saved it.
- Which entries are replicated when ranks declare different globs
  (torchsnapshot 0.1.0's tests/test_replication_glob.py and
  tests/test_ddp_replication_glob.py, on two gloo ranks): a key is replicated
  only when every rank declared it so (its ``replicated=`` globs or the globs
  inferred for a ``DistributedDataParallel`` value matched it there). casnap
  keeps every rank's keys (``"1/my_stateful/foo"``), so each set is checked for
  rank 0 and rank 1 alike; a replica that differs still warns.
- Values declared replicated that differ between ranks: by default the take
  succeeds with a :class:`casnap.errors.ReplicaMismatchWarning` naming the keys
  and the ranks, and keeps every rank's own value; ``replica_mismatch="error"``
  fails the take on every rank with no ref written.

Multi-rank tests carry ``dist`` (select with ``-m dist``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values
from helpers import random_tensors

from casnap import Snapshot, StateDict
from casnap.distributed.replica_check import CHECKED_MIN, ROW_BYTES, check_id
from casnap.errors import MissingKeyError
from casnap.format.names import digest_of
from casnap.torch_io.tensors import byte_view


@contextmanager
def replica_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Records every warning in the block; the list holds the ReplicaMismatchWarnings after it."""
    from casnap.errors import ReplicaMismatchWarning

    found: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found.extend(w for w in caught if issubclass(w.category, ReplicaMismatchWarning))


# --- the check id of a large replicated chunk ------------------------------------------------

N = CHECKED_MIN + 3 * ROW_BYTES + 100  # whole rows, then a partial one


def _chunk(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)


def _id(t: torch.Tensor, place: str = "model/w\x000") -> bytes | None:
    return check_id(byte_view(t), place)


def test_equal_bytes_in_two_buffers_have_one_id_and_it_is_no_content_hash() -> None:
    a, b = _chunk(), _chunk()
    assert a.data_ptr() != b.data_ptr()
    assert _id(a) == _id(b) is not None
    assert _id(a) != digest_of(byte_view(a))  # a check id never names stored bytes


def test_the_place_is_part_of_the_id() -> None:
    a = _chunk()
    assert _id(a, "model/w\x000") != _id(a, "model/w\x001")
    assert _id(a, "model/w\x000") != _id(a, "model/v\x000")


def test_every_single_byte_change_is_seen() -> None:
    a = _chunk()
    base = _id(a)
    for at in (0, 7, 8, ROW_BYTES - 1, ROW_BYTES, N // 2, N - 101, N - 100, N - 1):
        b = a.clone()
        b[at] ^= 0x80  # the top bit of a byte: a sign, in the last byte of a value
        assert _id(b) != base, at


def test_a_change_of_one_word_in_every_row_is_seen() -> None:
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    words[:: ROW_BYTES // 8] += 1  # e.g. a missed optimizer step: many small changes
    assert _id(b) != _id(a)


def test_words_moved_between_rows_are_seen() -> None:
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    row = ROW_BYTES // 8
    words[3], words[row + 3] = words[row + 3].clone(), words[3].clone()
    assert _id(b) != _id(a)


def test_words_swapped_inside_one_row_are_not_seen() -> None:
    """The documented blind spot: each row's words are summed, so their order is lost."""
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    words[3], words[5] = words[5].clone(), words[3].clone()
    assert not torch.equal(a, b)
    assert _id(b) == _id(a)


def test_small_or_read_only_chunks_are_hashed_instead() -> None:
    small = torch.zeros(CHECKED_MIN - 1, dtype=torch.uint8)
    assert _id(small) is None
    assert check_id(memoryview(bytes(N)), "k\x000") is None


# --- replicated= in a one-process take ----------------------------------------------------


def _one_process_state() -> dict[str, Any]:
    return {"model": StateDict(random_tensors({"w": (64, 8), "b": 8})), "step": StateDict(n=7)}


def test_entries_matching_replicated_are_marked_in_a_one_process_take(tmp_path: Path) -> None:
    snap = Snapshot.take(str(tmp_path / "run" / "s"), _one_process_state(), replicated=["model/*"])
    entries = snap.get_manifest()
    assert entries["0/model/w"].replicated and entries["0/model/b"].replicated
    plain = Snapshot.take(str(tmp_path / "run" / "t"), _one_process_state())
    assert not plain.get_manifest()["0/model/w"].replicated


def _restore_on_rank(rank: int, world: int, path: str) -> Any:
    target = {"model": StateDict(w=torch.zeros(64, 8), b=torch.zeros(8))}
    try:
        Snapshot(path).restore(target)
    except MissingKeyError as exc:
        return f"missing: {exc}"
    return [target["model"]["w"], target["model"]["b"]]


@pytest.mark.dist
def test_a_one_process_snapshot_resumes_on_two_ranks_when_replicated(tmp_path: Path) -> None:
    expected = _one_process_state()["model"]
    Snapshot.take(str(tmp_path / "run" / "rep"), _one_process_state(), replicated=["**"])
    Snapshot.take(str(tmp_path / "run" / "own"), _one_process_state())

    rep = run_ranks(2, _restore_on_rank, str(tmp_path / "run" / "rep"))
    for outcome in rep:
        assert outcome.error is None, outcome.error_text
        w, b = outcome.value
        assert torch.equal(w, expected["w"]) and torch.equal(b, expected["b"])

    own = run_ranks(2, _restore_on_rank, str(tmp_path / "run" / "own"))
    assert all(o.error is None for o in own), [o.error_text for o in own]
    w, _ = own[0].value
    assert torch.equal(w, expected["w"])  # rank 0 saved it
    assert isinstance(own[1].value, str) and "per-rank state" in own[1].value


# --- replicated only where every rank declared it -----------------------------------------

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
    with replica_warnings() as found:
        rank_globs = [["**"], ["my_stateful/foo", "my_stateful/bar"]][rank]
        snapshot = Snapshot.take(
            f"{root}/w", {"my_stateful": _TestStateful(foo=float(rank))}, replicated=rank_globs
        )
    out["warned"] = [str(w.message) for w in found]
    out["warn_replicated"] = _replicated(snapshot)
    out["read_foo"] = [snapshot.read_object(f"{r}/my_stateful/foo").item() for r in range(world)]
    return out


def _both_ranks(keys: list[str]) -> set[str]:
    return {f"{r}/{k}" for r in range(2) for k in keys}


@pytest.mark.dist
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


# --- replicated values that differ --------------------------------------------------------

OPTS = {"chunk_size": 4096}


def _diverged(rank: int) -> dict[str, Any]:
    # "w" differs between ranks; "same" really is replicated.
    return {"s": StateDict(w=torch.full((8,), float(rank + 1)), same=torch.arange(6.0))}


def warn_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    with replica_warnings() as found:
        snap = Snapshot.take(f"{root}/s1", _diverged(rank), replicated=["s/**"], settings=OPTS)
    manifest = snap.get_manifest()
    flags = {
        f"{r}/{k}": manifest[f"{r}/s/{k}"].replicated for r in range(world) for k in ("w", "same")
    }
    # Each rank restores its own value of the diverged key, and the shared one.
    target = StateDict(w=torch.zeros(8), same=torch.zeros(6))
    Snapshot(f"{root}/s1").restore({"s": target})
    assert torch.equal(target["w"], torch.full((8,), float(rank + 1)))
    assert torch.equal(target["same"], torch.arange(6.0))
    # Nothing is dropped: every rank's value can be read back from any rank.
    read = [snap.read_object(f"{r}/s/w")[0].item() for r in range(world)]
    return {
        "messages": [str(w.message) for w in found],
        "where": [w.filename for w in found],
        "mismatches": [w.message.mismatches for w in found],  # type: ignore[union-attr]
        "flags": flags,
        "read": read,
    }


@pytest.mark.dist
def test_default_warns_naming_keys_and_ranks_and_keeps_each_value(tmp_path: Path) -> None:
    out = values(run_ranks(2, warn_scenario, str(tmp_path / "repo")))
    for o in out:  # every rank warns, once
        (message,) = o["messages"]
        assert "s/w: ranks [0] vs [1]" in message and "s/same" not in message, message
        assert o["mismatches"] == [{"s/w": [[0], [1]]}]
        # The diverged key became per-rank state; the equal one stays replicated.
        assert o["flags"] == {"0/w": False, "1/w": False, "0/same": True, "1/same": True}
        assert o["read"] == [1.0, 2.0]
        assert o["where"] == [__file__]  # the warning points at the line calling take
    assert (tmp_path / "repo" / ".casnap" / "refs" / "s1").exists()


def error_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap.errors import ReplicaMismatchError
    from casnap.settings import override

    errors = []
    # Through the take's settings, and through the setting (set on rank 0 only: its choice
    # holds on every rank, so no rank is left waiting for another that chose otherwise).
    for name, opts, setting in (
        ("e1", {**OPTS, "replica_mismatch": "error"}, None),
        ("e2", OPTS, "error" if rank == 0 else None),
    ):
        try:
            with override(replica_mismatch=setting):
                Snapshot.take(f"{root}/{name}", _diverged(rank), replicated=["s/**"], settings=opts)
        except ReplicaMismatchError as exc:
            errors.append((str(exc), exc.mismatches))
    return {"errors": errors}


@pytest.mark.dist
def test_the_error_option_fails_every_rank_without_a_ref(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = values(run_ranks(2, error_scenario, str(root)))
    for o in out:
        assert len(o["errors"]) == 2, o
        for text, mismatches in o["errors"]:
            assert "s/w: ranks [0] vs [1]" in text and "nothing was written" in text
            assert mismatches == {"s/w": [[0], [1]]}
    refs = root / ".casnap" / "refs"
    assert not (refs / "e1").exists() and not (refs / "e2").exists()


def dtensor_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def replicated(fill: float) -> Any:
        return DTensor.from_local(torch.full((6,), fill), mesh, [Replicate()], run_check=False)

    with replica_warnings() as found:
        Snapshot.take(f"{root}/d", {"m": StateDict(r=replicated(float(rank)))}, settings=OPTS)
    target = StateDict(r=replicated(-1.0))
    Snapshot(f"{root}/d").restore({"m": target})
    return {"warned": [str(w.message) for w in found], "restored": target["r"].to_local().tolist()}


@pytest.mark.dist
def test_a_replicated_dtensor_that_differs_keeps_each_ranks_value(tmp_path: Path) -> None:
    out = values(run_ranks(2, dtensor_scenario, str(tmp_path / "repo")))
    for rank, o in enumerate(out):
        (message,) = o["warned"]
        assert "m/r[offsets=[0]]: ranks [0] vs [1]" in message, message
        assert o["restored"] == [float(rank)] * 6


# Large replicated chunks are compared by check id, and only their writer hashes them
# (casnap.distributed.replica_check): 4 chunks of 256 KiB, 2 written by each rank.
BIG = {"chunk_size": "256KiB"}
BIG_NUMEL = 4 * (256 << 10) // 4  # float32


def _big(rank: int, diverge_at: int | None) -> torch.Tensor:
    w = torch.arange(BIG_NUMEL, dtype=torch.float32)
    if rank == 1 and diverge_at is not None:
        w[diverge_at * (BIG_NUMEL // 4) + 1000] += 0.5  # one value, in chunk ``diverge_at``
    return w


def big_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap.errors import ReplicaMismatchError
    from casnap.format.names import hash_bytes

    def take(name: str, diverge_at: int | None, **opts: Any) -> tuple[Any, list[str]]:
        state = {"s": StateDict(w=_big(rank, diverge_at))}
        with replica_warnings() as found:
            snap = Snapshot.take(
                f"{root}/{name}", state, replicated=["s/**"], settings={**BIG, **opts}
            )
        return snap, [str(w.message) for w in found]

    equal, warned = take("equal", None)
    entry = equal.get_manifest()[f"{rank}/s/w"]
    value = _big(rank, None)
    mine = byte_view(value)  # valid while ``value`` lives
    cs = 256 << 10
    out: dict[str, Any] = {
        "equal_warned": warned,
        "equal_replicated": entry.replicated,
        # The manifest names content hashes (blake3 of the bytes), not check ids.
        "hashes_are_content": [r.hash for r in entry.chunks]
        == [hash_bytes(mine[i * cs : (i + 1) * cs]) for i in range(4)],
        "written": [s.raw_bytes_written for s in equal.last_take_rank_stats or []],
    }
    again, _ = take("again", None)  # unchanged: every chunk found by its real hash
    out["again_written"] = [s.raw_bytes_written for s in again.last_take_rank_stats or []]
    # Rank 1 diverges in one chunk, each chunk in turn: two of them are chunks rank 0
    # writes when the values agree, which rank 1 then never hashes.
    out["diverged"] = []
    for at in range(4):
        snap, warned = take(f"d{at}", at)
        target = StateDict(w=torch.zeros(BIG_NUMEL))
        Snapshot(f"{root}/d{at}").restore({"s": target})
        out["diverged"].append(
            {
                "warned": warned,
                "own": torch.equal(target["w"], _big(rank, at)),
                "replicated": snap.get_manifest()[f"{rank}/s/w"].replicated,
            }
        )
    try:
        take("err", 2, replica_mismatch="error")
        out["error"] = None
    except ReplicaMismatchError as exc:
        out["error"] = exc.mismatches
    return out


@pytest.mark.dist
def test_a_divergence_in_a_large_chunk_another_rank_writes_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = values(run_ranks(2, big_scenario, str(root)))
    for o in out:
        assert o["equal_warned"] == [] and o["equal_replicated"] is True
        assert o["hashes_are_content"]
        assert o["written"] == [2 * (256 << 10)] * 2  # one copy, half each
        assert o["again_written"] == [0, 0]
        for d in o["diverged"]:
            (message,) = d["warned"]
            assert "s/w: ranks [0] vs [1]" in message, message
            assert d["own"] and d["replicated"] is False
        assert o["error"] == {"s/w": [[0], [1]]}
    assert not (root / ".casnap" / "refs" / "err").exists()
