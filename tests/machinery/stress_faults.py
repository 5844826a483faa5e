"""Phase "faults": takes against a store failing 10% of calls transiently, with and without retries.

The store is casnap's FaultyStore (casnap/store/faults.py): a failing call
fails before it reaches the disk or, half the time, after it took effect
(a lost response, what makes a committed snapshot look like a conflict:
#10 point 6). The same seeded faults are run twice: through RetryingStore
(every take must succeed, and restore through the same faulty store) and
bare (takes fail; that is the control showing the faults are real). In both,
every snapshot listed afterwards, read through a clean store, must restore
bit-exact, including any whose take reported a failure after its ref landed.
The states and helpers are tests/test_lost_responses.py's.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from stress_common import ROOT, Deadline

sys.path.insert(0, str(ROOT / "tests"))
from helpers import random_tensors  # noqa: E402
from test_lost_responses import SHAPES, _restores, _take  # noqa: E402

from casnap import StateDict  # noqa: E402


def _state(seed: int) -> StateDict:
    return StateDict(random_tensors(SHAPES, seed))


RATE = 0.10


def one_variant(
    root: Path, takes: int | None, seconds: float | None, seed: int, retries: bool
) -> dict[str, Any]:
    from casnap import CasnapError
    from casnap.repo.repository import RepoStorage
    from casnap.store import LocalStore, RetryingStore, RetryPolicy
    from casnap.store.faults import FaultyStore

    RepoStorage.on_store(LocalStore(str(root)))
    faulty = FaultyStore(LocalStore(str(root)), RATE, seed=seed)
    store = RetryingStore(faulty, RetryPolicy(retries=5, delay=0.001)) if retries else faulty
    repo = RepoStorage.on_store(store)
    fig: dict[str, Any] = {
        "takes": 0,
        "succeeded": 0,
        "errors": Counter(),
        "restored_through_faults": 0,
    }
    limit = Deadline(takes, seconds)
    while limit.more():
        i = limit.done
        limit.done += 1
        fig["takes"] += 1
        try:
            _take(repo, f"step_{i}", _state(i))
        except CasnapError as exc:
            fig["errors"][type(exc).__name__] += 1
            continue
        fig["succeeded"] += 1
        if retries:
            try:
                fig["restored_through_faults"] += _restores(repo, f"step_{i}", _state(i))
            except CasnapError as exc:
                fig["errors"][f"restore: {type(exc).__name__}"] += 1
    fig["faults_injected"] = faulty.faults
    fig["errors"] = dict(fig["errors"])
    clean = RepoStorage.on_store(LocalStore(str(root)))
    listed = clean.list_snapshots()
    bad = []
    for name in listed:
        try:
            ok = _restores(clean, name, _state(int(name.split("_")[1])))
        except CasnapError as exc:
            ok = False
            name = f"{name}: {type(exc).__name__}"
        if not ok:
            bad.append(name)
    fig["listed"] = len(listed)
    fig["listed_though_take_failed"] = len(listed) - fig["succeeded"]
    fig["listed_not_restoring"] = bad
    return fig


def run(workdir: Path, takes: int | None, seconds: float | None, seed: int) -> dict[str, Any]:
    return {
        "rate": RATE,
        "with_retries": one_variant(workdir / "with", takes, seconds, seed, retries=True),
        "without_retries": one_variant(workdir / "without", takes, seconds, seed, retries=False),
    }


def invariants(fig: dict[str, Any]) -> dict[str, bool]:
    w, wo = fig["with_retries"], fig["without_retries"]
    return {
        "with retries every take succeeds": w["succeeded"] == w["takes"] > 0,
        "with retries every snapshot restores through the faults": w["restored_through_faults"]
        == w["takes"],
        "every listed snapshot restores (both)": not w["listed_not_restoring"]
        and not wo["listed_not_restoring"],
        "faults were real (control fails takes)": wo["succeeded"] < wo["takes"]
        and w["faults_injected"] > 0,
    }
