"""Each Checkpointer option as a user meets it: forced takes, the take on close, the time
interval, the SIGTERM take, NaN metrics, best(), restore(step=...), and resuming past a
damaged newest snapshot (docs/retention.md, "The Checkpointer")."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks, values
from helpers import chunk_path, reclaimed_of, tensor_entry
from test_checkpointer import expected, fill, fresh, same_bits, wait_for_line

from casnap import IntegrityError, Repository, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer, CheckpointerOptions
from casnap.errors import ConfigError, SnapshotNotFoundError
from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy, plan_retention

ROOT = Path(__file__).resolve().parents[1]


def name(step: int) -> str:
    return f"step_{step:09d}"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_of(ckpt: Checkpointer) -> list[int | None]:
    return [s.step for s in ckpt.snapshot_infos()]


# -- when it takes -----------------------------------------------------------


def test_force_takes_off_the_interval_and_never_twice(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "run"), every_n_steps=10)
    state = fresh()
    fill(state, 3)
    assert ckpt.maybe_take(3, state) is None  # not a multiple of 10
    snap = ckpt.maybe_take(3, state, force=True)
    assert isinstance(snap, Snapshot) and snap.metadata["step"] == 3
    assert ckpt.maybe_take(3, state, force=True) is None  # one snapshot per step
    assert ckpt.should_take(10) and not ckpt.should_take(11)
    assert steps_of(ckpt) == [3]


def test_every_seconds_counts_from_the_last_take(tmp_path):
    clock = FakeClock()
    ckpt = Checkpointer(str(tmp_path / "run"), every_seconds=timedelta(minutes=1), clock=clock)
    state = fresh()
    taken = []
    # (seconds since start, step): a take at 61 s; the next 60 s after it, at 125 s
    for t, step in [(10, 1), (61, 2), (100, 3), (120, 4), (125, 5), (130, 6)]:
        clock.now = 1000.0 + t
        if ckpt.maybe_take(step, state) is not None:
            taken.append(step)
    assert taken == [2, 5]
    assert ckpt.every_seconds == 60.0


def test_every_seconds_and_every_n_steps_either_triggers(tmp_path):
    clock = FakeClock()
    ckpt = Checkpointer(str(tmp_path / "run"), 10, every_seconds=30, clock=clock)
    state = fresh()
    taken = []
    for step in range(1, 25):
        clock.now += 4.0  # 4 s a step: the clock triggers every 8th step after a take
        if ckpt.maybe_take(step, state) is not None:
            taken.append(step)
    # 8 (32 s); 10 (the step interval; restarts the clock); 18 (32 s after 10); 20
    assert taken == [8, 10, 18, 20]


def test_every_seconds_on_the_real_clock(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "run"), every_seconds=1.0)  # a loaded CI machine stalls
    state = fresh()
    assert ckpt.maybe_take(1, state) is None
    time.sleep(1.05)
    assert ckpt.maybe_take(2, state) is not None
    assert ckpt.maybe_take(3, state) is None  # counts from the end of the take


def test_a_checkpointer_without_an_interval_resumes_and_refuses_only_maybe_take(tmp_path):
    url = str(tmp_path / "run")
    with Checkpointer(url, every_n_steps=2) as writer:
        state = fresh()
        for step in range(5):
            fill(state, step)
            writer.maybe_take(step, state)
    ckpt = Checkpointer(url)  # a resuming script: no interval
    assert ckpt.latest_step() == 4
    state = fresh()
    assert ckpt.restore_latest(state) == 4
    assert same_bits(state, expected(4))
    ckpt.restore(state, step=2)
    assert same_bits(state, expected(2))
    with pytest.raises(ConfigError, match="maybe_take needs an interval") as caught:
        ckpt.maybe_take(5, state)
    assert "every_n_steps" in str(caught.value) and "every_seconds" in str(caught.value)
    with pytest.raises(ConfigError, match="should_take needs an interval"):
        ckpt.should_take(6)
    assert steps_of(ckpt) == [0, 2, 4]  # nothing was taken
    fill(state, 5)
    assert ckpt.maybe_take(5, state, force=True) is not None  # force needs no interval
    assert steps_of(ckpt) == [0, 2, 4, 5]


def test_options_as_one_value_and_as_keywords_are_the_same(tmp_path):
    options = CheckpointerOptions(every_n_steps=3, name_format="s{step}", tags=["a"])
    ckpt = Checkpointer(str(tmp_path / "run"), options=options, every_n_steps=2)
    assert (ckpt.every_n_steps, ckpt.name_format, ckpt.tags) == (2, "s{step}", ["a"])
    assert options.every_n_steps == 3  # the value is not changed
    state = fresh()
    fill(state, 2)
    assert ckpt.maybe_take(2, state) is not None and ckpt.snapshots() == ["s2"]
    # Every option is a keyword of the constructor (typed by the dataclass's own fields).
    defaults = CheckpointerOptions()
    every = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(CheckpointerOptions)}
    assert Checkpointer(str(tmp_path / "other"), **every).options == defaults
    with pytest.raises(ConfigError, match="reclaim_wait_seconds"):
        CheckpointerOptions(reclaim_wait_seconds=-1)


def test_an_interval_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="every_seconds"):
        Checkpointer(str(tmp_path), every_seconds=0)
    with pytest.raises(ConfigError, match="every_seconds"):
        Checkpointer(str(tmp_path), every_seconds=float("nan"))
    with pytest.raises(ConfigError, match="take_on_preemption"):
        Checkpointer(str(tmp_path), 1, take_on_preemption="SIGTERM")


@pytest.mark.parametrize("async_take", [False, True])
def test_take_on_close_takes_the_last_step_once(tmp_path, async_take):
    root = str(tmp_path / "run")
    state = fresh()
    with Checkpointer(root, 10, take_on_close=True, async_take=async_take) as ckpt:
        for step in range(1, 14):
            fill(state, step)
            ckpt.maybe_take(step, state, metrics={"loss": 1.0 / step})
    assert steps_of(ckpt) == [10, 13]
    ckpt.close()  # again: step 13 is not taken twice
    assert steps_of(ckpt) == [10, 13]
    out = fresh()
    Snapshot(f"{root}/{name(13)}").restore(out)
    assert same_bits(out, expected(13))
    assert Snapshot(f"{root}/{name(13)}").metadata["metrics"] == {"loss": 1.0 / 13}


def test_no_take_on_close_by_default_nor_when_leaving_with_an_exception(tmp_path):
    state = fresh()
    with Checkpointer(str(tmp_path / "a"), 10) as plain:
        for step in range(1, 14):
            plain.maybe_take(step, state)
    assert steps_of(plain) == [10]

    failing = Checkpointer(str(tmp_path / "b"), 10, take_on_close=True)
    with pytest.raises(RuntimeError, match="loss exploded"), failing:
        for step in range(1, 14):
            failing.maybe_take(step, state)
        raise RuntimeError("loss exploded")  # the state may be mid-step: not taken
    assert steps_of(failing) == [10]


# -- metrics that are not finite ------------------------------------------------


def test_nan_and_infinite_metrics_are_stored_and_never_best(tmp_path):
    root = str(tmp_path / "run")
    policy = RetentionPolicy(KeepLast(1), KeepBest(1, "loss"))
    ckpt = Checkpointer(root, 1, retention=policy)
    state = fresh()
    losses = {1: 0.5, 2: float("nan"), 3: torch.tensor(float("nan")), 4: float("-inf"), 5: 0.9}
    for step, loss in losses.items():
        ckpt.maybe_take(step, state, metrics={"loss": loss, "acc": float("inf")})
    # training went on; the NaN snapshots were stored, then retired like any other
    assert Snapshot(f"{root}/{name(5)}").metadata["metrics"] == {"loss": 0.9, "acc": "Infinity"}
    assert steps_of(ckpt) == [1, 5]  # best (0.5) and newest; -inf is no "min"
    assert ckpt.best_step() == 1 and ckpt.best() == name(1)

    repo = Repository(root)
    infos = {s.step: s for s in plan_retention(repo.storage, policy).snapshots}
    assert infos[5].metric("acc") == math.inf and infos[1].metric("loss") == 0.5
    # every "acc" is +inf: no best in either mode
    assert ckpt.best("acc", "max") is None and ckpt.best("acc", "min") is None


def test_keep_best_ignores_nan_in_both_modes(tmp_path):
    root = str(tmp_path / "run")
    state = fresh()
    for mode in ("min", "max"):
        ckpt = Checkpointer(root, 1, name_format=mode + "_{step}")
        for step, loss in enumerate([float("nan"), 2.0, float("nan"), 1.0, float("nan")], 1):
            ckpt.maybe_take(step, state, metrics={"loss": torch.tensor(loss)})
        kept = KeepBest(1, "loss", mode).select(ckpt.snapshot_infos(), None)  # type: ignore[arg-type]
        assert list(kept) == [f"{mode}_{4 if mode == 'min' else 2}"]
        assert Snapshot(f"{root}/{mode}_1").metadata["metrics"] == {"loss": "NaN"}


def test_best_by_an_explicit_metric_or_the_retention_rule(tmp_path):
    ckpt = Checkpointer(
        str(tmp_path / "run"),
        1,
        retention=RetentionPolicy(KeepLast(10), KeepBest(1, "acc", mode="max")),
    )
    state = fresh()
    assert ckpt.best_step() is None  # no snapshot yet
    for step, (loss, acc) in enumerate([(3.0, 0.1), (1.0, 0.7), (2.0, 0.9), (1.0, 0.8)], 1):
        ckpt.maybe_take(step, state, metrics={"loss": loss, "acc": acc})
    assert ckpt.best_step() == 3  # the retention's KeepBest: acc, max
    assert ckpt.best_step("loss") == 4  # min by default; a tie goes to the newer
    assert ckpt.best_step("loss", "max") == 1
    assert ckpt.best("nope") is None
    with pytest.raises(ConfigError, match="needs a metric"):
        Checkpointer(str(tmp_path / "run"), 1).best()
    with pytest.raises(ValueError, match="mode"):
        ckpt.best("loss", "median")  # type: ignore[arg-type]


# -- restoring a chosen step ---------------------------------------------------------


def test_restore_a_given_step_and_continue_from_it(tmp_path):
    root = str(tmp_path / "run")
    state = fresh()
    first = Checkpointer(root, 5)
    for step in (5, 10, 15):
        fill(state, step)
        first.maybe_take(step, state)
    ckpt = Checkpointer(root, 5)
    out = fresh()
    snap = ckpt.restore(out, step=10)
    assert snap.metadata["step"] == 10 and same_bits(out, expected(10))
    fill(out, 11)
    taken = ckpt.maybe_take(11, out, force=True)
    assert isinstance(taken, Snapshot) and taken.manifest.parents == [snap.manifest_hash]
    with pytest.raises(SnapshotNotFoundError, match=r"step 7 .*5, 10, 11, 15") as err:
        ckpt.restore(out, step=7)
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(SnapshotNotFoundError, match="none"):
        Checkpointer(str(tmp_path / "absent"), 5).restore(fresh(), step=1)


# -- resuming past damage ---------------------------------------------------------------

CHUNK = 16 * 1024


def take_steps(root: str, steps: list[int]) -> Checkpointer:
    ckpt = Checkpointer(root, 5, storage_options={"chunk_size": CHUNK})
    state = fresh()
    for step in steps:
        fill(state, step)
        ckpt.maybe_take(step, state, metrics={"loss": 1.0 / step})
    return ckpt


def flip_a_chunk_byte(root: Path, step: int, *, delete: bool = False) -> str:
    """Flip one byte in (or delete) a loose chunk of ``step``'s weights (a chunk no other
    step shares)."""
    ref = tensor_entry(Snapshot(f"{root}/{name(step)}").get_manifest(), "0/model/w").chunks[6]
    assert ref.pack is None
    path = chunk_path(root, ref.hash)
    if delete:
        path.unlink()
        return ref.hash
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    return ref.hash


def test_a_missing_chunk_in_the_newest_snapshot_is_skipped_too(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 10, delete=True)
    state = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5))
    assert any("missing" in r.getMessage() and name(10) in r.getMessage() for r in caplog.records)


def test_restore_latest_resumes_from_the_newest_snapshot_that_restores(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10, 15])
    flip_a_chunk_byte(root, 15)

    ckpt = Checkpointer(str(root), 5)
    state = fresh()
    fill(state, 99)  # whatever the failed attempt wrote is overwritten by step 10's values
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert ckpt.restore_latest(state) == 10
    assert same_bits(state, expected(10))
    skipped = [r.getMessage() for r in caplog.records if "skipping snapshot" in r.getMessage()]
    assert len(skipped) == 1 and name(15) in skipped[0] and "IntegrityError" in skipped[0]
    # the next take continues from step 10
    fill(state, 11)
    snap = ckpt.maybe_take(11, state, force=True)
    assert isinstance(snap, Snapshot)
    assert snap.manifest.parents == [Snapshot(f"{root}/{name(10)}").manifest_hash]

    # a new process knows the damage from its record: it does not even try step 15
    caplog.clear()
    again = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(again) == 11
    assert same_bits(again, state)
    skipped = [r.getMessage() for r in caplog.records if "skipping snapshot" in r.getMessage()]
    assert len(skipped) == 1 and name(15) in skipped[0] and "recorded as damaged" in skipped[0]


def test_a_recorded_damage_is_skipped_without_reading_data(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 10)
    with pytest.raises(IntegrityError):  # found by a plain restore: recorded as damaged
        Snapshot(f"{root}/{name(10)}").restore(fresh())
    state = fresh()
    fill(state, 99)
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5))
    assert any("recorded as damaged" in r.getMessage() for r in caplog.records)


def test_an_unreadable_newest_manifest_is_skipped(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    manifest = Repository(str(root)).snapshots()  # both refs
    mhash = Snapshot(f"{root}/{name(10)}").manifest_hash
    path = root / ".casnap" / "manifests" / mhash[:2] / mhash
    path.write_bytes(path.read_bytes()[:-5] + b"xxxxx")
    state = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5)) and manifest == [name(5), name(10)]
    assert any(name(10) in r.getMessage() for r in caplog.records)


def test_when_no_snapshot_restores_the_error_lists_them(tmp_path):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 5)
    flip_a_chunk_byte(root, 10)
    with pytest.raises(IntegrityError, match=rf"tried, newest first: {name(10)}: .*{name(5)}: "):
        Checkpointer(str(root), 5).restore_latest(fresh())


def test_a_key_mismatch_is_raised_not_skipped(tmp_path):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    with pytest.raises(KeyError):  # the user's app_state is wrong for every snapshot
        Checkpointer(str(root), 5).restore_latest({"other": StateDict(x=torch.zeros(1))})


# -- preemption ---------------------------------------------------------------------------


def test_a_signal_takes_the_next_step_then_reaches_the_previous_handler(tmp_path):
    heard: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    try:
        previous = signal.getsignal(signal.SIGTERM)
        ckpt = Checkpointer(str(tmp_path / "run"), 100, take_on_preemption=True)
        state = fresh()
        assert ckpt.maybe_take(1, state) is None
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not handled yet
        assert heard == []
        fill(state, 2)
        snap = ckpt.maybe_take(2, state)
        assert isinstance(snap, Snapshot) and heard == [signal.SIGTERM]
        assert ckpt.maybe_take(3, state) is None  # once per signal
        # after a signal that arrives behind the last maybe_take, close takes that step
        os.kill(os.getpid(), signal.SIGTERM)
        ckpt.close()
        assert heard == [signal.SIGTERM] * 2 and steps_of(ckpt) == [2, 3]
        assert signal.getsignal(signal.SIGTERM) is previous  # put back on close
    finally:
        signal.signal(signal.SIGTERM, original)


PREEMPTED_CHILD = """
import sys, time
from casnap.api.checkpointer import Checkpointer

