"""Bad input to a public function raises a CasnapError that says what was wrong.

Each error is also the builtin it means: a wrong type is a ``TypeError``
(:class:`casnap.errors.ArgumentTypeError`), a wrong value a ``ValueError``
(:class:`casnap.ConfigError` and friends), a missing snapshot a
``FileNotFoundError``. Nothing is created by a call that was refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from casnap import (
    CasnapError,
    Checkpointer,
    ConfigError,
    KeepLast,
    Repository,
    Session,
    Snapshot,
    SnapshotNotFoundError,
    StateDict,
    export_torch,
)
from casnap.errors import ArgumentTypeError, InvalidNameError
from casnap.repo.tags import add_tag


def _state() -> dict[str, Any]:
    return {"s": StateDict(w=torch.arange(4.0))}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    Snapshot.take(str(tmp_path / "r" / "a"), _state())
    return tmp_path / "r"


Call = Callable[[Path], Any]

TYPE_ERRORS: dict[str, tuple[Call, str]] = {
    "take path": (lambda r: Snapshot.take(5, _state()), "path"),  # type: ignore[arg-type]
    "take app_state": (lambda r: Snapshot.take(f"{r}/b", [1]), "app_state"),  # type: ignore[arg-type]
    "take storage_options": (
        lambda r: Snapshot.take(f"{r}/b", _state(), storage_options=[1]),  # type: ignore[arg-type]
        "storage_options",
    ),
    "take settings": (
        lambda r: Snapshot.take(f"{r}/b", _state(), settings=[1]),  # type: ignore[arg-type]
        "settings",
    ),
    "take repository": (lambda r: Snapshot.take(f"{r}/b", _state(), repository=5), "repository"),  # type: ignore[arg-type]
    "Snapshot repository": (lambda r: Snapshot(f"{r}/a", repository=5).manifest, "repository"),  # type: ignore[arg-type]
    "take metadata": (lambda r: Snapshot.take(f"{r}/b", _state(), metadata="x"), "metadata"),  # type: ignore[arg-type]
    "take parents": (lambda r: Snapshot.take(f"{r}/b", _state(), parents="a"), "parents"),  # type: ignore[arg-type]
    "take replicated": (
        lambda r: Snapshot.take(f"{r}/b", _state(), replicated="w"),  # type: ignore[arg-type]
        "replicated",
    ),
    "take budget": (
        lambda r: Snapshot.take(f"{r}/b", _state(), memory_budget_bytes="1G"),  # type: ignore[arg-type]
        "memory_budget_bytes",
    ),
    "Snapshot path": (lambda r: Snapshot(None), "path"),  # type: ignore[arg-type]
    "restore app_state": (lambda r: Snapshot(f"{r}/a").restore([1]), "app_state"),  # type: ignore[arg-type]
    "read_object path": (lambda r: Snapshot(f"{r}/a").read_object(3), "path"),  # type: ignore[arg-type]
    "Repository url": (lambda r: Repository(5), "url"),  # type: ignore[arg-type]
    "retain policy": (lambda r: Repository(str(r)).retain(3), "policy"),  # type: ignore[arg-type]
    "gc grace": (lambda r: Repository(str(r)).gc(grace_seconds="soon"), "grace_seconds"),  # type: ignore[arg-type]
    "Checkpointer url": (lambda r: Checkpointer(5, every_n_steps=1), "repo_url"),  # type: ignore[arg-type]
    "Checkpointer retention": (
        lambda r: Checkpointer(f"{r}/c", every_n_steps=1, retention=3),
        "retention",
    ),
    "Checkpointer tags": (lambda r: Checkpointer(f"{r}/c", 1, tags="best"), "tags"),
    "maybe_take step": (lambda r: Checkpointer(f"{r}/c", 1).maybe_take("7", _state()), "step"),  # type: ignore[arg-type]
    "maybe_take metrics": (
        lambda r: Checkpointer(f"{r}/c", 1).maybe_take(1, _state(), metrics=[1]),  # type: ignore[arg-type]
        "metrics",
    ),
    "export snapshot": (lambda r: export_torch(f"{r}/a", f"{r}/o.pt"), "snapshot"),  # type: ignore[arg-type]
    "add_tag repo": (lambda r: add_tag(str(r), "t", "a"), "repo"),  # type: ignore[arg-type]
    "Session cache": (lambda r: Session(staging_cache_bytes="1G"), "staging_cache_bytes"),  # type: ignore[arg-type]
}

VALUE_ERRORS: dict[str, tuple[Call, str]] = {
    "take budget": (
        lambda r: Snapshot.take(f"{r}/b", _state(), memory_budget_bytes=-1),
        "memory_budget_bytes",
    ),
    "take chunk size": (
        lambda r: Snapshot.take(f"{r}/b", _state(), settings={"chunk_size": 100}),
        "chunk_size",
    ),
    "take unknown setting": (
        lambda r: Snapshot.take(f"{r}/b", _state(), settings={"chunk": 4096}),
        "chunk",
    ),
    # storage_options are the store's only: casnap's own keys say where they go.
    "take setting as storage option": (
        lambda r: Snapshot.take(f"{r}/b", _state(), storage_options={"chunk_size": 4096}),
        "chunk_size",
    ),
    "repository as storage option": (
        lambda r: Snapshot.take(f"{r}/b", _state(), storage_options={"repository": str(r)}),
        "repository",
    ),
    "Checkpointer unknown setting": (
        lambda r: Checkpointer(f"{r}/c", 1, settings={"io_workers": 2}),
        "io_workers",
    ),
    "read_object budget": (
        lambda r: Snapshot(f"{r}/a").read_object("0/s/w", memory_budget_bytes=0),
        "memory_budget_bytes",
    ),
    "gc grace": (lambda r: Repository(str(r)).gc(grace_seconds=-1), "grace_seconds"),
    "verify part": (lambda r: Repository(str(r)).verify(part=(5, 2)), "part"),
    "Checkpointer every": (lambda r: Checkpointer(f"{r}/c", every_n_steps=0), "every_n_steps"),
    "Checkpointer name_format": (
        lambda r: Checkpointer(f"{r}/c", every_n_steps=1, name_format="{nope}"),
        "name_format",
    ),
    "maybe_take step": (lambda r: Checkpointer(f"{r}/c", 1).maybe_take(-2, _state()), "step"),
    "Session cache": (lambda r: Session(staging_cache_bytes=-1), "staging_cache_bytes"),
}


@pytest.mark.parametrize("case", list(TYPE_ERRORS), ids=str)
def test_a_wrong_type_is_an_argument_type_error(case: str, repo: Path) -> None:
    call, name = TYPE_ERRORS[case]
    with pytest.raises(ArgumentTypeError) as info:
        call(repo)
    assert isinstance(info.value, TypeError) and isinstance(info.value, CasnapError)
    assert info.value.name is not None and info.value.name.startswith(name)
    assert name in str(info.value)
    assert Repository(str(repo)).snapshots() == ["a"]  # nothing was taken


@pytest.mark.parametrize("case", list(VALUE_ERRORS), ids=str)
def test_a_wrong_value_is_a_config_error(case: str, repo: Path) -> None:
    call, name = VALUE_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        call(repo)
    assert isinstance(info.value, ValueError)
    assert info.value.name == name and name in str(info.value)
    assert Repository(str(repo)).snapshots() == ["a"]


def test_a_parent_is_a_snapshot_name_or_a_manifest_hash(repo: Path) -> None:
    a = Repository(str(repo)).resolve("a")
    Snapshot.take(f"{repo}/b", _state(), parents=["a"])
    Snapshot.take(f"{repo}/c", _state(), parents=[a])
    repository = Repository(str(repo))
    assert repository.storage.read_manifest(repository.resolve("b")).parents == [a]
    assert repository.storage.read_manifest(repository.resolve("c")).parents == [a]
    with pytest.raises(SnapshotNotFoundError, match="'nope'"):
        Snapshot.take(f"{repo}/d", _state(), parents=["nope"])
    with pytest.raises(InvalidNameError):
        Snapshot.take(f"{repo}/d", _state(), parents=["../a"])
    assert repository.snapshots() == ["a", "b", "c"]


def test_a_single_rule_is_accepted_where_a_policy_is(repo: Path) -> None:
    Snapshot.take(f"{repo}/b", _state())
    result = Repository(str(repo)).retain(KeepLast(1))
    assert Repository(str(repo)).snapshots() == ["b"]
    assert result is not None


def test_a_refused_take_creates_no_repository(tmp_path: Path) -> None:
    with pytest.raises(ArgumentTypeError):
        Snapshot.take(str(tmp_path / "new" / "s"), _state(), metadata="step 3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Snapshot.take(str(tmp_path / "new" / "s"), _state(), memory_budget_bytes=0)
    assert not (tmp_path / "new").exists()
