"""The Checkpointer as a training loop meets it: every-N-steps takes with metadata and
lineage, the time interval, ``force``, the take on close and on preemption (on one rank
or several), its options and bad arguments, NaN metrics and ``best()``, and retention
with its reclaim (docs/retention.md, "The Checkpointer"). Resuming is in
test_checkpointer_resume.py, the mirror in test_checkpointer_mirror.py."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import select
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
from helpers import reclaimed_of

from casnap import PendingSnapshot, Repository, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer, CheckpointerOptions
from casnap.errors import ConfigError, StoreError
from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy, decide_retention
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

ROOT = Path(__file__).resolve().parents[1]

NAMES = [f"step_{s:09d}" for s in (5, 10, 15, 20)]


def name(step: int) -> str:
    return f"step_{step:09d}"


def fill(state: dict[str, StateDict], step: int) -> None:
    """The training state at ``step``, deterministic, written in place."""
    g = torch.Generator().manual_seed(step)
    state["model"]["w"].copy_(torch.randn(50_000, generator=g))
    state["model"]["b"].copy_(torch.arange(300, dtype=torch.float64) * step)
    state["progress"]["step"] = step


def fresh() -> dict[str, StateDict]:
    return {
        "model": StateDict(w=torch.zeros(50_000), b=torch.zeros(300, dtype=torch.float64)),
        "progress": StateDict(step=-1),
    }


def same_bits(a: dict[str, StateDict], b: dict[str, StateDict]) -> bool:
    return (
        all(
            a["model"][k].view(torch.uint8).equal(b["model"][k].view(torch.uint8))
            for k in ("w", "b")
        )
        and a["progress"]["step"] == b["progress"]["step"]
    )


def expected(step: int) -> dict[str, StateDict]:
    state = fresh()
    fill(state, step)
    return state


def run_loop(ckpt: Checkpointer, state: dict[str, StateDict]) -> list[object]:
    results: list[object] = []
    for step in range(1, 21):
        fill(state, step)
        results.append(ckpt.maybe_take(step, state, metrics={"loss": 100.0 / step}))
        # training moves on: the live tensors change right after the take
        state["model"]["w"].add_(1000.0)
    return results


def manifests(root: Path) -> dict[str, Snapshot]:
    repo = Repository(str(root))
    return {name: Snapshot(f"{root}/{name}") for name in repo.storage.list_snapshots()}


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_of(ckpt: Checkpointer) -> list[int | None]:
    return [s.step for s in ckpt.snapshot_infos()]


def wait_for_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of output; "" if it exits or stays silent for ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


# -- the loop ------------------------------------------------------------------


@pytest.mark.parametrize("async_take", [False, True])
def test_loop_takes_every_n_steps_with_metadata_and_lineage(tmp_path, async_take):
    root = tmp_path / "run"
    state = fresh()
    with Checkpointer(str(root), 5, async_take=async_take, tags=["run1"]) as ckpt:
        results = run_loop(ckpt, state)
        again = ckpt.maybe_take(20, state)  # never twice for one step
    assert again is None
    taken = [r for r in results if r is not None]
    kind = PendingSnapshot if async_take else Snapshot
    assert len(taken) == 4 and all(isinstance(r, kind) for r in taken)
    assert [i for i, r in enumerate(results, 1) if r is not None] == [5, 10, 15, 20]
    assert ckpt.snapshots() == NAMES and ckpt.latest() == NAMES[-1]
    snaps = manifests(root)
    assert list(snaps) == NAMES
    previous: list[str] = []
    for step, name in zip((5, 10, 15, 20), NAMES):
        snap = snaps[name]
        assert snap.metadata == {"step": step, "metrics": {"loss": 100.0 / step}, "tags": ["run1"]}
        assert snap.manifest.parents == previous
        previous = [snap.manifest_hash]
        # point in time: the values at the take, not the ones changed right after it
        out = fresh()
        snap.restore(out)
        assert same_bits(out, expected(step))


def test_an_async_failure_is_raised_once_and_the_step_can_be_retried(tmp_path):
    # Every chunk write fails while armed (a full disk): below, around the take that fails.
    disk_full = lambda key: StoreError("disk full (injected)", key)  # noqa: E731
    local, chunks = LocalStore(str(tmp_path / "run")), (".casnap/chunks/",)
    store = FailingStore(local, 1, prefixes=chunks, fail=disk_full, lasting=True, armed=False)
    repo = Repository.on_store(store, chunk_size=4096)
    ckpt = Checkpointer(repo, 5, async_take=True)
    state = fresh()
    fill(state, 5)
    store.armed = True
    assert isinstance(ckpt.maybe_take(5, state), PendingSnapshot)
    with pytest.raises(StoreError, match="injected"):
        ckpt.wait()
    assert ckpt.wait() is None and ckpt.snapshots() == []
    store.armed = False
    assert isinstance(ckpt.maybe_take(5, state), PendingSnapshot)  # not "already taken"
    ckpt.close()
    assert ckpt.snapshots() == NAMES[:1]


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


# -- options and arguments ---------------------------------------------------


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


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError):
        Checkpointer(str(tmp_path), 0)
    with pytest.raises(ValueError):  # a name that could leave the repository
        Checkpointer(str(tmp_path), 5, name_format="../{step}")
    with pytest.raises(ValueError):
        Checkpointer(str(tmp_path), 5, tags=["no\ncontrol characters"])


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


# -- preemption --------------------------------------------------------------


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


# -- several ranks ------------------------------------------------------------


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


# -- metrics that are not finite, and the best snapshot ------------------------


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
    infos = {s.step: s for s in decide_retention(repo.storage, policy).snapshots}
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


def test_keep_best_with_only_nan_metrics_keeps_none_as_best(tmp_path):
    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepBest(2, "loss")))
    for step in range(1, 5):
        ckpt.maybe_take(step, fresh(), metrics={"loss": float("nan")})
    assert ckpt.best() is None and ckpt.best_step() is None
    assert steps_of(ckpt) == [4]  # only the newest, which the checkpointer always keeps


# -- retention and reclaim -----------------------------------------------------


def test_retention_runs_after_each_commit_and_keeps_foreign_snapshots(tmp_path):
    root = tmp_path / "run"
    Snapshot.take(str(root / "base"), {"model": StateDict(x=torch.ones(10))})
    state = fresh()
    seen = []
    ckpt = Checkpointer(str(root), 5, retention=RetentionPolicy(KeepLast(2)))
    for step in range(1, 21):
        fill(state, step)
        if ckpt.maybe_take(step, state) is not None:
            seen.append(ckpt.snapshots())
    assert seen == [NAMES[:1], NAMES[:2], NAMES[1:3], NAMES[2:4]]
    assert ckpt.last_retention is not None and ckpt.last_retention.deleted == (NAMES[1],)
    repo = Repository(str(root))
    assert repo.storage.list_snapshots() == [
        "base",
        *NAMES[2:],
    ]  # the foreign snapshot is untouched
    # the retired snapshots' manifests were reclaimed: base's and the two kept ones remain
    assert len(list(repo.storage.iter_manifest_names())) == 3


def test_async_retention_applies_when_the_take_is_observed_complete(tmp_path):
    root = tmp_path / "run"
    state = fresh()
    policy = RetentionPolicy(KeepLast(1), KeepBest(1, "loss", mode="max"))
    ckpt = Checkpointer(str(root), 5, async_take=True, retention=policy)
    run_loop(ckpt, state)
    # the last take is pending or committed but not yet retained against
    ckpt.wait()
    # best loss (max) is step 5's; the newest is step 20's
    assert ckpt.snapshots() == [NAMES[0], NAMES[3]]
    assert ckpt.wait() is None  # nothing pending any more


def test_the_newest_snapshot_is_never_retired(tmp_path):
    root = tmp_path / "run"
    state = fresh()
    ckpt = Checkpointer(str(root), 5, retention=RetentionPolicy(KeepBest(1, "loss")))
    for step in (5, 10, 15):
        fill(state, step)
        ckpt.maybe_take(step, state, metrics={"loss": float(step)})
    assert ckpt.snapshots() == [NAMES[0], NAMES[2]]
    plan_reasons = ckpt.last_retention
    assert plan_reasons is not None and plan_reasons.deleted == (NAMES[1],)


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