{helpers}

ckpt = Checkpointer(sys.argv[1], 1000, take_on_preemption=True, async_take=sys.argv[2] == "1")
state = fresh()
for step in range(1, 100_000):
    fill(state, step)
    ckpt.maybe_take(step, state, metrics={{"loss": 1.0 / step}})
    print(f"STEP {{step}}", flush=True)
    time.sleep(0.02)
print("NOT STOPPED", flush=True)
"""


@pytest.mark.parametrize("async_take", [False, True])
def test_sigterm_mid_loop_takes_that_step_and_the_process_ends(tmp_path, async_take):
    root = tmp_path / "run"
    script = tmp_path / "child.py"
    helpers = inspect.getsource(fresh) + "\n\n" + inspect.getsource(fill)
    script.write_text(
        "import torch\nfrom casnap import StateDict\n"
        + textwrap.dedent(PREEMPTED_CHILD).format(helpers=helpers)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), "1" if async_take else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        lines = [wait_for_line(proc, timeout=60) for _ in range(3)]
        assert lines[-1].startswith("STEP"), f"child said {lines!r}"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err  # the default action, after the take
    printed = [int(line.split()[1]) for line in lines + out.splitlines() if line.startswith("STEP")]
    # the step in progress when the signal came is taken, and nothing after it
    snaps = Checkpointer(str(root), 1000).snapshot_infos()
    assert [s.step for s in snaps] == [printed[-1] + 1], err
    state = fresh()
    assert Checkpointer(str(root), 1000).restore_latest(state) == printed[-1] + 1
    assert same_bits(state, expected(printed[-1] + 1))


# -- several ranks ----------------------------------------------------------------------


def time_trigger_on_two_ranks(rank: int, world: int, root: str) -> list[int]:
    clock = FakeClock()
    ckpt = Checkpointer(root, every_seconds=30, clock=clock)
    state = {"progress": StateDict(step=-1, rank=rank)}
    taken = []
    for step in range(1, 7):
        clock.now += 20.0 if rank == 0 else 1.0  # only rank 0's clock says "due"
        state["progress"]["step"] = step
        if ckpt.maybe_take(step, state) is not None:
            taken.append(step)
    return taken


@pytest.mark.dist
def test_the_time_trigger_is_agreed_across_ranks(tmp_path):
    root = str(tmp_path / "run")
    assert values(run_ranks(2, time_trigger_on_two_ranks, root)) == [[2, 4, 6], [2, 4, 6]]
    assert Repository(root).snapshots() == [name(2), name(4), name(6)]


def test_take_on_preemption_needs_the_main_thread(tmp_path):
    import threading

    errors: list[BaseException] = []

    def build() -> None:
        try:
            Checkpointer(str(tmp_path / "run"), 5, take_on_preemption=True)
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "main thread" in str(errors[0])


# -- review follow-ups ---------------------------------------------------------


@pytest.mark.parametrize(
    "app_state, metrics",
    [
        ({"m": 5}, None),  # a value without state_dict()
        ({"m": StateDict(w=torch.zeros(3))}, {"loss": {1, 2}}),  # not JSON
        ({"m": StateDict(w=torch.zeros(3))}, {"loss": torch.zeros(2)}),  # not one number
    ],
    ids=["no-state-dict", "set-metric", "vector-metric"],
)
def test_bad_input_to_the_first_take_creates_no_repository(tmp_path, app_state, metrics):
    root = tmp_path / "run"
    ckpt = Checkpointer(str(root), 1)
    with pytest.raises((TypeError, ValueError)):
        ckpt.maybe_take(0, app_state, metrics=metrics)
    assert not root.exists()
    assert ckpt.snapshots() == [] and ckpt.restore_latest(fresh()) is None
    ckpt.maybe_take(0, fresh(), metrics={"loss": 1.0})  # good input then works
    assert ckpt.snapshots() == [name(0)]


def test_keep_best_with_only_nan_metrics_keeps_none_as_best(tmp_path):
    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepBest(2, "loss")))
    for step in range(1, 5):
        ckpt.maybe_take(step, fresh(), metrics={"loss": float("nan")})
    assert ckpt.best() is None and ckpt.best_step() is None
    assert steps_of(ckpt) == [4]  # only the newest, which the checkpointer always keeps


class _Gone:
    """A class that later "disappears" (see the test below)."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_an_object_that_cannot_be_unpickled_is_not_skipped_as_damage(tmp_path, monkeypatch):
    from casnap.errors import ObjectLoadError

    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1)
    ckpt.maybe_take(1, expected(1))
    later = expected(2)
    later["extra"] = StateDict(obj=_Gone(7))
    Snapshot.take(f"{root}/{name(2)}", later, allow_pickle=True, metadata={"step": 2})
    monkeypatch.delattr(sys.modules[__name__], "_Gone")  # the class is gone in this process

    state = fresh()
    state["extra"] = StateDict(obj=None)
    with pytest.raises(ObjectLoadError, match="cannot be loaded"):
        Checkpointer(root, 1).restore_latest(state, allow_pickle=True)
    assert same_bits(state, fresh())  # the tensors were filled, then rolled back


