"""Reading deltas (#13, #39): one whole base and one delta per rebuilt chunk, one check.

The restore of the newest of a series rebuilds each chunk on its whole base,
every frame read once and the result checked once; a take decides per
tensor, cheaply, whether a delta can pay. Small tensors with 64 KiB chunks
keep every test fast.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import helpers
import torch
from helpers import take_stats

from casnap import Repository, Session, Snapshot, StateDict
from casnap.format import codec
from casnap.format.delta import DELTA_BLOCK
from casnap.format.entries import TensorEntry

CHUNK = 64 * 1024
ROWS, COLS = 512, 256  # fp32: 512 KiB, 8 chunks of 64 rows


def _sparse(t: torch.Tensor, seed: int, rows: int = 3) -> torch.Tensor:
    out = t.clone()
    idx = torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(seed))[:rows]
    out[idx] *= 1.001
    return out


def _series(root: Path, n: int, repo: Repository | None = None) -> list[torch.Tensor]:
    """``n`` snapshots ``s0..`` of a sparsely updated table (deltas against s0's chunks)."""
    session = Session()
    opts = {"chunk_size": CHUNK}
    t = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    states = []
    for i in range(n):
        if i:
            t = _sparse(t, i, rows=4)  # a few rows: chunks stay deltas against s0's
        states.append(t)
        app = {"m": StateDict(emb=t)}
        Snapshot.take(f"{root}/s{i}", app, session=session, settings=opts, repository=repo)
    return states


def _chunks(path: str, key: str = "0/m/emb") -> list:
    entry = Snapshot(path).get_manifest()[key]
    assert isinstance(entry, TensorEntry)
    return list(entry.chunks)


def test_the_newest_of_a_series_reads_one_base_and_one_delta_per_chunk(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    repo, store = helpers.counted_repo(str(root), CHUNK)
    states = _series(root, 5, repo)
    refs = _chunks(f"{root}/s4")
    deltas = [ref for ref in refs if ref.base is not None]
    assert len(deltas) >= 5  # most chunks changed since s0
    assert all(ref.base.base is None for ref in deltas)
    store.reset()
    out = StateDict(emb=torch.zeros(ROWS, COLS))
    Snapshot(f"{root}/s4", repository=repo).restore({"m": out})
    assert torch.equal(out["emb"], states[4])
    pack_reads = [k for k in store.read_keys if k.startswith(".casnap/packs/")]
    assert len(pack_reads) == len(deltas)  # each delta frame once, none again
    loose_reads = [k for k in store.read_keys if k.startswith(".casnap/chunks/")]
    wholes = {ref.whole.hash for ref in refs}  # s0's chunks: bases or unchanged
    assert sorted(k.rsplit("/", 1)[1] for k in loose_reads) == sorted(wholes)


def test_a_delta_restore_never_changes_the_stored_base(tmp_path: Path) -> None:
    states = _series(tmp_path, 5)
    objects = sorted((tmp_path / ".casnap" / "chunks").rglob("*"))
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects if p.is_file()}
    for _ in range(2):  # a second restore must find the same bases
        out = StateDict(emb=torch.zeros(ROWS, COLS))
        Snapshot(f"{tmp_path}/s4").restore({"m": out})
        assert torch.equal(out["emb"], states[4])
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in before}
    assert after == before
    assert Repository(str(tmp_path)).verify().ok


def test_a_delta_ending_in_a_ragged_block_restores_bit_exact(tmp_path: Path) -> None:
    # 8 chunks of 64 KiB, then one of 40012 bytes: not a multiple of the 256-byte block.
    n = 8 * CHUNK // 4 + 10003
    t = torch.randn(n, generator=torch.Generator().manual_seed(1))
    session, opts = Session(), {"chunk_size": CHUNK}
    Snapshot.take(f"{tmp_path}/a", {"m": StateDict(w=t)}, session=session, settings=opts)
    u = t.clone()
    u[-3:] += 1.0  # the last, ragged block
    u[5:9] += 1.0
    snap = Snapshot.take(f"{tmp_path}/b", {"m": StateDict(w=u)}, session=session, settings=opts)
    refs = _chunks(f"{tmp_path}/b", "0/m/w")
    assert refs[-1].size % DELTA_BLOCK and refs[-1].base is not None
    assert take_stats(snap).deltas_written == 2
    out = StateDict(w=torch.zeros(n))
    Snapshot(f"{tmp_path}/b").restore({"m": out})
    assert torch.equal(out["w"], u)
    assert Snapshot(f"{tmp_path}/b").read_object("0/m/w").equal(u)


def test_a_densely_changed_tensor_does_not_keep_a_sparse_one_from_deltas(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(4 * ROWS, COLS, generator=g)  # 32 chunks, all changed densely
    emb = torch.randn(ROWS, COLS, generator=g)
    session, opts = Session(), {"chunk_size": CHUNK}
    Snapshot.take(
        f"{tmp_path}/a",
        {"m": StateDict(dense=dense, emb=emb)},
        session=session,
        settings=opts,
    )
    new_emb = _sparse(emb, 7, rows=8)
    changed = sum(
        not torch.equal(a, b)
        for a, b in zip(emb.reshape(8, -1), new_emb.reshape(8, -1), strict=True)
    )
    snap = Snapshot.take(
        f"{tmp_path}/b",
        {"m": StateDict(dense=dense * 1.001, emb=new_emb)},
        session=session,
        settings=opts,
    )
    assert take_stats(snap).deltas_written == changed  # every changed emb chunk, no dense one
    assert all(r.base is None for r in _chunks(f"{tmp_path}/b", "0/m/dense"))


def test_a_codec_chosen_ahead_gives_the_same_frame() -> None:
    g = torch.Generator().manual_seed(3)
    bf16 = torch.randn(50_000, generator=g).to(torch.bfloat16).view(torch.int16)
    for data, elem in [
        (torch.randn(50_000, generator=g).numpy().tobytes(), 4),
        (bf16.numpy().tobytes(), 2),
        (bytes(200_000), 4),
        (b"casnap" * 30_000, 0),
    ]:
        digest = hashlib.sha256(data).digest()
        choice, _ = codec.choose_codec(data, 1, elem)
        assert codec.encode(data, digest, elem_size=elem, choice=choice) == codec.encode(
            data, digest, elem_size=elem
        )
