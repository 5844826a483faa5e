"""The public face: a narrow top level, each name documented, and the names that left it
still working one release as deprecated aliases."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import casnap
from casnap import Repository, Snapshot, StateDict, errors
from casnap.repo.tags import TagInfo

DOCS = Path(__file__).resolve().parent.parent / "docs"

# casnap.__all__ of release 0.1.0: names a user's code may hold.
OLD_TOP_LEVEL = [
    "ArgumentTypeError",
    "CasnapError",
    "CasnapWarning",
    "Checkpointer",
    "ConditionalReplaceUnsupportedError",
    "ConfigError",
    "CopyIntegrityError",
    "CopyResult",
    "DamagedSourceError",
    "DeltaBaseError",
    "DistributedTakeError",
    "GcBlockedError",
    "GcBusyError",
    "GcRefusedError",
    "IntegrityError",
    "InvalidNameError",
    "KeepBest",
    "KeepEveryStep",
    "KeepLast",
    "KeepTagged",
    "KeepWithin",
    "LeaseLostError",
    "ManifestValidationError",
    "MissingKeyError",
    "ObjectChangedError",
    "ObjectExistsError",
    "ObjectLoadError",
    "ObjectNotFoundError",
    "ObjectRefusedError",
    "OutputSpaceError",
    "PendingSnapshot",
    "PickleNotAllowedError",
    "RNGState",
    "ReplicaMismatchError",
    "ReplicaMismatchWarning",
    "Repository",
    "RepositoryError",
    "RepositoryNotFoundError",
    "RetentionError",
    "RetentionPlan",
    "RetentionPolicy",
    "Session",
    "ShapeMismatchError",
    "Snapshot",
    "SnapshotChangedError",
    "SnapshotExistsError",
    "SnapshotNotFoundError",
    "SourceFormatError",
    "SourceNotFoundError",
    "StateDict",
    "StateError",
    "Stateful",
    "StoreError",
    "TagInfo",
    "TooLargeError",
    "UnexpectedKeyError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
    "add_tag",
    "copy",
    "execute_retention",
    "export_safetensors",
    "export_torch",
    "list_tags",
    "plan_retention",
    "remove_tag",
    "settings",
]


def test_the_top_level_is_narrow_and_each_name_is_documented_with_a_reason():
    assert len(OLD_TOP_LEVEL) == 67
    assert len(casnap.__all__) <= 30 and len(set(casnap.__all__)) == len(casnap.__all__)
    text = (DOCS / "architecture.md").read_text()
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \| .+ \|$", section, re.M)
    assert sorted(documented) == sorted(casnap.__all__)
    for name in casnap.__all__:
        assert getattr(casnap, name) is not None


def _old(name: str) -> tuple[Any, str]:
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(casnap, name)
    message = str(caught[0].message)
    assert message.startswith(f"casnap.{name} is deprecated") and "; use casnap." in message
    return value, message


def test_every_name_that_left_the_top_level_still_works_with_a_warning():
    gone = [n for n in OLD_TOP_LEVEL if n not in casnap.__all__]
    assert len(gone) == 67 - len(casnap.__all__) + 1  # "errors" is new at the top
    for name in gone:
        value, message = _old(name)
        if name in errors.__all__:
            assert value is getattr(errors, name)
            assert message.endswith(f"use casnap.errors.{name}")
    assert _old("TagInfo")[0] is TagInfo
    assert _old("CopyResult")[0] is casnap.ops.copy.CopyResult
    assert _old("RetentionPlan")[0] is casnap.ops.retention.RetentionPlan
    assert _old("add_tag")[1].endswith("use casnap.Repository(url).tag(tag, snapshot)")
    with pytest.raises(AttributeError):
        casnap.no_such_name  # noqa: B018
    # The warning points at the user's line, and `from casnap import` warns too.
    with pytest.warns(DeprecationWarning) as caught:
        from casnap import GcBusyError  # noqa: F401
    assert caught[-1].filename == __file__


def _take(url: str, name: str, step: int, value: float) -> None:
    state = {"model": StateDict(w=torch.full((64,), value)), "progress": StateDict(step=step)}
    Snapshot.take(f"{url}/{name}", state, metadata={"step": step})


def test_the_deprecated_functions_take_a_repository_as_they_did(tmp_path):
    url = str(tmp_path / "run1")
    for step in (1, 2, 3):
        _take(url, f"step_{step}", step, float(step))
    repo = Repository(url)
    assert _old("add_tag")[0](repo, "best", "step_2").snapshot == "step_2"
    assert list(_old("list_tags")[0](repo)) == ["best"]
    plan = _old("plan_retention")[0](repo, casnap.RetentionPolicy(casnap.KeepLast(1)))
    assert set(plan.keep) == {"step_3"}
    _old("execute_retention")[0](repo, plan)
    assert _old("remove_tag")[0](repo, "best").snapshot == "step_2"
    copied = _old("copy")[0](repo, str(tmp_path / "mirror"))
    assert repo.snapshots() == ["step_3"]  # the tag pins step_2's data, not its name
    assert copied.copied == ("step_3",)
    assert Repository(str(tmp_path / "mirror")).snapshots() == ["step_3"]
