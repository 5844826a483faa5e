"""Every read is verified; untrusted manifests are validated; failures lose nothing."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import chunk_path, flip_byte, pack_path, take_stats, tensor_entry

from casnap import IntegrityError, Repository, Snapshot, StateDict
from casnap.errors import ManifestValidationError, StoreError, UnsupportedFormatError
from casnap.format.json_text import canonical_json
from casnap.format.names import hash_bytes
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

CHUNK = 64 * 1024


def take(tmp_path, name: str, state: dict) -> Snapshot:
    return Snapshot.take(str(tmp_path / "repo" / name), state, settings={"chunk_size": CHUNK})


def test_flipped_byte_in_a_loose_chunk_raises_integrity_error_naming_it(tmp_path):
    state = StateDict(w=torch.randn(100_000))
    snap = take(tmp_path, "s1", {"s": state})
    ref = tensor_entry(snap.get_manifest(), "0/s/w").chunks[1]
    assert ref.pack is None
    path = str(chunk_path(tmp_path / "repo", ref.hash))
    flip_byte(path, os.path.getsize(path) - 10)
    target = StateDict(w=torch.zeros(100_000))
    with pytest.raises(IntegrityError) as info:
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": target})
    assert ref.hash in str(info.value)
    assert info.value.object_name == f"chunks/{ref.hash[:2]}/{ref.hash}"


def test_flipped_byte_in_a_pack_is_caught_on_read_object(tmp_path):
    state = StateDict(a=torch.randn(100), b=torch.randn(100))
    snap = take(tmp_path, "s1", {"s": state})
    ref = tensor_entry(snap.get_manifest(), "0/s/b").chunks[0]
    assert ref.pack is not None
    path = str(pack_path(tmp_path / "repo", ref.pack))
    flip_byte(path, ref.offset + ref.length - 3)
    with pytest.raises(IntegrityError, match=ref.pack):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/b")
    # the neighbour in the same pack is intact and still reads
    assert torch.equal(Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/a"), state["a"])


def test_flipped_header_byte_and_truncation_are_integrity_errors(tmp_path):
    state = StateDict(w=torch.randn(40_000))
    snap = take(tmp_path, "s1", {"s": state})
    ref = tensor_entry(snap.get_manifest(), "0/s/w").chunks[0]
    path = str(chunk_path(tmp_path / "repo", ref.hash))
    flip_byte(path, 9)  # raw length field
    with pytest.raises(IntegrityError):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/w")
    flip_byte(path, 9)
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(IntegrityError, match="bytes"):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/w")


def test_missing_chunk_is_an_integrity_error_naming_it(tmp_path):
    snap = take(tmp_path, "s1", {"s": StateDict(w=torch.randn(40_000))})
    ref = tensor_entry(snap.get_manifest(), "0/s/w").chunks[0]
    os.unlink(chunk_path(tmp_path / "repo", ref.hash))
    with pytest.raises(IntegrityError, match="missing"):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/w")


def _manifest_file(tmp_path) -> str:
    (path,) = glob.glob(str(tmp_path / "repo" / ".casnap" / "manifests" / "*" / "*"))
    return path


def test_corrupt_manifest_is_refused(tmp_path):
    take(tmp_path, "s1", {"s": StateDict(w=torch.randn(10))})
    path = _manifest_file(tmp_path)
    flip_byte(path, 20)
    with pytest.raises(ManifestValidationError, match="digest"):
        Snapshot(str(tmp_path / "repo" / "s1")).get_manifest()


def _rewrite_manifest(tmp_path, mutate) -> None:
    """Replace the snapshot's manifest with a mutated one that is correctly hashed."""
    repo = Repository(str(tmp_path / "repo"))
    ref_path = tmp_path / "repo" / ".casnap" / "refs" / "s1"
    old = json.loads(ref_path.read_text())
    doc = json.loads(Path(_manifest_file(tmp_path)).read_bytes())
    mutate(doc)
    data = canonical_json(doc)
    name = hash_bytes(data)
    repo.storage.store.put(f"manifests/{name[:2]}/{name}", data)
    old["manifest"] = name
    ref_path.write_text(json.dumps(old))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(format_version="3.0"), "format version 3.0"),  # 2.0 has deltas
        (lambda d: d["entries"]["0/s/w"].update(shape=[2**40, 2**40]), "overflow"),
        (lambda d: d["entries"]["0/s/w"].update(shape=[-1]), "shape"),
        (lambda d: d["entries"]["0/s/w"].update(dtype="float1024"), "dtype"),
        (lambda d: d["entries"]["0/s/w"].update(shape=[11]), "chunk"),
        (
            lambda d: d["entries"]["0/s/w"]["chunks"][0].update(hash="../../../../etc/passwd"),
            "hash",
        ),
        (lambda d: d["entries"]["0/s/w"]["chunks"][0].update(pack="x" * 64), "pack"),
        (lambda d: d["entries"]["0/s/w"]["chunks"][0].update(length=3), "length"),
        (lambda d: d["entries"]["0/s/w"].update(kind="lambda"), "kind"),
        (lambda d: d["entries"]["0/s/w"].update(evil=1), "evil"),
        (lambda d: d.pop("format_version"), "no format_version"),
    ],
)
def test_malicious_manifests_are_refused_before_anything_is_read(tmp_path, mutate, match):
    take(tmp_path, "s1", {"s": StateDict(w=torch.randn(10))})
    _rewrite_manifest(tmp_path, mutate)
    expected = UnsupportedFormatError if "format version" in match else ManifestValidationError
    with pytest.raises(expected, match=match):
        Snapshot(str(tmp_path / "repo" / "s1")).get_manifest()


