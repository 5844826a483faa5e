"""Manifest parts (docs/format.md, "Manifest parts"): stored once, shared, followed, refused.

A manifest whose entries' JSON is long is written as content-addressed parts
(loose objects in chunks/) that it lists by hash; a snapshot that changed
little shares its parent's parts, and gc, verify and copy follow them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from casnap import Repository, Session, Snapshot, StateDict
from casnap.errors import IntegrityError, ManifestValidationError
from casnap.format import codec
from casnap.format.json_text import canonical_json
from casnap.format.manifest_bytes import INLINE_MAX, PART_MIN
from casnap.format.names import digest_of, hash_bytes
from casnap.format.parse import MAX_MANIFEST_BYTES, parse_manifest
from casnap.repo.repository import manifest_key

CHUNK = 4096
OPTS = {"chunk_size": CHUNK}


def _state(n: int = 24, chunks: int = 160) -> dict[str, torch.Tensor]:
    """``n`` tensors of ``chunks`` chunks each: long entries, few stored chunks."""
    return {f"t{i:02d}": torch.full((chunks * CHUNK,), i, dtype=torch.uint8) for i in range(n)}


def _files(root: Path) -> dict[str, int]:
    meta = root / ".casnap"
    return {str(p.relative_to(meta)): p.stat().st_size for p in meta.rglob("*") if p.is_file()}


def _manifest_doc(root: Path, name: str) -> tuple[str, dict]:
    h = Repository(str(root)).resolve(name)
    return h, json.loads((root / ".casnap" / manifest_key(h)).read_bytes())


def test_a_long_manifest_is_written_in_parts_and_an_unchanged_re_take_shares_them(tmp_path):
    state, session = _state(), Session()
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(state)}, session=session, settings=OPTS)
    before = _files(tmp_path)
    Snapshot.take(str(tmp_path / "b"), {"m": StateDict(state)}, session=session, settings=OPTS)
    new = {k: n for k, n in _files(tmp_path).items() if k not in before}
    # an unchanged re-take writes its manifest and its ref, nothing else
    assert sorted(k.split("/")[0] for k in new) == ["manifests", "refs"], new
    ha, doc_a = _manifest_doc(tmp_path, "a")
    hb, doc_b = _manifest_doc(tmp_path, "b")
    assert doc_a["entries"] == doc_b["entries"] == {}
    assert len(doc_a["parts"]) >= 2 and doc_a["parts"] == doc_b["parts"]
    assert sum(new.values()) < 2 * 130 * len(doc_b["parts"]) + 1024
    # one tensor changed: only the part holding it is new
    state["t05"][7] += 1
    Snapshot.take(str(tmp_path / "c"), {"m": StateDict(state)}, session=session, settings=OPTS)
    _, doc_c = _manifest_doc(tmp_path, "c")
    old = {p["hash"] for p in doc_a["parts"]}
    assert len({p["hash"] for p in doc_c["parts"]} - old) == 1
    # every snapshot reads back whole, its entries from its parts
    for name in "abc":
        target = StateDict({k: torch.empty_like(v) for k, v in state.items()})
        Snapshot(str(tmp_path / name)).restore({"m": target})
        want = state["t05"].clone()
        if name != "c":
            want[7] -= 1
        assert torch.equal(target["t05"], want) and torch.equal(target["t11"], state["t11"])


def test_a_short_manifest_holds_its_entries_inline(tmp_path):
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(w=torch.ones(3))}, settings=OPTS)
    _, doc = _manifest_doc(tmp_path, "a")
    assert "parts" not in doc and doc["entries"]
    assert INLINE_MAX < PART_MIN


def test_history_operations_parse_each_part_once(tmp_path, monkeypatch):
    state, session = _state(), Session()
    for name in "abcd":
        Snapshot.take(str(tmp_path / name), {"m": StateDict(state)}, session=session, settings=OPTS)
    from casnap.repo import parts as parts_module

    parsed: list[str] = []
    real = parts_module.parse_part
    monkeypatch.setattr(
        parts_module, "parse_part", lambda d, r: parsed.append(r.hash) or real(d, r)
    )
    repo = Repository(str(tmp_path))
    assert repo.verify().ok
    _, doc = _manifest_doc(tmp_path, "a")
    assert sorted(parsed) == sorted(p["hash"] for p in doc["parts"])  # 4 manifests, parsed once


def test_gc_keeps_a_part_while_a_live_manifest_lists_it(tmp_path):
    state, session = _state(), Session()
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(state)}, session=session, settings=OPTS)
    state["t05"][7] += 1
    Snapshot.take(str(tmp_path / "b"), {"m": StateDict(state)}, session=session, settings=OPTS)
    repo = Repository(str(tmp_path))
    _, doc_a = _manifest_doc(tmp_path, "a")
    _, doc_b = _manifest_doc(tmp_path, "b")
    only_a = {p["hash"] for p in doc_a["parts"]} - {p["hash"] for p in doc_b["parts"]}
    shared = {p["hash"] for p in doc_a["parts"]} & {p["hash"] for p in doc_b["parts"]}
    assert only_a and shared
    repo.delete("a")
    result = repo.gc(grace_seconds=0)
    deleted = {g.key.rsplit("/", 1)[1] for g in result.plan.chunks}
    assert only_a <= deleted and not shared & deleted
    assert repo.verify(read_data=True).ok
    target = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    Snapshot(str(tmp_path / "b")).restore({"m": target})
    assert torch.equal(target["t05"], state["t05"])


def test_verify_reports_a_missing_or_damaged_part(tmp_path):
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(_state())}, settings=OPTS)
    _, doc = _manifest_doc(tmp_path, "a")
    h = doc["parts"][0]["hash"]
    path = tmp_path / ".casnap" / "chunks" / h[:2] / h
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    report = Repository(str(tmp_path)).verify()
    assert not report.ok and any(h in p.detail or p.kind == "manifest" for p in report.problems)
    path.unlink()
    report = Repository(str(tmp_path)).verify()
    assert not report.ok and any("missing" in p.detail for p in report.problems), report.problems


def test_copy_sends_the_parts(tmp_path):
    state = _state()
    Snapshot.take(str(tmp_path / "src" / "a"), {"m": StateDict(state)}, settings=OPTS)
    src = Repository(str(tmp_path / "src"))
    src.copy_to(str(tmp_path / "dst"))
    dst = Repository(str(tmp_path / "dst"))
    assert dst.verify(read_data=True).ok
    target = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    Snapshot(str(tmp_path / "dst" / "a")).restore({"m": target})
    assert torch.equal(target["t23"], state["t23"])


# -- hostile parts --------------------------------------------------------------


def _forged(root: Path, change) -> tuple[bytes, str]:
    """The manifest of "a" with ``change(doc)`` applied, and its new name."""
    _, doc = _manifest_doc(root, "a")
    change(doc)
    data = canonical_json(doc)
    return data, hash_bytes(data)


def _store_part(root: Path, raw: bytes) -> dict:
    digest = digest_of(raw)
    header, payload = codec.encode(raw, digest)
    frame = header + bytes(payload)
    path = root / ".casnap" / "chunks" / digest.hex()[:2] / digest.hex()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frame)
    return {"hash": digest.hex(), "size": len(raw), "pack": None, "offset": 0, "length": len(frame)}


@pytest.fixture
def parted(tmp_path) -> Path:
    Snapshot.take(str(tmp_path / "a"), {"m": StateDict(_state())}, settings=OPTS)
    return tmp_path


def test_a_part_declaring_too_much_is_refused_before_it_is_read(parted):
    repo = Repository(str(parted)).storage
    asked: list[str] = []

    def load(ref):
        asked.append(ref.hash)
        return repo.parts.load(ref)

    def grow(doc):
        doc["parts"][0]["size"] = MAX_MANIFEST_BYTES
        doc["parts"][0]["length"] = 56 + MAX_MANIFEST_BYTES

    data, name = _forged(parted, grow)
    with pytest.raises(ManifestValidationError, match="declare"):
        parse_manifest(data, name, load)
    assert asked == []  # refused from the sizes alone


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda doc, extra: doc["parts"].append(doc["parts"][0]), "repeats a key"),
        (lambda doc, extra: doc["parts"][0].update(pack="0" * 64), "loose whole"),
        (lambda doc, extra: doc["parts"][0].update(size=doc["parts"][0]["size"] - 1), "expects"),
        (lambda doc, extra: doc["parts"][0].update(hash="0" * 64), "missing"),
        (lambda doc, extra: doc["parts"].append(extra(b'{"entries":{},"evil":1}')), "evil"),
        (
            lambda doc, extra: doc["parts"].append(
                extra(b'{"entries":{"0/m/x":{"kind":"tensor"}}}')
            ),
            "malformed",
        ),
        (
            lambda doc, extra: doc["entries"].update(
                {"0/m/t03": {"kind": "container", "type": "list", "keys": []}}
            ),
            "repeats a key",
        ),
    ],
)
def test_a_hostile_part_is_refused(parted, change, match):
    repo = Repository(str(parted)).storage
    data, name = _forged(parted, lambda doc: change(doc, lambda raw: _store_part(parted, raw)))
    with pytest.raises(IntegrityError, match=match):
        parse_manifest(data, name, repo.parts.load)


def test_repair_restores_a_lost_part_from_another_repository(tmp_path):
    state = _state()
    Snapshot.take(str(tmp_path / "src" / "a"), {"m": StateDict(state)}, settings=OPTS)
    Repository(str(tmp_path / "src")).copy_to(str(tmp_path / "dst"))
    _, doc = _manifest_doc(tmp_path / "dst", "a")
    h = doc["parts"][-1]["hash"]
    (tmp_path / "dst" / ".casnap" / "chunks" / h[:2] / h).unlink()
    dst = Repository(str(tmp_path / "dst"))
    assert not dst.verify().ok
    result = dst.repair(from_snapshots=[str(tmp_path / "src" / "a")])
    assert result.ok and h in result.written, result.render()
    assert dst.verify(read_data=True).ok
    target = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    Snapshot(str(tmp_path / "dst" / "a")).restore({"m": target})
    assert torch.equal(target["t23"], state["t23"])
