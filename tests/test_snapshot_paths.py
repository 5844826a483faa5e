"""Where a snapshot path puts its snapshot, as a user meets it (docs/repository.md).

Without an explicit repository, a snapshot path's parent is its repository;
a repository further up holds it only if it was created to be shared
(``casnap init``, ``Repository.init``). Paths nobody would predict are
refused, bad input creates nothing, and any name a file system accepts
round-trips.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import casnap
from casnap import (
    CasnapError,
    ConfigError,
    Repository,
    Snapshot,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StateDict,
)
from casnap.cli.app import main
from casnap.distributed.group import Group
from casnap.distributed.take import prepare_distributed_take
from casnap.errors import InvalidNameError, UnsupportedValueError
from casnap.repo.repository import RepoStorage
from casnap.take.target import TakeOptions

GOLDEN = Path(__file__).parent / "data" / "golden"


def state(value: float = 1.0) -> dict[str, StateDict]:
    return {"m": StateDict(w=torch.full((64,), float(value)), step=int(value))}


def repositories(root: Path) -> list[str]:
    """Every directory below ``root`` holding a repository, relative to it ("." for root)."""
    found = [os.path.relpath(p.parent.parent, root) for p in root.rglob(".casnap/config.json")]
    return sorted(found)


def restored(path: str, **kwargs) -> float:
    target = state(0.0)
    Snapshot(path, **kwargs).restore(target)
    return float(target["m"]["w"][0])


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- where a path goes ------------------------------------------------------------


def test_the_parent_is_the_repository_and_never_captures_deeper_paths(tmp_path):
    Snapshot.take(str(tmp_path / "x"), state(1))
    Snapshot.take(str(tmp_path / "y" / "z"), state(2))  # not captured by tmp_path's repository
    Snapshot.take(str(tmp_path / "y" / "w"), state(3))  # a sibling: same repository as z

    assert repositories(tmp_path) == [".", "y"]
    assert Repository(str(tmp_path)).snapshots() == ["x"]
    assert Repository(str(tmp_path / "y")).snapshots() == ["w", "z"]
    assert restored(str(tmp_path / "y" / "z")) == 2.0
    # Deleting the run's directory deletes its snapshots: nothing of them is left elsewhere.
    shutil.rmtree(tmp_path / "y")
    assert Repository(str(tmp_path)).snapshots() == ["x"]
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(tmp_path / "y" / "z")).restore(state(0))


def test_relative_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Snapshot.take("run1/step_1", state(1))
    Snapshot.take("step_0", state(0))  # the working directory becomes the repository
    assert repositories(tmp_path) == [".", "run1"]
    assert Repository("run1").snapshots() == ["step_1"]
    assert restored("run1/step_1") == 1.0


def test_an_initialized_repository_is_shared_by_the_runs_below_it(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    code, out, _ = cli(capsys, "init", str(ckpt), "--json")
    assert code == 0 and json.loads(out)["shared"] is True
    Snapshot.take(str(ckpt / "run1" / "step_1"), state(1))
    Snapshot.take(str(ckpt / "run2" / "step_1"), state(2))
    Snapshot.take(str(ckpt / "top"), state(3))

    assert repositories(tmp_path) == ["ckpt"]
    repo = Repository(str(ckpt))
    assert repo.snapshots() == ["run1/step_1", "run2/step_1", "top"]
    assert restored(str(ckpt / "run2" / "step_1")) == 2.0
    assert Repository.locate(str(ckpt / "run1" / "step_1"))[1] == "run1/step_1"
    config = json.loads((ckpt / ".casnap" / "config.json").read_text())
    assert config["shared"] is True


def test_init_marks_a_repository_a_take_created_as_shared(tmp_path):
    Snapshot.take(str(tmp_path / "ckpt" / "s0"), state(0))  # ckpt: implicit
    Snapshot.take(str(tmp_path / "ckpt" / "run1" / "s1"), state(1))  # not captured
    assert repositories(tmp_path) == ["ckpt", "ckpt/run1"]

    repo = Repository.init(str(tmp_path / "ckpt"))
    assert repo.storage.config.shared and repo.snapshots() == ["s0"]
    Snapshot.take(str(tmp_path / "ckpt" / "run2" / "s2"), state(2))  # now held by ckpt
    # The nearest repository decides: run1's own repository keeps run1's snapshots.
    Snapshot.take(str(tmp_path / "ckpt" / "run1" / "s3"), state(3))
    assert repositories(tmp_path) == ["ckpt", "ckpt/run1"]
    assert Repository(str(tmp_path / "ckpt")).snapshots() == ["run2/s2", "s0"]
    assert Repository(str(tmp_path / "ckpt" / "run1")).snapshots() == ["s1", "s3"]


def test_an_explicit_repository_wins(tmp_path):
    opts = {"repository": str(tmp_path / "repo")}
    Snapshot.take(str(tmp_path / "repo" / "a" / "b"), state(1), **opts)
    assert repositories(tmp_path) == ["repo"]
    assert Repository(str(tmp_path / "repo")).snapshots() == ["a/b"]
    assert restored(str(tmp_path / "repo" / "a" / "b"), **opts) == 1.0


def test_repositories_older_versions_wrote_keep_working(tmp_path):
    # The golden repository's config has no "shared": it is read as implicit.
    assert RepoStorage.open(str(GOLDEN)).config.shared is False
    # An implicit repository that an older casnap let capture a deeper path ...
    root = tmp_path / "old"
    Snapshot.take(str(root / "deep" / "s"), state(5), repository=str(root))
    assert "shared" not in json.loads((root / ".casnap" / "config.json").read_text())
    # ... still serves that snapshot by its path,
    assert restored(str(root / "deep" / "s")) == 5.0
    assert Repository.locate(str(root / "deep" / "s"))[1] == "deep/s"
    # but a new take below it gets its own repository.
    Snapshot.take(str(root / "deep" / "t"), state(6))
    assert repositories(tmp_path) == ["old", "old/deep"]
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(root / "other" / "u")).restore(state(0))


def test_an_ancestors_snapshot_stays_readable_after_a_take_makes_a_nearer_repository(
    tmp_path, capsys
):
    root = tmp_path / "old"
    # An older casnap put deep/s and a/b/c into `old` (ancestor capture) ...
    Snapshot.take(str(root / "deep" / "s"), state(5), repository=str(root))
    Snapshot.take(str(root / "a" / "b" / "c"), state(8), repository=str(root))
    # ... then takes made old/deep and old/a repositories of their own (the parent rule).
    Snapshot.take(str(root / "deep" / "t"), state(6))
    Snapshot.take(str(root / "a" / "x"), state(9))
    assert repositories(tmp_path) == ["old", "old/a", "old/deep"]

    # The old snapshots are still found by their paths: the nearest repository first, then up.
    assert restored(str(root / "deep" / "s")) == 5.0
    assert restored(str(root / "a" / "b" / "c")) == 8.0
    repo, name = Repository.locate(str(root / "deep" / "s"))
    assert (repo.url, name) == (Repository(str(root)).url, "deep/s")
    assert cli(capsys, "show", str(root / "deep" / "s"), "--json")[0] == 0
    assert restored(str(root / "deep" / "t")) == 6.0

    # A new take still goes to the parent; the two repositories share no chunks.
    Snapshot.take(str(root / "deep" / "t2"), state(7))
    assert Repository(str(root / "deep")).snapshots() == ["t", "t2"]
    assert Repository(str(root)).snapshots() == ["a/b/c", "deep/s"]

    # A name no repository holds: the error says every repository it looked in.
    with pytest.raises(SnapshotNotFoundError) as err:
        Snapshot(str(root / "deep" / "nope")).restore(state(0))
    assert "'nope'" in str(err.value)
    assert Repository(str(root / "deep")).url in str(err.value)
    assert f"{Repository(str(root)).url})" in str(err.value)
    assert cli(capsys, "rm", str(root / "deep" / "nope"))[0] == 3


# -- refused paths ----------------------------------------------------------------


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """A working directory and a home directory, both inside tmp_path."""
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


@pytest.mark.parametrize(
    "path, why",
    [
        ("", "names the working directory itself"),
        (".", "names the working directory itself"),
        ("./", "names the working directory itself"),
        ("/ckpt_x", "would make the file system root / a repository"),
        ("~", "is the home directory itself"),
        ("~/ckpt_x", "would make the home directory"),
    ],
)
def test_unpredictable_paths_are_refused_with_how_to_choose(sandbox, path, why):
    with pytest.raises(ConfigError) as err:
        Snapshot.take(path, state())
    message = str(err.value)
    assert why in message
    assert "repository='/ckpt/run1'" in message and "casnap init" in message
    assert "/ckpt/run1/step_100" in message
    assert repositories(sandbox) == []
    assert not os.path.exists("/ckpt_x") and not os.path.exists("/.casnap/config.json.tmp")


@pytest.fixture
def deep_cwd(tmp_path, monkeypatch) -> Path:
    """A working directory three levels below tmp_path, so that even a take that
    should have been refused could only write inside tmp_path."""
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    return tmp_path


@pytest.mark.parametrize(
    "path, why",
    [
        ("..", "a directory the working directory is in"),
        ("../..", "a directory the working directory is in"),
        ("../work", "the working directory itself"),
        ("../", "a directory the working directory is in"),
        ("ABS:a/b", "a directory the working directory is in"),
        ("ABS:a/b/work", "the working directory itself"),
        ("ABS:link", "a directory the working directory is in"),  # a link to tmp_path/a
        ("/", "the file system root /"),
    ],
)
def test_the_working_directory_and_its_ancestors_are_refused(deep_cwd, path, why):
    (deep_cwd / "link").symlink_to(deep_cwd / "a")
    if path.startswith("ABS:"):
        path = str(deep_cwd / path[4:])
    with pytest.raises(ConfigError) as err:
        Snapshot.take(path, state())
    message = str(err.value)
    assert why in message
    assert "repository='/ckpt/run1'" in message and "casnap init" in message
    assert repositories(deep_cwd) == []
    assert not os.path.exists("/.casnap")


def test_a_deeper_path_in_home_works_and_home_can_be_shared_on_purpose(sandbox):
    Snapshot.take("~/runs/step_1", state(1))
    assert repositories(sandbox) == ["home/runs"]
    Repository.init("~")  # on purpose: now ~/ckpt_x is allowed, and held by ~
    Snapshot.take("~/ckpt_x", state(2))
    assert Repository("~").snapshots() == ["ckpt_x"]


# -- nothing is created before the input is validated ------------------------------


class _NoStateDict:
    pass


BAD_INPUTS: dict[str, tuple[Any, dict[Any, Any], str, type[CasnapError], str]] = {
    "value without state_dict": ({"m": _NoStateDict()}, {}, "s", UnsupportedValueError, "without"),
    "plain int in app_state": ({"m": 3}, {}, "step_1", UnsupportedValueError, "state_dict"),
    "control character in name": (state(), {}, "step\n1", InvalidNameError, "control"),
    "metadata not JSON": (state(), {"obj": object()}, "step_1", UnsupportedValueError, "JSON"),
    "metadata int key": (state(), {1: "x"}, "step_1", UnsupportedValueError, "string keys"),
    "metadata NaN": (state(), {"loss": float("nan")}, "step_1", UnsupportedValueError, "JSON"),
    "metadata too big": (state(), {"x": "a" * (1 << 20)}, "step_1", UnsupportedValueError, "MiB"),
}


@pytest.mark.parametrize("how", ["take", "async_take"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_creates_no_repository(tmp_path, case, how):
    app_state, metadata, name, error, text = BAD_INPUTS[case]
    with pytest.raises(error) as err:
        pending = getattr(Snapshot, how)(str(tmp_path / "run" / name), app_state, metadata=metadata)
        pending.wait()  # only for async_take; never reached
    assert isinstance(err.value, CasnapError)
    assert text in str(err.value) or text == "MiB"
    assert repositories(tmp_path) == []
    assert not (tmp_path / "run").exists()


def test_a_value_without_state_dict_is_a_type_error_like_torchsnapshot(tmp_path):
    with pytest.raises(TypeError, match="state_dict"):
        Snapshot.take(str(tmp_path / "run" / "s"), {"m": torch.zeros(3)})
    assert repositories(tmp_path) == []


@pytest.mark.parametrize("case", ["value without state_dict", "metadata not JSON"])
def test_bad_input_to_a_distributed_take_creates_nothing(tmp_path, case):
    # rank 0's part of a distributed take, in a world of one (no collective needed)
    app_state, metadata, name, _error, _text = BAD_INPUTS[case]
    with pytest.raises(casnap.errors.DistributedTakeError):
        prepare_distributed_take(
            str(tmp_path / "run" / name),
            app_state,
            group=Group(object(), 0, 1),
            replicated=None,
            options=TakeOptions(),
            metadata=metadata,
            allow_pickle=False,
            parents=None,
            stage=False,
        )
    assert repositories(tmp_path) == []


# -- names ------------------------------------------------------------------------

NAMES = ["run 1", "schritt_ü", "実験", "a#b", "with%percent", ".hidden", "a", "a/b", "a/b/c"]


def test_any_name_a_file_system_accepts_round_trips(tmp_path, capsys):
    root = tmp_path / "repo"
    Repository.init(str(root))
    for i, name in enumerate(NAMES):
        Snapshot.take(f"{root}/{name}", state(float(i)), metadata={"step": i})

    repo = Repository(str(root))
    assert repo.snapshots() == sorted(NAMES)
    code, out, _ = cli(capsys, "ls", str(root), "--json")
    assert code == 0 and sorted(json.loads(out)) == sorted(NAMES)
    code, out, _ = cli(capsys, "log", str(root), "--json")
    assert code == 0 and sorted(line["name"] for line in json.loads(out)) == sorted(NAMES)
    for i, name in enumerate(NAMES):
        assert restored(f"{root}/{name}") == float(i), name
        code, out, _ = cli(capsys, "show", f"{root}/{name}", "--json")
        assert code == 0, name
    # `a` and `a/b` are sibling objects: every ref is one flat file, none leaves refs/.
    refs = root / ".casnap" / "refs"
    assert all(p.is_file() for p in refs.iterdir()) and len(list(refs.iterdir())) == len(NAMES)
    assert cli(capsys, "verify", str(root))[0] == 0


def test_tags_take_the_same_names(tmp_path):
    repo = Repository.init(str(tmp_path / "repo"))
    repo.take("a", state(1))
    for tag in ["beste Version", "a", "a/b", "ü#1"]:
        repo.tag(tag, "a")
    assert sorted(repo.tags()) == sorted(["beste Version", "a", "a/b", "ü#1"])
    repo.untag("a/b")
    assert sorted(repo.tags()) == sorted(["beste Version", "a", "ü#1"])
    assert repo.verify().ok


@pytest.mark.parametrize(
    "name, text",
    [
        ("..", "'..'"),
        (".", "'.'"),
        ("a/../b", "'..'"),
        ("a//b", "empty segment"),
        ("/a", "empty segment"),
        ("a\x00b", "control character"),
        ("a\tb", "control character"),
        ("a\x7fb", "control character"),
        ("a\x85b", "control character"),
        ("bad\ud800", "control character"),
        ("x" * 256, "longer than 255 bytes"),
        ("ü" * 128, "longer than 255 bytes"),
        ("/".join(["s"] * 17), "more than 16 deep"),
    ],
)
def test_hostile_names_are_refused(tmp_path, name, text):
    repo = Repository.init(str(tmp_path / "repo"))
    with pytest.raises(InvalidNameError, match=text.replace(".", r"\.")):
        repo.take(name, state())
    with pytest.raises(InvalidNameError):
        repo.storage.write_ref(name, "0" * 64)
    assert repo.snapshots() == []
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == [".casnap"]


def test_dot_dot_in_a_url_path_is_refused(tmp_path):
    with pytest.raises(InvalidNameError):
        Snapshot.take("memory://casnap-paths-test/repo/../x", state())


def test_refs_in_the_old_nested_layout_still_read(tmp_path):
    root = tmp_path / "repo"
    repo = Repository.init(str(root))
    repo.take("x/y", state(4))
    refs = root / ".casnap" / "refs"
    (refs / "x").mkdir()
    (refs / "x%2Fy").rename(refs / "x" / "y")  # where casnap put x/y before the flat layout

    assert repo.snapshots() == ["x/y"]
    assert restored(str(root / "x" / "y")) == 4.0
    with pytest.raises(SnapshotExistsError):
        repo.take("x/y", state(5))
    repo.delete("x/y")
    assert repo.snapshots() == []


# -- deleting one snapshot ----------------------------------------------------------


def test_delete_one_snapshot_then_gc_reclaims_its_space(tmp_path, capsys):
    run = tmp_path / "run1"
    Snapshot.take(str(run / "step_1"), {"m": StateDict(w=torch.randn(50_000))})
    Snapshot.take(str(run / "step_2"), {"m": StateDict(w=torch.randn(50_000))})
    exclusive = {u.name: u.exclusive_bytes for u in Repository(str(run)).du().per_snapshot}

    code, out, _ = cli(capsys, "rm", str(run / "step_1"))
    assert code == 0 and "casnap gc" in out and "--prune" in out
    code, out, _ = cli(capsys, "gc", str(run), "--grace", "0", "--json")
    assert code == 0 and json.loads(out)["bytes_freed"] >= exclusive["step_1"] > 0
    assert Repository(str(run)).snapshots() == ["step_2"]
    assert Snapshot(str(run / "step_2")).read_object("0/m/w").shape == (50_000,)
    assert cli(capsys, "rm", str(run / "step_1"))[0] == 3  # no such snapshot


def test_rm_prune_frees_the_space_only_that_snapshot_used_at_once(tmp_path, capsys):
    run = tmp_path / "run1"
    shared = torch.randn(300_000)  # over 1 MiB each: loose chunks, not packed together
    for step in (1, 2):
        state_ = StateDict(shared=shared, own=torch.randn(300_000))
        Snapshot.take(str(run / f"step_{step}"), {"m": state_})
    exclusive = {u.name: u.exclusive_bytes for u in Repository(str(run)).du().per_snapshot}

    code, out, _ = cli(capsys, "rm", str(run / "step_1"), "--prune", "--json")
    assert code == 0
    freed = json.loads(out)["reclaimed"]["bytes_freed"]
    assert freed >= exclusive["step_1"] > 0  # no grace period to wait out
    code, out, _ = cli(capsys, "du", str(run), "--json")
    assert code == 0 and json.loads(out)["unreferenced"]["bytes"] == 0
    kept = Snapshot(str(run / "step_2")).read_object("0/m/shared")
    assert torch.equal(kept, shared)  # the chunk step_2 shares stays


def _bad_state_on_rank_0(rank: int, world: int, root: str) -> str:
    from casnap import Snapshot
    from casnap.errors import DistributedTakeError

    app_state = {"m": _NoStateDict()} if rank == 0 else state(rank)
    try:
        Snapshot.take(f"{root}/run/step_1", app_state)
    except DistributedTakeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_bad_state_on_rank_0_of_a_gloo_take_creates_nothing(tmp_path):
    from dist_harness import run_ranks, values

    texts = values(run_ranks(2, _bad_state_on_rank_0, str(tmp_path)))
    assert all("rank(s) [0]" in t and "state_dict" in t for t in texts), texts
    assert repositories(tmp_path) == []


def test_names_round_trip_in_memory_too():
    import uuid

    url = f"memory://casnap-paths-{uuid.uuid4().hex}/repo"
    Repository.init(url)
    for i, name in enumerate(NAMES):
        Snapshot.take(f"{url}/{name}", state(float(i)))
    assert Repository(url).snapshots() == sorted(NAMES)
    assert [restored(f"{url}/{name}") for name in NAMES] == [float(i) for i in range(len(NAMES))]


# -- long names: any segment a file system accepts -----------------------------------

SIXTEEN = "/".join(f"{i:02d}" + "ü" * 99 for i in range(16))  # 16 segments of 200 bytes
LONG_NAMES = ["é" * 60, "実" * 85, "x" * 255 + "/" + "é" * 127, SIXTEEN]


def test_long_names_round_trip_take_list_restore_tag_delete(tmp_path, capsys):
    root = tmp_path / "repo"
    repo = Repository.init(str(root))
    names = ["short", *LONG_NAMES]
    for i, name in enumerate(names):
        Snapshot.take(f"{root}/{name}", state(float(i)), metadata={"step": i})

    assert repo.snapshots() == sorted(names)
    code, out, _ = cli(capsys, "ls", str(root), "--json")
    assert code == 0 and json.loads(out) == sorted(names)
    code, out, _ = cli(capsys, "log", str(root), "--json")
    assert code == 0 and sorted(line["name"] for line in json.loads(out)) == sorted(names)
    for i, name in enumerate(names):
        assert restored(f"{root}/{name}") == float(i)
        assert cli(capsys, "show", f"{root}/{name}", "--json")[0] == 0
    with pytest.raises(SnapshotExistsError):
        repo.take("実" * 85, state(9))

    tag = "ü" * 127  # 254 bytes: a tag name too long for a flat key, too
    info = repo.tag(tag, SIXTEEN)
    assert repo.tags()[tag] == info and info.snapshot == SIXTEEN
    assert cli(capsys, "verify", str(root))[0] == 0

    code, _, _ = cli(capsys, "rm", f"{root}/{'é' * 60}")
    assert code == 0
    repo.delete(SIXTEEN)  # the tag still pins its manifest
    assert repo.snapshots() == sorted(["short", "実" * 85, LONG_NAMES[2]])
    assert repo.untag(tag).manifest == info.manifest and repo.tags() == {}
    assert repo.verify().ok


def test_long_names_take_a_fixed_length_key_and_short_ones_keep_theirs(tmp_path):
    root = tmp_path / "repo"
    repo = Repository.init(str(root))
    fits = "ü" * 33  # 198 bytes once percent-encoded: still its flat key
    for name in ("a", fits, "é" * 60):
        repo.take(name, state())
    refs = root / ".casnap" / "refs"
    keys = sorted(p.name for p in refs.iterdir())
    (hashed,) = [k for k in keys if k.startswith("%%")]
    assert sorted(set(keys) - {hashed}) == ["%C3%BC" * 33, "a"] and len(hashed) == 66
    # A short name's ref is what it always was; a long one's also says its name.
    assert set(json.loads((refs / "a").read_bytes())) == {"created_at", "manifest"}
    assert json.loads((refs / hashed).read_bytes())["name"] == "é" * 60


def test_a_flat_key_of_up_to_255_bytes_an_older_version_wrote_still_reads(tmp_path):
    root = tmp_path / "repo"
    repo = Repository.init(str(root))
    repo.take("s", state(3))
    refs = root / ".casnap" / "refs"
    old = "ü" * 42  # 252 bytes percent-encoded: older versions stored it flat
    (refs / ("%C3%BC" * 42)).write_bytes((refs / "s").read_bytes())

    assert repo.snapshots() == ["s", old]
    assert restored(f"{root}/{old}") == 3.0
    with pytest.raises(SnapshotExistsError):
        repo.take(old, state(4))
    repo.delete(old)
    assert repo.snapshots() == ["s"] and repo.verify().ok


def _retarget(record: Path, field: str, value: str | None) -> None:
    doc = json.loads(record.read_bytes())
    if value is None:
        del doc[field]
    else:
        doc[field] = value
    record.write_text(json.dumps(doc))


@pytest.mark.parametrize("tampered", ["other name", "no name"])
def test_a_tampered_long_name_record_is_refused(tmp_path, capsys, tampered):
    root = tmp_path / "repo"
    repo = Repository.init(str(root))
    repo.take("é" * 60, state(1))
    repo.take("ok", state(2))
    repo.tag("ü" * 127, "ok")
    value = "ü" * 61 if tampered == "other name" else None
    (ref,) = (root / ".casnap" / "refs").glob("%%*")
    _retarget(ref, "name", value)
    (tag,) = (root / ".casnap" / "tags").glob("%%*")
    _retarget(tag, "tag", value)

    with pytest.raises(casnap.errors.ManifestValidationError, match=ref.name):
        repo.snapshots()
    with pytest.raises(casnap.errors.ManifestValidationError, match="damaged"):
        Snapshot(f"{root}/{'é' * 60}").restore(state(0))
    with pytest.raises(casnap.errors.ManifestValidationError, match=tag.name):
        repo.tags()
    code, _, err = cli(capsys, "ls", str(root))
    assert code == 4 and ref.name in err
    code, out, _ = cli(capsys, "verify", str(root), "--json")
    problems = {(p["kind"], p["subject"]) for p in json.loads(out)["problems"]}
    assert code == 1
    assert problems == {("ref", f".casnap/refs/{ref.name}"), ("tag", f".casnap/tags/{tag.name}")}
    assert cli(capsys, "gc", str(root), "--grace", "0")[0] != 0  # a root it cannot read
    assert restored(f"{root}/ok") == 2.0  # the rest of the repository still works
