"""Delta chunks (#13): a changed chunk stored as a delta against its parent's chunk.

Small tensors with a 64 KiB chunk size keep every test under a second or two:
each tensor is 8 loose chunks, and a sparse update changes a few rows of each.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import chunk_path, take_stats
from safetensors.torch import load_file

from casnap import Repository, Session, Snapshot, StateDict
from casnap.errors import (
    DeltaBaseError,
    IntegrityError,
    ManifestValidationError,
)
from casnap.format import codec
from casnap.format.delta import encode_delta
from casnap.format.entries import TensorEntry
from casnap.format.names import digest_of, hash_bytes
from casnap.format.parse import parse_manifest

CHUNK = 64 * 1024
ROWS, COLS = 512, 256  # fp32: 512 KiB, 8 chunks of 64 rows
KEY = "0/m/emb"


def _opts(**kw: object) -> dict[str, object]:
    return {"chunk_size": CHUNK, **kw}


def _sparse(t: torch.Tensor, seed: int, rows: int = 3) -> torch.Tensor:
    """A copy of ``t`` with ``rows`` random rows scaled, as an embedding update does."""
    out = t.clone()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(t.shape[0], generator=g)[:rows]
    out[idx] *= 1.001
    return out


def _series(root: Path, n: int, **kw: object) -> tuple[list[torch.Tensor], list[Snapshot]]:
    """``n`` successive snapshots ``s0..s{n-1}`` of a sparsely updated table, one session."""
    session = Session()
    t = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    states, snaps = [], []
    for i in range(n):
        if i:
            t = _sparse(t, i)
        states.append(t)
        snaps.append(
            Snapshot.take(
                f"{root}/s{i}",
                {"m": StateDict(emb=t)},
                session=session,
                settings=_opts(**kw),
            )
        )
    return states, snaps


def _entry(snap: Snapshot) -> TensorEntry:
    entry = snap.get_manifest()[KEY]
    assert isinstance(entry, TensorEntry)
    return entry


def _restore(path: str) -> torch.Tensor:
    out = StateDict(emb=torch.zeros(ROWS, COLS))
    Snapshot(path).restore({"m": out})
    return out["emb"]


def _manifest_json(root: Path, snap: Snapshot) -> dict[str, object]:
    h = Repository(str(root)).resolve(Path(snap.path).name)
    data = (root / ".casnap" / "manifests" / h[:2] / h).read_bytes()
    return json.loads(data)


def test_a_sparse_update_is_written_as_small_deltas_and_restores_bit_exact(tmp_path: Path) -> None:
    states, snaps = _series(tmp_path, 2)
    stats = take_stats(snaps[1])
    changed = 3 * COLS * 4  # three rows
    assert stats.deltas_written >= 1
    assert stats.stored_bytes_written <= 3 * changed  # the target of #13, at this size
    assert torch.equal(_restore(f"{tmp_path}/s1"), states[1])
    assert torch.equal(_restore(f"{tmp_path}/s0"), states[0])
    # One format, with deltas or without.
    assert _manifest_json(tmp_path, snaps[0])["format_version"] == "1.0"
    assert _manifest_json(tmp_path, snaps[1])["format_version"] == "1.0"


def test_a_delta_keeps_the_chunk_identity_of_its_raw_bytes(tmp_path: Path) -> None:
    states, snaps = _series(tmp_path / "on", 2)
    _, plain = _series(tmp_path / "off", 2, delta=False)
    on, off = _entry(snaps[1]), _entry(plain[1])
    assert [c.hash for c in on.chunks] == [c.hash for c in off.chunks]
    raw = states[1].numpy().tobytes()
    assert [c.hash for c in on.chunks] == [
        digest_of(raw[i : i + CHUNK]).hex() for i in range(0, len(raw), CHUNK)
    ]
    assert any(c.base is not None for c in on.chunks)
    assert all(c.base is None for c in off.chunks)
    assert take_stats(plain[1]).deltas_written == 0


def test_every_delta_is_against_the_whole_chunk_its_parent_reads(tmp_path: Path) -> None:
    states, snaps = _series(tmp_path, 6)
    deltas = 0
    for before, after in zip(snaps, snaps[1:]):
        for old, new in zip(_entry(before).chunks, _entry(after).chunks):
            if new.base is not None:
                deltas += 1
                assert new.base.base is None  # a read decodes one whole frame and one delta
                assert new.base.hash == old.whole.hash  # not against the parent's delta
    assert deltas >= 8
    assert torch.equal(_restore(f"{tmp_path}/s5"), states[5])


def test_a_chunk_drifting_from_its_whole_is_written_whole_again(tmp_path: Path) -> None:
    # One chunk of 64 rows; each step scales a row not changed before, so the delta
    # against the whole grows by a row until its body passes a sixteenth of the chunk
    # (casnap.chunks.delta.LOCAL_MOST_BODY): then the chunk is written whole again.
    session = Session()
    t = torch.randn(64, COLS, generator=torch.Generator().manual_seed(4))
    refs, states = [], []
    for i in range(8):
        if i:
            t = t.clone()
            t[9 * i] *= 1.001
        states.append(t)
        snap = Snapshot.take(
            f"{tmp_path}/s{i}", {"m": StateDict(emb=t)}, session=session, settings=_opts()
        )
        (ref,) = _entry(snap).chunks
        refs.append(ref)
    kinds = ["delta" if r.base is not None else "whole" for r in refs]
    assert kinds[:2] == ["whole", "delta"] and "whole" in kinds[2:], kinds
    rewritten = kinds.index("whole", 2)
    assert all(r.base is not None and r.base.hash == refs[0].hash for r in refs[1:rewritten])
    assert refs[rewritten + 1].base is not None  # against the chunk written whole
    assert all(r.base is None or r.base.hash == refs[rewritten].hash for r in refs[rewritten:])
    for i in (rewritten - 1, rewritten, len(refs) - 1):
        out = StateDict(emb=torch.zeros(64, COLS))
        Snapshot(f"{tmp_path}/s{i}").restore({"m": out})
        assert torch.equal(out["emb"], states[i])


def test_a_manifest_naming_a_chain_of_deltas_is_refused(tmp_path: Path) -> None:
    _, snaps = _series(tmp_path, 3)
    doc = _manifest_json(tmp_path, snaps[2])
    chunks = doc["entries"][KEY]["chunks"]  # type: ignore[index]
    i = next(i for i, c in enumerate(chunks) if "base" in c)
    old = _entry(snaps[0]).chunks[(i + 1) % len(chunks)]  # another whole chunk of that size
    chunks[i]["base"]["base"] = old.model_dump(exclude_none=True)
    forged = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    name = hash_bytes(forged)
    with pytest.raises(ManifestValidationError, match="no chains"):
        parse_manifest(forged, name)
    # Written into the repository under its name and committed by a ref, as a hostile
    # writer would: restore and verify refuse it rather than follow the chain.
    folder = tmp_path / ".casnap" / "manifests" / name[:2]
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(forged)
    repo = Repository(str(tmp_path))
    repo.storage.write_ref("forged", name)
    with pytest.raises(ManifestValidationError, match="no chains"):
        _restore(f"{tmp_path}/forged")
    problems = [p for p in repo.verify().problems if p.kind == "manifest"]
    assert [(p.subject, p.snapshots) for p in problems] == [(name, ("forged",))]
    assert "no chains" in problems[0].detail


def test_a_dense_update_of_every_weight_is_written_whole(tmp_path: Path) -> None:
    session = Session()
    t = torch.randn(ROWS, COLS)
    Snapshot.take(f"{tmp_path}/a", {"m": StateDict(emb=t)}, session=session, settings=_opts())
    snap = Snapshot.take(
        f"{tmp_path}/b", {"m": StateDict(emb=t * 1.001)}, session=session, settings=_opts()
    )
    assert take_stats(snap).deltas_written == 0  # a 0.53 delta does not pay on a local disk
    assert _manifest_json(tmp_path, snap)["format_version"] == "1.0"


def test_gc_keeps_the_bases_a_live_delta_needs_then_frees_them(tmp_path: Path) -> None:
    states, snaps = _series(tmp_path, 2)
    repo = Repository(str(tmp_path))
    bases = {c.base.hash for c in _entry(snaps[1]).chunks if c.base is not None}
    assert bases
    repo.delete("s0")
    repo.gc(grace_seconds=0)
    for h in bases:  # s0's chunks, now only the bases of s1's deltas
        assert chunk_path(tmp_path, h).exists()
    assert torch.equal(_restore(f"{tmp_path}/s1"), states[1])
    assert repo.verify(read_data=True).ok
    repo.delete("s1")
    repo.gc(grace_seconds=0)
    for h in bases:
        assert not chunk_path(tmp_path, h).exists()


def _a_base(tmp_path: Path, snap: Snapshot) -> Path:
    base = next(c.base for c in _entry(snap).chunks if c.base is not None)
    assert base is not None and base.pack is None
    return chunk_path(tmp_path, base.hash)


def test_verify_and_restore_name_a_missing_base(tmp_path: Path) -> None:
    _, snaps = _series(tmp_path, 2)
    repo = Repository(str(tmp_path))
    repo.delete("s0")
    path = _a_base(tmp_path, snaps[1])
    path.unlink()
    report = repo.verify(read_data=True)
    missing = [p for p in report.problems if p.kind == "missing-object"]
    assert [p.subject for p in missing] == [f"chunks/{path.name[:2]}/{path.name}"]
    assert missing[0].snapshots == ("s1",)
    corrupt = [p for p in report.problems if p.kind == "corrupt-chunk"]
    assert corrupt and all(path.name[:12] in p.detail for p in corrupt)
    with pytest.raises(DeltaBaseError, match=path.name[:12]):
        _restore(f"{tmp_path}/s1")
    assert not list((tmp_path / ".casnap").glob("damaged/*/*"))  # the deltas are not damaged


def test_verify_names_a_damaged_base_and_records_only_the_base(tmp_path: Path) -> None:
    _, snaps = _series(tmp_path, 2)
    repo = Repository(str(tmp_path))
    path = _a_base(tmp_path, snaps[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    report = repo.verify(read_data=True)
    assert not report.ok
    assert any(path.name[:12] in p.subject for p in report.problems)
    assert {p.snapshots for p in report.problems} >= {("s0", "s1")}
    with pytest.raises(IntegrityError, match=path.name[:12]):
        _restore(f"{tmp_path}/s1")
    recorded = [p.parent.name for p in (tmp_path / ".casnap").glob("damaged/*/*")]
    assert recorded == [path.name]


def test_read_object_export_and_diff_stats_read_through_deltas(tmp_path: Path) -> None:
    states, _ = _series(tmp_path, 3)
    got = Snapshot(f"{tmp_path}/s2").read_object(KEY)
    assert torch.equal(got, states[2])
    repo = Repository(str(tmp_path))
    repo.export("s2", tmp_path / "out.safetensors")
    (exported,) = load_file(str(tmp_path / "out.safetensors")).values()
    assert torch.equal(exported, states[2])
    rows = {d.key: d for d in repo.diff("s1", "s2", stats=True)}
    want = (states[2] - states[1]).abs().max().item()
    assert rows[KEY].max_abs_diff == pytest.approx(want)


def test_a_delta_frame_checks_its_base() -> None:
    base = os.urandom(4096)
    data = bytearray(base)
    data[100] ^= 1
    digest, base_digest = digest_of(data), digest_of(base)
    head, payload = encode_delta(data, digest, base, base_digest, group=4)
    frame = head + payload
    assert len(frame) < 200
    assert bytes(codec.decode(frame, "f", digest, 4096, (base_digest, base))) == bytes(data)
    with pytest.raises(DeltaBaseError):
        codec.decode(frame, "f", digest, 4096)  # no base given
    other = os.urandom(4096)
    with pytest.raises(IntegrityError, match="against base"):
        codec.decode(frame, "f", digest, 4096, (digest_of(other), other))
    with pytest.raises(IntegrityError, match="digest mismatch"):
        codec.decode(frame, "f", digest, 4096, (base_digest, other))  # wrong bytes, right name


def test_the_settings_turn_deltas_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASNAP_DELTA", "0")
    _, snaps = _series(tmp_path, 2)
    assert take_stats(snaps[1]).deltas_written == 0


def test_a_copy_of_a_delta_snapshot_sends_its_bases(tmp_path: Path) -> None:
    # The bases belong to s0, which is neither copied nor kept at the source: copy
    # follows the manifest's base records (casnap/repo/reach.py), as gc does.
    states, snaps = _series(tmp_path / "src", 2)
    assert take_stats(snaps[1]).deltas_written >= 1
    src = Repository(str(tmp_path / "src"))
    src.delete("s0")
    src.gc(grace_seconds=0)
    src.copy_to(str(tmp_path / "dst"), ["s1"])
    assert Repository(str(tmp_path / "dst")).snapshots() == ["s1"]
    assert torch.equal(_restore(f"{tmp_path}/dst/s1"), states[1])
    assert Repository(str(tmp_path / "dst")).verify(read_data=True).ok
