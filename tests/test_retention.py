"""Retention rules keep exactly what they say; plans delete nothing; execution deletes refs only.

One repository of 13 snapshots is built once per module and copied for each test
that changes it:

- ``base``: no step, no metrics (a foreign snapshot, oldest);
- ``s010`` … ``s120``: steps 10 … 120 with a ``loss`` metric (``s080`` has none),
  ``acc`` at the top level of the metadata for a few, ``metadata["tags"]`` on
  ``s030`` and ``s070``; and a repository tag ``release`` on ``s050``.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import step_state

from casnap import CasnapError, Snapshot, SnapshotNotFoundError, StateDict
from casnap.errors import (
    InvalidNameError,
    ManifestValidationError,
    ObjectExistsError,
    RetentionError,
)
from casnap.ops.retention import (
    KeepBest,
    KeepEveryStep,
    KeepLast,
    KeepTagged,
    KeepWithin,
    RetentionPolicy,
    RetentionRule,
    decide_retention,
    execute_retention,
    read_snapshots,
)
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import TagInfo, add_tag, list_tags, read_tag, remove_tag, tag_key

STEPS = list(range(10, 130, 10))
LOSS = {
    10: 5.0,
    20: 4.0,
    30: 4.5,
    40: 3.0,
    50: 3.5,
    60: 2.0,
    70: 2.5,
    90: 1.5,
    100: 7.0,
    110: 1.8,
    120: 9.0,
}
ACC = {20: 0.7, 60: 0.9, 100: 0.8, 110: True}  # True is not a number: never "best"
META_TAGS = {30: ["milestone"], 70: ["eval", "milestone"]}
ALL = {"base"} | {f"s{s:03d}" for s in STEPS}


def _state(step: int) -> dict[str, StateDict]:
    return {"model": StateDict(step_state(step, 2000))}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retention") / "repo"
    Snapshot.take(str(root / "base"), _state(0))
    for step in STEPS:
        meta: dict[str, object] = {"step": step, "metrics": {}}
        if step in LOSS:
            meta["metrics"] = {"loss": LOSS[step]}
        if step in ACC:
            meta["acc"] = ACC[step]
        if step in META_TAGS:
            meta["tags"] = META_TAGS[step]
        Snapshot.take(str(root / f"s{step:03d}"), _state(step), metadata=meta)
    add_tag(RepoStorage.open(str(root)), "release", "s050")
    return root


@pytest.fixture
def repo(built: Path, tmp_path: Path) -> RepoStorage:
    root = tmp_path / "repo"
    shutil.copytree(built, root)
    return RepoStorage.open(str(root))


def kept(repo: RepoStorage, *rules: RetentionRule, **kwargs: Any) -> set[str]:
    plan = decide_retention(repo, RetentionPolicy(*rules), **kwargs)
    assert set(plan.keep) | set(plan.delete) == ALL
    assert not set(plan.keep) & set(plan.delete)
    return set(plan.keep)


def files(root: str, folder: str) -> set[str]:
    base = Path(root) / ".casnap" / folder
    return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()}


# -- each rule -----------------------------------------------------------------
def test_keep_last_orders_by_step_and_keeps_exactly_n(repo):
    assert kept(repo, KeepLast(3)) == {"s100", "s110", "s120"}
    assert kept(repo, KeepLast(1)) == {"s120"}
    # the snapshot without a step sorts before every stepped one
    assert kept(repo, KeepLast(12)) == ALL - {"base"}
    assert kept(repo, KeepLast(50)) == ALL


def test_keep_last_without_steps_orders_by_creation_time(tmp_path):
    root = tmp_path / "r"
    for name in ("zz", "aa", "mm"):  # creation order differs from name order
        Snapshot.take(str(root / name), _state(1))
    repo = RepoStorage.open(str(root))
    plan = decide_retention(repo, RetentionPolicy(KeepLast(2)))
    assert set(plan.keep) == {"aa", "mm"} and plan.delete == ("zz",)


def test_keep_every_step(repo):
    assert kept(repo, KeepEveryStep(40)) == {"s040", "s080", "s120"}
    assert kept(repo, KeepEveryStep(50)) == {"s050", "s100"}
    assert kept(repo, KeepEveryStep(10)) == ALL - {"base"}


def test_keep_best_by_metric_min_and_max(repo):
    assert kept(repo, KeepBest(3, "loss")) == {"s090", "s110", "s060"}
    assert kept(repo, KeepBest(2, "loss", mode="max")) == {"s120", "s100"}
    # metadata[metric] at the top level counts; a bool does not
    assert kept(repo, KeepBest(2, "acc", mode="max")) == {"s060", "s100"}
    assert kept(repo, KeepBest(10, "acc", mode="max")) == {"s020", "s060", "s100"}
    # snapshots without the metric (base, s080) are never "best", however many are asked
    assert kept(repo, KeepBest(100, "loss")) == ALL - {"base", "s080"}


def test_keep_best_ties_favour_the_newer_snapshot(tmp_path):
    root = tmp_path / "r"
    for step in (1, 2, 3):
        Snapshot.take(
            str(root / f"t{step}"), _state(step), metadata={"step": step, "metrics": {"loss": 1.0}}
        )
    repo = RepoStorage.open(str(root))
    assert set(decide_retention(repo, RetentionPolicy(KeepBest(1, "loss"))).keep) == {"t3"}


def test_keep_tagged_repository_and_metadata_tags(repo):
    assert kept(repo, KeepTagged()) == {"s030", "s050", "s070"}
    assert kept(repo, KeepTagged("release")) == {"s050"}
    assert kept(repo, KeepTagged(["milestone"])) == {"s030", "s070"}
    assert kept(repo, KeepTagged(["eval", "release"])) == {"s050", "s070"}
    plan = decide_retention(repo, RetentionPolicy(KeepTagged()))
    assert plan.keep["s070"] == ("tagged eval,milestone",)
    assert plan.keep["s050"] == ("tagged release",)


def test_keep_within_uses_the_injected_now(repo):
    infos = {s.name: s for s in read_snapshots(repo)[0]}
    created: dict[str, datetime] = {}
    for name, info in infos.items():
        assert info.created is not None, name  # every snapshot records when it was taken
        created[name] = info.created
    now = created["s120"] + timedelta(hours=1)
    window = (now - created["s100"]).total_seconds()
    assert kept(repo, KeepWithin(window), now=now) == {"s100", "s110", "s120"}
    assert kept(repo, KeepWithin(timedelta(seconds=window)), now=now) == {"s100", "s110", "s120"}
    assert kept(repo, KeepWithin(3599), now=now, allow_delete_all=True) == set()
    # a naive now means UTC
    naive = now.astimezone(UTC).replace(tzinfo=None)
    assert kept(repo, KeepWithin(window), now=naive) == {"s100", "s110", "s120"}
    # everything was created within a day of the real now
    assert kept(repo, KeepWithin(86400)) == ALL
    # a snapshot "from the future" (clock skew) is within any window
    past = created["base"] - timedelta(days=1)
    assert kept(repo, KeepWithin(0), now=past) == ALL


# -- policies and plans ----------------------------------------------------------
def test_rules_combine_as_a_union_with_every_reason(repo):
    plan = decide_retention(
        repo, RetentionPolicy(KeepLast(2), KeepEveryStep(50), KeepBest(1, "loss"), KeepTagged())
    )
    assert set(plan.keep) == {"s110", "s120", "s050", "s100", "s090", "s030", "s070"}
    assert plan.keep["s100"] == ("every 50 steps",)
    assert plan.keep["s050"] == ("every 50 steps", "tagged release")
    assert plan.keep["s120"] == ("last 2",)
    assert plan.keep["s090"] == ("best 1 by loss (min)",)
    # delete lists the rest oldest first
    assert plan.delete == ("base", "s010", "s020", "s040", "s060", "s080")


def test_plan_is_a_dry_run_and_renders(repo):
    refs, manifests = files(repo.url, "refs"), files(repo.url, "manifests")
    plan = decide_retention(repo, RetentionPolicy(KeepLast(2)))
    assert len(plan.delete) == 11
    assert files(repo.url, "refs") == refs and files(repo.url, "manifests") == manifests
    doc = plan.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["delete"] == list(plan.delete) and doc["keep"] == {
        "s110": ["last 2"],
        "s120": ["last 2"],
    }
    rows = {r["name"]: r for r in doc["snapshots"]}
    assert rows["s050"]["action"] == "delete" and rows["s050"]["tags"] == ["release"]
    assert rows["s120"]["step"] == 120 and rows["base"]["step"] is None
    text = plan.render()
    lines = text.splitlines()
    assert lines[0].split() == ["ACTION", "SNAPSHOT", "STEP", "CREATED", "REASONS"]
    assert lines[1].split()[:3] == ["delete", "base", "-"]
    assert lines[-2].split()[:3] == ["keep", "s120", "120"] and "last 2" in lines[-2]
    assert lines[-1].startswith("2 kept, 11 to delete")


def test_execute_deletes_refs_only(repo):
    before = {f: files(repo.url, f) for f in ("manifests", "chunks", "packs", "tags")}
    plan = decide_retention(repo, RetentionPolicy(KeepLast(2), KeepTagged("release")))
    result = execute_retention(repo, plan)
    assert result.deleted == plan.delete and result.skipped == {}
    assert set(repo.list_snapshots()) == {"s050", "s110", "s120"}
    # manifests, chunks, packs and tags are all still there for gc to decide
    assert {f: files(repo.url, f) for f in before} == before
    survivors = read_snapshots(repo)[0]
    for info in survivors:
        step = info.step if info.step is not None else 0
        out = _state(-1)
        Snapshot(f"{repo.url}/{info.name}").restore(out)
        assert torch.equal(out["model"]["w"], torch.full((2000,), float(step)))


def test_execute_rechecks_refs_and_new_tags(repo):
    plan = decide_retention(repo, RetentionPolicy(KeepLast(1)))
    repo.delete_ref("s010")  # someone else deleted it
    add_tag(repo, "keepme", "s020")  # tagged after the plan: left alone
    repo.delete_ref("s030")  # ... and re-created with other content
    Snapshot.take(f"{repo.url}/s030", _state(333))
    result = execute_retention(repo, plan)
    assert result.skipped == {
        "s010": "already deleted",
        "s020": "tagged since the plan: keepme",
        "s030": "ref changed since the plan",
    }
    assert set(repo.list_snapshots()) == {"s020", "s030", "s120"}


def test_empty_policy_and_delete_everything_refuse(repo):
    with pytest.raises(RetentionError, match="empty retention policy"):
        decide_retention(repo, RetentionPolicy())
    with pytest.raises(ValueError, match="keeps none of the 13"):
        decide_retention(repo, RetentionPolicy(KeepTagged("nope")))
    assert len(repo.list_snapshots()) == 13
    plan = decide_retention(repo, RetentionPolicy(), allow_delete_all=True)
    assert plan.keep == {} and set(plan.delete) == ALL
    execute_retention(repo, plan)
    assert repo.list_snapshots() == []


def test_names_restrict_what_retention_considers(repo):
    scope = {"s010", "s020", "s030"}
    plan = decide_retention(repo, RetentionPolicy(KeepLast(1)), names=scope)
    assert set(plan.keep) == {"s030"} and set(plan.delete) == {"s010", "s020"}


def test_bad_rules_are_refused():
    bad = [
        lambda: KeepLast(-1),
        lambda: KeepEveryStep(0),
        lambda: KeepWithin(-1),
        lambda: KeepBest(1, "loss", mode="median"),  # type: ignore[arg-type]  # refused: the test
        lambda: RetentionPolicy("last 3"),  # type: ignore[arg-type]  # refused: the test
    ]
    for make in bad:
        with pytest.raises(RetentionError):
            make()


# -- tags ----------------------------------------------------------------------
def test_tags_are_create_only_json_pins(repo):
    info = list_tags(repo)["release"]
    assert isinstance(info, TagInfo)
    assert (info.tag, info.snapshot, info.manifest) == ("release", "s050", repo.resolve("s050"))
    raw = repo.store.get(tag_key("release"))
    assert json.loads(raw) == {
        "snapshot": "s050",
        "manifest": info.manifest,
        "created_at": info.created_at,
    }
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ObjectExistsError, match="already exists") as exc:
        add_tag(repo, "release", "s060")
    assert isinstance(exc.value, FileExistsError) and isinstance(exc.value, CasnapError)
    with pytest.raises(SnapshotNotFoundError):
        add_tag(repo, "v2", "no-such-snapshot")
    for bad in ("", "../x", "a//b", "a\nb"):  # ".hidden" and "a b" are names now
        with pytest.raises(InvalidNameError):
            add_tag(repo, bad, "s060")
    nested = add_tag(repo, "runs/best", "s090")
    assert set(list_tags(repo)) == {"release", "runs/best"}
    assert remove_tag(repo, "runs/best") == nested
    with pytest.raises(FileNotFoundError):
        remove_tag(repo, "runs/best")
    with pytest.raises(FileNotFoundError):
        read_tag(repo, "nope")
    assert set(list_tags(repo)) == {"release"}


def test_a_tag_pins_its_manifest_after_the_ref_is_deleted(repo):
    manifest = repo.resolve("s050")
    plan = decide_retention(repo, RetentionPolicy(KeepLast(1)))
    assert "s050" in plan.delete  # KeepLast does not look at tags
    execute_retention(repo, plan)
    assert not repo.has_ref("s050")
    info = list_tags(repo)["release"]
    assert info.manifest == manifest and info.snapshot == "s050"
    assert repo.read_manifest(manifest).metadata["step"] == 50  # still there for gc roots
    # a new snapshot under the old name is not the tagged one
    Snapshot.take(f"{repo.url}/s050", _state(5), metadata={"step": 50})
    plan = decide_retention(repo, RetentionPolicy(KeepTagged("release")), allow_delete_all=True)
    assert plan.keep == {} and set(plan.delete) == {"s050", "s120"}


def test_a_malformed_tag_is_an_error_not_a_lost_root(repo):
    repo.store.put(tag_key("broken"), b'{"snapshot": "s010"}')
    with pytest.raises(ManifestValidationError, match="tag 'broken'"):
        list_tags(repo)