def test_a_fallback_names_the_tensors_the_older_snapshot_does_not_hold(tmp_path, caplog):
    root = tmp_path / "run"
    ckpt = take_steps(str(root), [5])
    state = expected(10)
    state["model"]["v"] = torch.ones(100)  # a tensor new in step 10
    ckpt.maybe_take(10, state)
    flip_a_chunk_byte(root, 10)
    target = fresh()
    target["model"]["v"] = torch.zeros(100)
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(target) == 5
    warned = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
    assert len(warned) == 1 and "0/model/v" in warned[0]


def test_a_reclaim_that_fails_does_not_stop_training_and_is_retried(tmp_path, monkeypatch, caplog):
    import casnap.api.checkpointer_parts as module
    from casnap.errors import StoreError
    from casnap.gc.reclaim import reclaim as real  # what module.reclaim is

    def flaky(repo, retired, **kwargs):
        raise StoreError("the store went away mid-sweep")

    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)))
    ckpt.maybe_take(1, expected(1))
    monkeypatch.setattr(module, "reclaim", flaky)  # a store fault during the sweep
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert isinstance(ckpt.maybe_take(2, expected(2)), Snapshot)  # committed all the same
    assert any("reclaim after retention failed" in r.getMessage() for r in caplog.records)
    pending = reclaimed_of(ckpt).pending
    assert len(pending) == 1
    monkeypatch.setattr(module, "reclaim", real)
    ckpt.maybe_take(3, expected(3))
    assert reclaimed_of(ckpt).deleted_manifests == 2  # step 1's, then step 2's
    assert steps_of(ckpt) == [3]
