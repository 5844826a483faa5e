"""Where codecs meet damage, heal, repair and delta chains (issue #23, points 1-3).

A loose chunk is named by the hash of its raw bytes, so *any* valid frame of
those bytes is the chunk: a reference does not pin the codec or the encoded
length of a loose object (docs/format.md, "Loose objects"). Each test here is
what a user met on main: a repair, a heal by a take with other settings, or a
delta chain over a damaged base, after which a snapshot casnap reported as
taken (or repaired) no longer restored, or verify said ok where restore failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import chunk_path, flip_byte

from casnap import IntegrityError, Repository, Session, StateDict
from casnap.errors import CasnapError
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.repo.damage import list_damage
from casnap.settings import override

CHUNK = 1 << 20  # chunks of 1 MiB: loose objects (the pack limit is a quarter chunk)


def bf16_state(seed: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"m": StateDict(w=torch.randn(1 << 20, generator=g).to(torch.bfloat16))}


def table_state(seed: int = 3, rows: int = 2048) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"m": StateDict(emb=torch.randn(rows, 256, generator=g))}  # 1 MiB per 1024 rows


def like(state: dict) -> dict:
    return {"m": StateDict(**{k: torch.zeros_like(v) for k, v in state["m"].items()})}


def restores(repo: Repository, name: str, want: dict) -> bool:
    """Whether snapshot ``name`` restores bit-exact to ``want`` (False on a casnap error)."""
    target = like(want)
    try:
        Repository(repo.url).snapshot(name).restore(target)
    except CasnapError:
        return False
    return all(torch.equal(target["m"][k], v) for k, v in want["m"].items())


def verified(repo: Repository, name: str) -> bool:
    """verify --read-data's verdict on snapshot ``name``: True when it names no problem."""
    report = Repository(repo.url).verify(read_data=True)
    return not any(name in p.snapshots for p in report.problems)


def loose_refs(repo: Repository, name: str) -> list[ChunkRef]:
    return [
        r for r in repo.storage.read_manifest(repo.resolve(name)).chunk_refs() if r.pack is None
    ]


def stored_codec(repo: Repository, h: str) -> int:
    head = chunk_path(repo.url, h).read_bytes()[: codec.HEADER_SIZE]
    return codec.parse_header(head, h).codec


def reencode(repo: Repository, h: str, compress: bool) -> None:
    """Replace loose chunk ``h`` by another valid frame of the same bytes."""
    path = chunk_path(repo.url, h)
    blob = path.read_bytes()
    hdr = codec.parse_header(blob, h)
    data = codec.decode(blob, h, hdr.digest, hdr.raw_length)
    elem = 2 if compress else 0
    head, payload = codec.encode(data, hdr.digest, compress=compress, elem_size=elem)
    path.write_bytes(head + bytes(payload))


def test_repair_of_a_damaged_compressed_loose_chunk_writes_what_a_take_would(tmp_path: Path):
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = bf16_state()
    repo.take("s1", state)
    ref = loose_refs(repo, "s1")[0]
    assert stored_codec(repo, ref.hash) == codec.CODEC_ZSTD_GROUPED
    flip_byte(chunk_path(repo.url, ref.hash), codec.HEADER_SIZE + 40)
    assert not restores(repo, "s1", state)  # records the damage

    result = Repository(repo.url).repair(from_states=[state])
    assert [r.status for r in result.roots] == ["repaired"]
    assert restores(repo, "s1", state)
    assert verified(repo, "s1")
    assert stored_codec(repo, ref.hash) == codec.CODEC_ZSTD_GROUPED  # as a take writes it
    assert list_damage(repo.storage) == []


def test_a_heal_with_other_codec_settings_keeps_every_snapshot_restorable(tmp_path: Path):
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = bf16_state()
    repo.take("s1", state)
    h = loose_refs(repo, "s1")[0].hash
    flip_byte(chunk_path(repo.url, h), codec.HEADER_SIZE + 40)
    assert not restores(repo, "s1", state)  # recorded

    with override(compression="none"):
        repo.take("s2", state)  # heals chunks/<h> with a raw frame
    assert stored_codec(repo, h) == codec.CODEC_RAW
    for name in ("s1", "s2"):
        assert restores(repo, name, state), name
        assert verified(repo, name), name

    flip_byte(chunk_path(repo.url, h), codec.HEADER_SIZE + 40)
    assert not restores(repo, "s2", state)  # recorded again
    repo.take("s3", state)  # default settings: heals it back to a compressed frame
    assert stored_codec(repo, h) == codec.CODEC_ZSTD_GROUPED
    for name in ("s1", "s2", "s3"):
        assert restores(repo, name, state), name
        assert verified(repo, name), name


