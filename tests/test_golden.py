"""The committed golden repository (format v1) still reads bit-exact."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from casnap import Repository, Snapshot, StateDict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_golden import golden_state  # noqa: E402


@pytest.fixture
def golden(tmp_path) -> Path:
    # a copy, so that nothing a test does can touch the committed files
    dst = tmp_path / "golden-v1"
    shutil.copytree(ROOT / "tests" / "data" / "golden-v1", dst)
    return dst


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().reshape(-1).view(torch.uint8).tolist())
                == bytes(b.contiguous().reshape(-1).view(torch.uint8).tolist()))  # fmt: skip
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, float):
        return type(b) is float and a.hex() == b.hex()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_golden_snapshots_restore_bit_exact(golden):
    expected = golden_state()
    for name in ("first", "second"):
        target = StateDict()
        Snapshot(str(golden / name)).restore({"state": target})
        assert set(target) == set(expected)
        for key in expected:
            assert same(expected[key], target[key]), f"{name}: {key} differs"
        expected["weights"][3].add_(1.0)


def test_golden_repository_metadata_and_lineage(golden):
    repo = Repository.open(str(golden))
    assert repo.list_snapshots() == ["first", "second"]
    first = repo.read_manifest(repo.resolve("first"))
    second = repo.read_manifest(repo.resolve("second"))
    assert first.format_version == "1.0" and first.metadata == {"step": 1, "note": "golden v1"}
    assert second.parents == [repo.resolve("first")]
    w1, w2 = first.entries["0/state/weights"], second.entries["0/state/weights"]
    shared = sum(a.hash == b.hash for a, b in zip(w1.chunks, w2.chunks))
    assert shared == len(w1.chunks) - 1
