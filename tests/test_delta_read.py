"""Reading delta chains fast (#13): shared pack reads, copy-on-write rebuilds, the cheap test.

The restore of the newest of a series rebuilds each chunk on a private
mapping of the whole chunk at its chain's end, with every delta of the chain
fetched by one read per pack; a take decides per tensor, cheaply, whether a
delta can pay. Small tensors with 64 KiB chunks keep every test fast.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import repo_helpers
import torch
from helpers import smaps_kib, take_stats

from casnap import Repository, Session, Snapshot, StateDict
from casnap.chunks.rebuild import _POPULATE_WRITE, fault_for_writing
from casnap.format import codec
from casnap.format.delta import DELTA_BLOCK, DeltaRuns
from casnap.format.entries import TensorEntry

CHUNK = 64 * 1024
ROWS, COLS = 512, 256  # fp32: 512 KiB, 8 chunks of 64 rows


def _sparse(t: torch.Tensor, seed: int, rows: int = 3) -> torch.Tensor:
    out = t.clone()
    idx = torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(seed))[:rows]
    out[idx] *= 1.001
    return out


def _series(root: Path, n: int, repo: Repository | None = None) -> list[torch.Tensor]:
    """``n`` snapshots ``s0..`` of a sparsely updated table (chains of up to 4 deltas)."""
    session = Session()
    opts: dict[str, object] = {"chunk_size": CHUNK}
    if repo is not None:
        opts["repository"] = repo
    t = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    states = []
    for i in range(n):
        if i:
            t = _sparse(t, i, rows=24)  # most chunks change at every step
        states.append(t)
        Snapshot.take(
            f"{root}/s{i}", {"m": StateDict(emb=t)}, session=session, storage_options=opts
        )
    return states


def _chunks(path: str, key: str = "0/m/emb") -> list:
    entry = Snapshot(path).get_manifest()[key]
    assert isinstance(entry, TensorEntry)
    return list(entry.chunks)


def test_the_newest_of_a_chain_reads_each_pack_of_deltas_once(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    repo, store = repo_helpers.counted_repo(str(root), CHUNK)
    states = _series(root, 5, repo)
    refs = _chunks(f"{root}/s4")
    links = [link for ref in refs for link in ref.chain()[:-1]]
    assert len(links) >= 16  # most chunks are 4 deltas deep
    packs = {link.pack for link in links}
    store.reset()
    out = StateDict(emb=torch.zeros(ROWS, COLS))
    Snapshot(f"{root}/s4", storage_options={"repository": repo}).restore({"m": out})
    assert torch.equal(out["emb"], states[4])
    pack_reads = [k for k in store.read_keys if k.startswith(".casnap/packs/")]
    assert len(pack_reads) <= len(packs)  # not one request per delta frame
    # Each chunk was rebuilt over a mapping of the whole chunk its chain ends in.
    wholes = {f".casnap/chunks/{r.chain()[-1].hash[:2]}/{r.chain()[-1].hash}" for r in refs}
    assert wholes <= set(store.mapped_keys)


def test_a_rebuild_over_a_mapping_never_changes_the_stored_base(tmp_path: Path) -> None:
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
    Snapshot.take(f"{tmp_path}/a", {"m": StateDict(w=t)}, session=session, storage_options=opts)
    u = t.clone()
    u[-3:] += 1.0  # the last, ragged block
    u[5:9] += 1.0
    snap = Snapshot.take(
        f"{tmp_path}/b", {"m": StateDict(w=u)}, session=session, storage_options=opts
    )
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
        storage_options=opts,
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
        storage_options=opts,
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


def _can_populate_write(tmp_path: Path) -> bool:
    """Whether this kernel copies a private mapping's pages on MADV_POPULATE_WRITE (5.14 on)."""
    if _POPULATE_WRITE is None:
        return False
    (tmp_path / "probe").write_bytes(bytes(mmap.PAGESIZE))
    with (tmp_path / "probe").open("r+b") as f:
        probe = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    try:
        probe.madvise(_POPULATE_WRITE, 0, mmap.PAGESIZE)
    except OSError:
        return False
    finally:
        probe.close()
    return "Anonymous:" in Path("/proc/self/smaps").read_text()


