"""Concurrent DCP saves to one checkpoint id: no save that returns is left without a ref.

A re-save keeps the version it replaces as ``NAME@<12 hex>`` and replaces the
ref only if it still names that version (a conditional replace); a save that
loses the race to another keeps its own manifest as ``NAME@<12 hex>``
(docs/dcp.md, "What is atomic").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import warnings
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import step_state

import casnap
from casnap.errors import CasnapWarning
from casnap.integrations.dcp import HISTORY_SEP, CasnapReader, CasnapWriter
from casnap.repo.repository import RepoStorage
from casnap.store import CountingStore, LocalStore
from casnap.store.base import Data

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _named(root: Path) -> dict[str, str]:
    """Every snapshot name of the repository and the manifest it names."""
    repo = casnap.Repository(str(root))
    return {name: repo.resolve(name) for name in repo.snapshots()}


class _CommitsInBetween(CountingStore):
    """Lets another save commit just before this store's first write of ``ref``."""

    def __init__(self, inner: LocalStore, ref: str, other_save: object) -> None:
        super().__init__(inner)
        self.ref, self.other_save, self.fired = ref, other_save, False

    def _gate(self, key: str) -> None:
        if key == self.ref and not self.fired:
            self.fired = True
            self.other_save()  # type: ignore[operator]

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        self._gate(key)
        super().put(key, data, create_only=create_only, durable=durable)

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        self._gate(key)
        super().replace(key, data, expected=expected)


def test_a_save_that_loses_the_commit_race_is_kept_in_history(tmp_path):
    # Save A reads the id's version X and is about to replace its ref when save B
    # commits X -> B. A must not overwrite B (last writer wins): B stays current,
    # and A, which returns normally, is kept as latest@<its hash>.
    root, path = tmp_path / "run", tmp_path / "run" / "latest"
    dcp.save(step_state(1, 256, 1.0), storage_writer=CasnapWriter(path))
    old = _named(root)["latest"]
    other = CasnapWriter(path)
    gated = _CommitsInBetween(
        LocalStore(str(root)),
        ".casnap/refs/latest",
        lambda: dcp.save(step_state(3, 256, 3.0), storage_writer=other),
    )
    writer = CasnapWriter(path, repository=RepoStorage.on_store(gated))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(step_state(2, 256, 2.0), storage_writer=writer)
    assert gated.fired
    mine, theirs = writer.last_manifest, other.last_manifest
    assert mine is not None and theirs is not None and len({old, mine, theirs}) == 3
    named = _named(root)
    assert named == {
        "latest": theirs,
        f"latest{HISTORY_SEP}{old[:12]}": old,
        f"latest{HISTORY_SEP}{mine[:12]}": mine,
    }
    assert any(
        issubclass(w.category, CasnapWarning) and mine[:12] in str(w.message) for w in caught
    )
    back = step_state(0, 256, 0.0)
    dcp.load(back, storage_reader=CasnapReader(root / f"latest{HISTORY_SEP}{mine[:12]}"))
    assert back["step"] == 2 and bool((back["w"] == 2.0).all())


def test_a_first_save_that_loses_the_race_is_kept_in_history(tmp_path):
    # Two saves to a new id: the one whose create comes second keeps its save.
    root, path = tmp_path / "run", tmp_path / "run" / "latest"
    casnap.Repository.init(str(root))
    other = CasnapWriter(path)
    gated = _CommitsInBetween(
        LocalStore(str(root)),
        ".casnap/refs/latest",
        lambda: dcp.save(step_state(3, 256, 3.0), storage_writer=other),
    )
    writer = CasnapWriter(path, repository=RepoStorage.on_store(gated))
    dcp.save(step_state(2, 256, 2.0), storage_writer=writer)
    mine, theirs = writer.last_manifest, other.last_manifest
    assert mine is not None and theirs is not None
    assert _named(root) == {"latest": theirs, f"latest{HISTORY_SEP}{mine[:12]}": mine}


def _saver(path: str, out: str, who: int, saves: int, start: object) -> None:
    warnings.simplefilter("ignore")
    results: list[dict[str, str]] = []
    start.wait()  # type: ignore[attr-defined]
    for i in range(saves):
        writer = CasnapWriter(path)
        try:
            dcp.save(step_state(i, 256, float(who * 1000 + i)), storage_writer=writer)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        assert writer.last_manifest is not None
        results.append({"manifest": writer.last_manifest})
    Path(out).write_text(json.dumps(results))


@pytest.mark.slow
def test_two_processes_saving_to_one_id_lose_no_returned_save(tmp_path):
    root, path = tmp_path / "run", tmp_path / "run" / "latest"
    dcp.save(step_state(0, 256, 0.0), storage_writer=CasnapWriter(path))
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    saves = 20
    outs = [tmp_path / f"saver{who}.json" for who in (1, 2)]
    procs = [
        ctx.Process(target=_saver, args=(str(path), str(out), who, saves, start))
        for who, out in zip((1, 2), outs, strict=True)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0
    results = [r for out in outs for r in json.loads(out.read_text())]
    returned = [r["manifest"] for r in results if "manifest" in r]
    errors = [r["error"] for r in results if "error" in r]
    named = set(_named(root).values())
    assert [m for m in returned if m not in named] == []  # none returned and vanished
    assert errors == []  # a lost race keeps the save in history rather than fail it
    assert len(returned) == 2 * saves
    assert casnap.Repository(str(root)).verify().ok