def test_container_listing_a_missing_member_is_refused(tmp_path):
    take(tmp_path, "s1", {"s": StateDict(w=torch.randn(10))})

    def missing(d):
        d["entries"]["0/s"]["keys"] = ["w", "ghost"]

    _rewrite_manifest(tmp_path, missing)
    with pytest.raises(ManifestValidationError, match="ghost"):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s")


def test_absurdly_deep_nesting_is_refused_not_a_crash(tmp_path):
    take(tmp_path, "s1", {"s": StateDict(w=torch.randn(10))})

    def deep(d):
        key = "0/s"
        d["entries"][key]["keys"] = ["w", "d"]
        for _ in range(200):
            key = f"{key}/d"
            d["entries"][key] = {"kind": "container", "type": "dict", "keys": ["d"]}
        d["entries"][key]["keys"] = []

    _rewrite_manifest(tmp_path, deep)
    with pytest.raises(ManifestValidationError, match="deeper"):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s")


def disk_full(key: str) -> StoreError:
    return StoreError(f"no space left on device while writing {key!r}", key)


def test_a_failed_take_leaves_no_ref_and_earlier_snapshots_restorable(tmp_path):
    root = str(tmp_path / "repo")
    state = StateDict(w=torch.randn(300_000), b=torch.randn(10))
    take(tmp_path, "s1", {"s": state})
    before = {k: v.clone() for k, v in state.items()}
    state["w"].mul_(2)
    failing = Repository.on_store(FailingStore(LocalStore(root), 3, fail=disk_full))
    with pytest.raises(StoreError, match="no space"):
        Snapshot.take(
            f"{root}/s2", {"s": state}, settings={"chunk_size": CHUNK}, repository=failing
        )
    assert Repository(root).snapshots() == ["s1"]
    with pytest.raises(FileNotFoundError):
        Snapshot(f"{root}/s2").get_manifest()
    restored = StateDict(w=torch.empty(300_000), b=torch.empty(10))
    Snapshot(f"{root}/s1").restore({"s": restored})
    assert all(torch.equal(restored[k], before[k]) for k in before)
    # a retry succeeds and reuses the chunks the failed take already wrote
    snap = take(tmp_path, "s2", {"s": state})
    stats = take_stats(snap)
    assert stats.chunks_written < stats.chunks


def test_a_config_without_format_version_is_refused(tmp_path):
    take(tmp_path, "s1", {"s": StateDict(w=torch.randn(10))})
    config = tmp_path / "repo" / ".casnap" / "config.json"
    doc = json.loads(config.read_text())
    del doc["format_version"]
    config.write_bytes(canonical_json(doc))
    with pytest.raises(ManifestValidationError, match="no format_version"):
        Repository(str(tmp_path / "repo"))