@pytest.mark.parametrize("compression", ["auto", "none"])
def test_any_valid_encoding_of_a_loose_chunk_serves_every_reader(tmp_path: Path, compression):
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = bf16_state()
    with override(compression=compression):
        repo.take("s1", state)
    for ref in loose_refs(repo, "s1"):
        reencode(repo, ref.hash, compress=compression == "none")  # the other encoding
    assert restores(repo, "s1", state)
    assert verified(repo, "s1")
    got = Repository(repo.url).snapshot("s1").read_object("0/m/w")
    assert torch.equal(got, state["m"]["w"])
    assert list_damage(repo.storage) == []


def test_a_loose_object_larger_than_any_frame_of_its_chunk_is_refused_unread(tmp_path: Path):
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = bf16_state()
    repo.take("s1", state)
    ref = loose_refs(repo, "s1")[0]
    path = chunk_path(repo.url, ref.hash)
    path.write_bytes(path.read_bytes() + b"\0" * (codec.HEADER_SIZE + ref.size))
    with pytest.raises(IntegrityError):
        Repository(repo.url).snapshot("s1").restore(like(state))
    assert not verified(repo, "s1")
    assert [d.chunk for d in list_damage(repo.storage)] == [ref.hash]


def test_a_take_does_not_reuse_a_delta_whose_base_is_recorded_damaged(tmp_path: Path):
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    session = Session()
    state = table_state()
    repo.take("s0", state, session=session)
    base = {r.hash for r in loose_refs(repo, "s0")}
    state["m"]["emb"][::100] += 1.0  # 1% of the rows: stored as deltas on s0's chunks
    repo.take("s1", state, session=session)
    deltas = [r for r in repo.storage.read_manifest(repo.resolve("s1")).chunk_refs() if r.base]
    assert deltas and all(r.base is not None and r.base.hash in base for r in deltas)
    s0_state = table_state()
    damaged = deltas[0].base
    assert damaged is not None
    flip_byte(chunk_path(repo.url, damaged.hash), codec.HEADER_SIZE + 40)
    assert not restores(repo, "s0", s0_state)  # records the base's damage

    repo.take("s2", state, session=session)  # unchanged since s1
    assert restores(repo, "s2", state)
    assert verified(repo, "s2")


def test_a_checkpointer_resumes_after_a_scrub_recorded_a_delta_base_damaged(tmp_path: Path):
    from casnap import Checkpointer, KeepLast

    url = str(tmp_path / "run")
    Repository.init(url, chunk_size=CHUNK)
    state = table_state(rows=4096)  # four chunks
    ckpt = Checkpointer(url, every_n_steps=1, retention=KeepLast(2))
    ckpt.maybe_take(0, state)
    state["m"]["emb"][:1024:100] += 1.0  # the first chunk: a delta on step 0's
    ckpt.maybe_take(1, state)
    ckpt.wait()
    repo = Repository(url)
    refs = [
        r
        for n in repo.snapshots()
        for r in repo.storage.read_manifest(repo.resolve(n)).chunk_refs()
    ]
    base = next(r.base for r in refs if r.base is not None)
    flip_byte(chunk_path(url, base.hash), codec.HEADER_SIZE + 40)
    assert not repo.verify(read_data=True).ok  # the scrub records it
    for step in range(2, 7):
        state["m"]["emb"][1024 + step :: 100] += 1.0  # the first chunk stays unchanged
        ckpt.maybe_take(step, state)
    ckpt.close()
    target = like(state)
    resumed = Checkpointer(url, every_n_steps=1, retention=KeepLast(2))
    assert resumed.restore_latest(target) == 6
    assert torch.equal(target["m"]["emb"], state["m"]["emb"])


def delta_on_a_damaged_base(tmp_path: Path) -> tuple[Repository, Session, dict, dict, ChunkRef]:
    """s0, then s1 (1% of the rows changed: deltas on s0's chunks) through one Session;
    the base of one delta damaged and recorded by a restore of s1."""
    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    session = Session()
    s0 = table_state()
    repo.take("s0", s0, session=session)
    live = table_state()
    live["m"]["emb"][::100] += 1.0
    repo.take("s1", live, session=session)
    delta = next(r for r in repo.storage.read_manifest(repo.resolve("s1")).chunk_refs() if r.base)
    assert delta.base is not None
    flip_byte(chunk_path(repo.url, delta.base.hash), codec.HEADER_SIZE + 40)
    assert not restores(repo, "s1", live)  # records the base's damage
    return repo, session, s0, live, delta