def test_the_runs_spans_are_whole_pages_merged_where_they_touch() -> None:
    page = mmap.PAGESIZE
    runs = DeltaRuns(
        10 * page,
        np.array([0, page - 64, 2 * page + 10, 5 * page, 10 * page - 8]),
        np.array([8, 128, 8, 8, 8]),
        np.zeros(160, np.uint8),
    )
    # Moved 64 bytes on, the first three runs lie in pages 0, 1 and 2: one span; the run
    # in page 5 is alone; the last is cut where the mapping ends.
    assert runs.spans(64, page, 10 * page + 64) == [
        (0, 3 * page),
        (5 * page, 6 * page),
        (10 * page, 10 * page + 64),
    ]
    none = DeltaRuns(0, np.zeros(0, int), np.zeros(0, int), np.zeros(0, "u1"))
    assert none.spans(0, page, 0) == []


def test_many_runs_spans_cover_the_same_pages_as_a_few() -> None:
    page, shift = 4096, 64
    g = torch.Generator().manual_seed(5)
    blocks = torch.randperm(4096, generator=g)[:300].sort().values * DELTA_BLOCK
    runs = DeltaRuns(
        4096 * DELTA_BLOCK,
        blocks.numpy().astype(np.int64),
        np.full(300, 100),
        np.zeros(30_000, "u1"),
    )
    limit = shift + 4096 * DELTA_BLOCK
    pages = sorted(
        {
            p
            for a in blocks.tolist()
            for p in range((shift + a) // page, (shift + a + 99) // page + 1)
        }
    )
    want: list[tuple[int, int]] = []
    for p in pages:  # contiguous pages make one span
        if want and want[-1][1] == p * page:
            want[-1] = (want[-1][0], (p + 1) * page)
        else:
            want.append((p * page, (p + 1) * page))
    want[-1] = (want[-1][0], min(want[-1][1], limit))
    assert runs.spans(shift, page, limit) == want  # numpy, for many runs
    few = [
        DeltaRuns(runs.size, runs.starts[i : i + 20], runs.lengths[i : i + 20], None)
        for i in range(0, 300, 20)
    ]
    pieces = [span for part in few for span in part.spans(shift, page, limit)]
    merged: list[tuple[int, int]] = []
    for lo, hi in pieces:  # the parts' spans, merged where parts meet
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    assert merged == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and MADV_POPULATE_WRITE")
def test_only_the_pages_the_deltas_change_are_copied_before_the_xor(tmp_path: Path) -> None:
    if not _can_populate_write(tmp_path):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    page = mmap.PAGESIZE
    data = os.urandom(16 * page)
    (tmp_path / "f").write_bytes(data)
    with (tmp_path / "f").open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), len(data), flags=mmap.MAP_PRIVATE)
    view = memoryview(mapped)[64:]  # a frame's payload starts past its header
    # Two links (offsets in the payload, 64 bytes into the file): a run across the
    # boundary of file pages 2 and 3; runs of both links in file page 9, one of them
    # reaching into page 10; one in page 12 only if the payload's offset is counted;
    # one in page 14.
    first = DeltaRuns(
        len(view), np.array([3 * page - 320, 9 * page]), np.array([512, 256]), np.ones(768, "u1")
    )
    second = DeltaRuns(
        len(view),
        np.array([10 * page - 192, 12 * page - 64, 14 * page]),
        np.array([256, 32, 256]),
        np.ones(544, "u1"),
    )
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    assert smaps_kib(address, "Anonymous") == 0
    for runs in (first, second):
        fault_for_writing(view, runs)
    assert smaps_kib(address, "Anonymous") * 1024 // page == 6  # pages 2, 3, 9, 10, 12 and 14
    assert bytes(mapped) == data  # copied, not changed
    for runs in (first, second):
        runs.xor_into(view)
    assert smaps_kib(address, "Anonymous") * 1024 // page == 6
    assert bytes(view[3 * page - 320 : 3 * page + 192]) != data[3 * page - 256 : 3 * page + 256]
    assert (tmp_path / "f").read_bytes() == data  # the file never changes
    fault_for_writing(memoryview(bytearray(100)), first)  # not a mapping: nothing to do
    fault_for_writing(view.toreadonly(), first)  # read-only: nothing to do, no error
