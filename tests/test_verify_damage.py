"""verify against every kind of damage to every object of a repository (issue #10, point 3).

One repository holds loose chunks (a large tensor), packed frames (small
tensors, primitives, a pickled object), manifests shared by a ref, an alias ref
and a tag, a manifest only a tag still pins, and leftovers no root reaches.
Every object is damaged in every way a disk or a copy tool damages files (a
flipped bit at header and payload offsets, truncation, a zeroed block,
deletion, appended junk, an empty file), on a fresh copy each time, and the
real CLI must then:

- exit 1 exactly when the damage touches something a ref or a tag reaches,
  0 when it cannot matter (an unreferenced leftover, junk after a pack's last
  frame, a flipped digit of a timestamp, a deleted ref: docs/damage.md,
  "What verify can and cannot see");
- name the damaged object and list exactly the snapshots and tags it affects;
- never crash (no exit code outside 0/1, no traceback);
- and a plain ``verify`` afterwards reports the same damage from its records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from casnap import Repository, StateDict
from casnap.cli.app import main
from casnap.ops.verify import in_part
from casnap.repo.repository import RepoStorage

CHUNK = 16 * 1024
ROOT = Path(__file__).resolve().parents[1]
INF = 1 << 62


# -- the repository ---------------------------------------------------------


@dataclass
class Layout:
    """Who reaches each object: holders are ("snapshot", name) or ("tag", name)."""

    root: Path
    holders: dict[str, set[tuple[str, str]]]  # object key -> holders
    frames: dict[str, list[tuple[int, int, set[tuple[str, str]]]]]  # pack -> (start, end, who)
    roles: dict[str, str]  # role -> object key


def _state(i: int, big: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return {
        "m": StateDict(
            w=big,
            b=torch.randn(10, generator=g),
            c=torch.arange(20) * i,
            step=i,
            name=f"s{i}",
            obj={"lr": 0.1 * i, "s": {1, i}},
        )
    }


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Layout:
    base = tmp_path_factory.mktemp("verify-damage")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CASNAP_INDEX_DIR", str(base / "index"))
        # Whole chunks: the roles below need a loose chunk that only one snapshot
        # reaches (tests/test_delta.py covers damage to a delta's base).
        mp.setenv("CASNAP_DELTA", "0")
        root = base / "repo"
        repo = Repository.init(str(root), chunk_size=CHUNK)
        big = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
        for i in range(3):
            big = big.clone()
            big[i * 1000] += 1  # one chunk changes per snapshot, the rest is shared
            repo.take(f"s{i}", _state(i, big), allow_pickle=True)
        repo.storage.write_ref("alias", repo.resolve("s1"))  # two refs, one manifest
        repo.tag("best", "s1")
        repo.take("gone", {"x": StateDict(t=torch.randn(8192))})  # pinned by a tag only, below
        repo.tag("kept", "gone")
        repo.storage.delete_ref("gone")
        repo.take("garbage", {"y": StateDict(t=torch.randn(8192))})  # reached by nothing, below
        garbage = RepoStorage.open(str(root)).read_manifest(repo.resolve("garbage"))
        repo.storage.delete_ref("garbage")
    holders: dict[str, set[tuple[str, str]]] = {}
    frames: dict[str, list[tuple[int, int, set[tuple[str, str]]]]] = {}
    pinned: dict[str, set[tuple[str, str]]] = {}
    for name in repo.snapshots():
        pinned.setdefault(repo.resolve(name), set()).add(("snapshot", name))
    for tag, info in repo.tags().items():
        pinned.setdefault(info.manifest, set()).add(("tag", tag))
    for mhash, who in pinned.items():
        holders[f"manifests/{mhash[:2]}/{mhash}"] = who
        for ref in repo.storage.read_manifest(mhash).stored_refs():  # delta bases too
            if ref.pack:
                key = f"packs/{ref.pack[:2]}/{ref.pack}"
                frames.setdefault(key, []).append((ref.offset, ref.offset + ref.length, who))
            else:
                key = f"chunks/{ref.hash[:2]}/{ref.hash}"
            holders.setdefault(key, set()).update(who)
    loose = sorted(k for k in holders if k.startswith("chunks/"))
    snaps = {k: {n for kind, n in holders[k] if kind == "snapshot"} for k in loose}
    packs = sorted((k for k in frames), key=lambda k: -len(frames[k]))
    gm = repo.resolve("s1")
    km = next(info.manifest for t, info in repo.tags().items() if t == "kept")
    leftover = next(r for r in garbage.chunk_refs() if r.pack is None)
    roles = {
        "loose-shared": max(loose, key=lambda k: len(snaps[k])),
        "loose-one": next(k for k in loose if len(snaps[k]) == 1),
        "loose-tag-only": next(k for k in loose if not snaps[k]),
        "loose-unreferenced": f"chunks/{leftover.hash[:2]}/{leftover.hash}",
        "pack": packs[0],
        "manifest-shared": f"manifests/{gm[:2]}/{gm}",
        "manifest-tag-only": f"manifests/{km[:2]}/{km}",
        "ref": "refs/s2",
        "tag": "tags/best",
        "config": "config.json",
    }
    assert len(frames[packs[0]]) >= 3 and (root / ".casnap" / roles["loose-unreferenced"]).exists()
    return Layout(root, holders, frames, roles)


# -- damage -----------------------------------------------------------------

Damage = Callable[[bytes], bytes | None]  # None: delete the file


def _flip(offset: int | str) -> Damage:
    def apply(b: bytes) -> bytes:
        o = _at(b, offset)
        return b[:o] + bytes([b[o] ^ 0x01]) + b[o + 1 :]

    return apply


def _at(b: bytes, offset: int | str) -> int:
    if offset == "mid":
        return len(b) // 2
    if offset == "last":
        return len(b) - 1
    if isinstance(offset, str):  # the first byte of a JSON field's value
        return b.index(f'"{offset}":"'.encode()) + len(offset) + 4
    return offset


def _zero(b: bytes) -> bytes:
    start = len(b) // 3
    n = min(64, len(b) - start)
    return b[:start] + bytes(n) + b[start + n :]


def _byte(o: int) -> Callable[[int], tuple[int, int]]:
    return lambda n: (o, o + 1)


BINARY: dict[str, tuple[Damage, Callable[[int], tuple[int, int]]]] = {
    # name: (damage, the byte range of the original it touches, from its size)
    **{f"flip@{o}": (_flip(o), _byte(o)) for o in (0, 4, 5, 6, 8, 16, 24, 55, 56)},
    "flip@mid": (_flip("mid"), lambda n: (n // 2, n // 2 + 1)),
    "flip@last": (_flip("last"), lambda n: (n - 1, n)),
    "truncate-half": (lambda b: b[: len(b) // 2], lambda n: (n // 2, INF)),
    "truncate-1": (lambda b: b[:-1], lambda n: (n - 1, INF)),
    "zero-block": (_zero, lambda n: (n // 3, n // 3 + 64)),
    "delete": (lambda b: None, lambda n: (0, INF)),
    "empty": (lambda b: b"", lambda n: (0, INF)),
    "append-junk": (lambda b: b + b"junk", lambda n: (n, n + 4)),
}
JSON: dict[str, tuple[Damage, bool]] = {
    # name: (damage, whether it must be reported for a ref / tag)
    "flip-brace": (_flip(0), True),
    "flip-manifest": (_flip("manifest"), True),  # names a manifest that is not there
    "flip-created_at": (_flip("created_at"), False),  # a digit of a timestamp: harmless
    "truncate-half": (lambda b: b[: len(b) // 2], True),
    "zero-block": (_zero, True),
    "delete": (lambda b: None, False),  # indistinguishable from `retain` / `tag rm`
    "empty": (lambda b: b"", True),
    "append-junk": (lambda b: b + b"junk", True),
}
CONFIG: dict[str, Damage] = {
    "flip-brace": _flip(0),
    "flip-format": _flip("format_version"),
    "truncate-half": lambda b: b[: len(b) // 2],
    "zero-block": _zero,
    "delete": lambda b: None,
    "empty": lambda b: b"",
    "append-junk": lambda b: b + b"junk",
}

BINARY_ROLES = (
    "loose-shared",
    "loose-one",
    "loose-tag-only",
    "loose-unreferenced",
    "pack",
    "manifest-shared",
    "manifest-tag-only",
)
CASES = (
    [(role, d) for role in BINARY_ROLES for d in BINARY]
    + [(role, d) for role in ("ref", "tag") for d in JSON]
    + [("config", d) for d in CONFIG]
)


def damaged_copy(layout: Layout, tmp_path: Path, key: str, damage: Damage) -> Path:
    work = tmp_path / "repo"
    shutil.copytree(layout.root, work)
    path = work / ".casnap" / key
    new = damage(path.read_bytes())
    if new is None:
        path.unlink()
    else:
        path.write_bytes(new)
    return work


def expected(layout: Layout, role: str, key: str, damage: str) -> set[tuple[str, str]]:
    """Who the damage affects: the snapshots and tags that can no longer be restored whole."""
    if role == "loose-unreferenced":
        return set()
    if role in ("ref", "tag"):
        name = key.split("/", 1)[1]
        return {(role if role == "tag" else "snapshot", name)} if JSON[damage][1] else set()
    if role == "config":
        return {("snapshot", n) for n in ("alias", "s0", "s1", "s2")}
    size = (layout.root / ".casnap" / key).stat().st_size
    lo, hi = BINARY[damage][1](size)
    if role != "pack":
        return set(layout.holders[key]) if lo < size or damage == "append-junk" else set()
    who: set[tuple[str, str]] = set()
    for start, end, held in layout.frames[key]:
        if start < hi and lo < end:  # junk past the last frame touches no frame: harmless
            who |= held
    return who


def verify(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["verify", *argv, "--json"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert code in (0, 1), f"verify crashed with exit {code}: {out.err}"
    return code, json.loads(out.out)


def affected(report: dict) -> set[tuple[str, str]]:
    return {("snapshot", n) for p in report["problems"] for n in p["snapshots"]} | {
        ("tag", t) for p in report["problems"] for t in p.get("tags", [])
    }


@pytest.mark.parametrize(("role", "damage"), CASES, ids=[f"{r}-{d}" for r, d in CASES])
def test_verify_reports_exactly_the_damage_that_matters(layout, tmp_path, capsys, role, damage):
    key = layout.roles[role]
    kind = (
        BINARY[damage][0]
        if role in BINARY_ROLES
        else (JSON[damage][0] if role in ("ref", "tag") else CONFIG[damage])
    )
    work = damaged_copy(layout, tmp_path, key, kind)
    want = expected(layout, role, key, damage)

    code, report = verify(capsys, str(work), "--read-data")
    assert affected(report) == want, report["problems"]
    assert code == (1 if want else 0), report["problems"]
    if want:
        named = key.rsplit("/", 1)[-1]
        assert any(
            named in p["subject"]
            or named in p["detail"]
            or named in p["snapshots"]
            or named in p.get("tags", [])
            for p in report["problems"]
        ), report

    # Afterwards a plain verify sees it too: from the records the scrub wrote, or
    # (a deleted or unparsable object) from the listing and the parse alone.
    code, plain = verify(capsys, str(work))
    assert affected(plain) == want, plain["problems"]
    assert code == (1 if want else 0)


@pytest.mark.parametrize("role", ["loose-one", "pack", "loose-tag-only"])
def test_plain_verify_on_fresh_damage_sees_only_what_is_missing(layout, tmp_path, capsys, role):
    key = layout.roles[role]
    work = damaged_copy(layout, tmp_path, key, _flip("mid"))
    code, report = verify(capsys, str(work))  # reads no data: cannot see a flipped bit
    assert code == 0 and not report["problems"]
    (work / ".casnap" / key).unlink()
    code, report = verify(capsys, str(work))
    assert code == 1 and affected(report) == layout.holders[key]
    assert [p["kind"] for p in report["problems"]] == ["missing-object"]


def test_part_and_rotate_find_each_damaged_chunk_in_its_own_part(
    layout, tmp_path, capsys, monkeypatch
):
    keys = [layout.roles[r] for r in ("loose-shared", "loose-one", "loose-tag-only")]
    work = tmp_path / "repo"
    shutil.copytree(layout.root, work)
    for key in keys:
        path = work / ".casnap" / key
        path.write_bytes(_flip("mid")(path.read_bytes()))
    n = 3
    for k in range(n):  # a pristine copy per part: no records from an earlier part
        fresh = tmp_path / f"part{k}"
        shutil.copytree(work, fresh)
        code, report = verify(capsys, str(fresh), "--part", f"{k}/{n}")
        mine = {key for key in keys if in_part(key.rsplit("/", 1)[-1], (k, n))}
        found = {p["subject"].split(" ")[0] for p in report["problems"]}
        assert found == mine and code == (1 if mine else 0) and report["part"] == [k, n]
    monkeypatch.setenv("CASNAP_STATE_DIR", str(tmp_path / "state"))
    seen: set[str] = set()
    for k in range(n):
        code, report = verify(capsys, str(work), "--rotate", str(n))
        assert report["part"] == [k, n]
        seen |= {p["subject"].split(" ")[0] for p in report["problems"]}
    assert seen == set(keys)


def test_text_output_names_the_object_its_snapshots_and_its_tags(layout, tmp_path, capsys):
    key = layout.roles["manifest-shared"]
    work = damaged_copy(layout, tmp_path, key, _flip("mid"))
    assert main(["verify", str(work)]) == 1
    out = capsys.readouterr().out
    assert key.rsplit("/", 1)[-1] in out
    assert "(snapshots: alias, s1; tags: best)" in out


def test_the_installed_command_exits_1_on_a_damaged_config(layout, tmp_path):
    work = damaged_copy(layout, tmp_path, "config.json", lambda b: b[:10])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "casnap.cli.app", "verify", str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "config: .casnap/config.json" in done.stdout and "Traceback" not in done.stderr


def test_an_empty_directory_is_still_no_repository(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 3