def test_repair_rebuilds_a_damaged_delta_base_from_live_state_of_the_delta(tmp_path: Path):
    """The live state holds s1's values, not s0's; s1's delta on s0's damaged chunk,
    applied to them, gives that chunk back (a delta is an XOR): both restore again."""
    repo, session, s0, live, delta = delta_on_a_damaged_base(tmp_path)

    result = Repository(repo.url).repair(from_states=[live])
    assert {r.name: r.status for r in result.roots} == {"s0": "repaired", "s1": "repaired"}
    assert restores(repo, "s0", s0) and restores(repo, "s1", live)
    assert verified(repo, "s0") and verified(repo, "s1")
    assert list_damage(repo.storage) == []


def test_a_chunk_recorded_damaged_in_a_pack_and_loose_is_listed_and_retaken(tmp_path: Path):
    """A damaged pack frame's replacement chunks/<h> damaged too: two records of one
    chunk. Listing them compared None with a pack id (TypeError in every take,
    verify, gc and repair); now both are listed and the next take writes the chunk."""
    from casnap.repo.damage import record_damage

    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = {"m": StateDict(b=torch.arange(1000, dtype=torch.float32))}  # a packed chunk
    repo.take("s1", state)
    packed = next(r for r in repo.storage.read_manifest(repo.resolve("s1")).chunk_refs() if r.pack)
    record_damage(repo.storage, packed, "a flipped bit")
    record_damage(
        repo.storage, ChunkRef(hash=packed.hash, size=packed.size, length=packed.length), "too"
    )
    assert sorted((d.pack is None) for d in list_damage(repo.storage)) == [False, True]
    assert not Repository(repo.url).verify().ok
    repo.take("s2", state)
    assert restores(repo, "s2", state)
    assert verified(repo, "s2")


def test_a_delta_whose_base_is_lost_reads_the_chunk_a_later_take_wrote_whole(tmp_path: Path):
    """Any good frame of a chunk is the chunk: once a take wrote s1's delta chunk whole
    (its base was recorded damaged), s1 reads it from there; verify agrees with
    restore for s1 (restorable) and for s0 (its own chunk is gone)."""
    repo, session, s0, live, delta = delta_on_a_damaged_base(tmp_path)
    repo.take("s2", live, session=session)  # writes the delta's chunk whole: chunks/<h>
    assert chunk_path(repo.url, delta.hash).exists() and delta.base is not None
    chunk_path(repo.url, delta.base.hash).unlink()  # the base is gone for good

    for name, state, ok in (("s0", s0, False), ("s1", live, True), ("s2", live, True)):
        assert restores(repo, name, state) is ok, name
        assert verified(repo, name) is ok, name
    result = Repository(repo.url).repair()
    assert {r.name: r.status for r in result.roots}["s1"] != "unrecoverable"


def test_repair_does_not_call_a_snapshot_whose_pack_is_gone_repaired(tmp_path: Path):
    """A good loose chunks/<h> stands in for a damaged pack frame, not for a frame of a
    pack that is gone (the read fails before it could fall back): unrecoverable."""
    from helpers import pack_path

    from casnap.format.names import digest_of

    repo = Repository.init(str(tmp_path / "r"), chunk_size=CHUNK)
    state = {"m": StateDict(b=torch.arange(1000, dtype=torch.float32))}
    repo.take("s1", state)
    packed = next(r for r in repo.storage.read_manifest(repo.resolve("s1")).chunk_refs() if r.pack)
    data = state["m"]["b"].numpy().tobytes()
    head, payload = codec.encode(data, digest_of(data), compress=False)
    chunk_path(repo.url, packed.hash).parent.mkdir(parents=True, exist_ok=True)
    chunk_path(repo.url, packed.hash).write_bytes(head + bytes(payload))  # a stand-in
    assert packed.pack is not None
    pack_path(repo.url, packed.pack).unlink()

    result = Repository(repo.url).repair()
    assert [(r.name, r.status) for r in result.roots] == [("s1", "unrecoverable")]
    assert not restores(repo, "s1", state)
    assert not verified(repo, "s1")
