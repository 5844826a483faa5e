"""The device (GPU) staging path, exercised on the CPU (docs/gpu.md).

A pool made with ``device_path_for_cpu=True`` sends CPU tensors through the
same piece-by-piece copy engine contract CUDA tensors use; a
:class:`ThreadCopies` engine with a delay makes copies slow enough that a
writer hashing a piece before its copy landed, or an async take returning
before its copies finished, would store the wrong bytes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import numbered_tensors

import casnap
from casnap import Session, Snapshot, StateDict
from casnap.settings import Settings
from casnap.take.target import staging_limit
from casnap.torch_io.staging import StagingFull, StagingPool, ThreadCopies

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64 * 1024


def _session(delay_s: float = 0.0, idle: int = 1 << 30) -> Session:
    s = Session()
    s.staging = StagingPool(idle, engine=ThreadCopies(delay_s), device_path_for_cpu=True)
    return s


def _restored(path: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = StateDict({k: torch.zeros_like(v) for k, v in like.items()})
    Snapshot(path).restore({"m": out})
    return dict(out)


def test_take_hashes_each_chunk_only_after_its_copy_landed(tmp_path: Path) -> None:
    ref = numbered_tensors(4, 100_000)
    session = _session(delay_s=0.002)  # every 64 KiB piece lands 2 ms after it was issued
    with casnap.settings.override(chunk_size=CHUNK, compression="none"):
        Snapshot.take(
            f"{tmp_path}/r/a",
            {"m": StateDict({k: v.clone() for k, v in ref.items()})},
            session=session,
        )
    got = _restored(f"{tmp_path}/r/a", ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    pool = session.staging
    assert pool.in_use_bytes == 0  # every piece buffer went back after its last chunk
    assert pool.reused_bytes > 0  # a later tensor's copy reused an earlier one's buffer


def test_async_take_returns_only_once_every_copy_is_staged(tmp_path: Path) -> None:
    ref = numbered_tensors(4, 100_000)
    live = {k: v.clone() for k, v in ref.items()}
    session = _session(delay_s=0.02)
    with casnap.settings.override(chunk_size=CHUNK):
        pending = Snapshot.async_take(f"{tmp_path}/r/a", {"m": StateDict(live)}, session=session)
        for t in live.values():  # training goes on the moment async_take returns
            t.fill_(-1.0)
        pending.wait()
    got = _restored(f"{tmp_path}/r/a", ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_pool_reuses_its_buffers_across_async_takes(tmp_path: Path) -> None:
    state = {"m": StateDict(numbered_tensors(4, 100_000))}
    nbytes = sum(v.numel() * v.element_size() for v in state["m"].values())
    session = _session()
    pool = session.staging
    with casnap.settings.override(chunk_size=CHUNK):
        Snapshot.async_take(f"{tmp_path}/r/a", state, session=session).wait()
        first = pool.allocated_bytes
        assert first == nbytes and pool.idle_bytes == nbytes
        for t in state["m"].values():
            t.add_(1.0)
        Snapshot.async_take(f"{tmp_path}/r/b", state, session=session).wait()
    assert pool.allocated_bytes == first  # nothing new: the second take reused every buffer
    assert pool.reused_bytes == nbytes
    got = _restored(f"{tmp_path}/r/b", dict(state["m"]))
    assert all(torch.equal(got[k], state["m"][k]) for k in got)


def test_pool_never_holds_more_than_the_staging_budget(tmp_path: Path) -> None:
    # 16 MiB of state, a budget whose staging share (7 MiB) is below it: most tensors
    # stay live and are copied chunk by chunk while the staged buffers are held.
    state = {"m": StateDict(numbered_tensors(8, 512 * 1024))}
    budget = 12 << 20
    session = _session()
    with casnap.settings.override(chunk_size=CHUNK, io_workers=4):
        settings = Settings.from_env()
        limit = staging_limit(budget, settings)
        for name in ("a", "b"):
            Snapshot.async_take(
                f"{tmp_path}/r/{name}", state, session=session, memory_budget_bytes=budget
            ).wait()
            Snapshot.take(
                f"{tmp_path}/r/s{name}", state, session=session, memory_budget_bytes=budget
            )
    pool = session.staging
    # Staged buffers stay within the staging share; the tensors past it are copied
    # chunk by chunk within the rest of the budget.
    assert limit < 16 << 20 and pool.allocated_bytes > 0
    assert pool.peak_in_use_bytes <= budget
    assert pool.peak_held_bytes <= budget
    got = _restored(f"{tmp_path}/r/b", dict(state["m"]))
    assert all(torch.equal(got[k], state["m"][k]) for k in got)


def test_buffers_in_use_never_exceed_the_limit() -> None:
    pool = StagingPool(1 << 20, engine=ThreadCopies(), device_path_for_cpu=True)
    a = pool.stage(torch.ones(1000), limit=6000)  # 4000 bytes in use
    with pytest.raises(StagingFull):
        pool.stage(torch.ones(1000), limit=6000)  # 8000 > 6000: refused, nothing allocated
    assert pool.in_use_bytes == 4000 and pool.allocated_bytes == 4000
    pool.give_back([a])
    b = pool.stage(torch.full((1000,), 2.0), limit=6000)  # the idle buffer, reused
    assert pool.allocated_bytes == 4000 and torch.equal(b, torch.full((1000,), 2.0))


def test_second_async_take_while_the_first_writes_keeps_the_rest_live(tmp_path: Path) -> None:
    state = {"m": StateDict(numbered_tensors(4, 256 * 1024))}  # 4 MiB
    session = _session()
    budget = 16 << 20
    with casnap.settings.override(chunk_size=CHUNK, io_workers=1):
        limit = staging_limit(budget, Settings.from_env())
        first = Snapshot.async_take(
            f"{tmp_path}/r/a", state, session=session, memory_budget_bytes=budget
        )
        second = Snapshot.async_take(
            f"{tmp_path}/r/b", state, session=session, memory_budget_bytes=budget
        )
        first.wait()
        second.wait()
    assert session.staging.peak_in_use_bytes <= limit
    got = _restored(f"{tmp_path}/r/b", dict(state["m"]))
    assert all(torch.equal(got[k], state["m"][k]) for k in got)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_pinned_allocation_falls_back_to_plain_memory_without_cuda() -> None:
    pool = StagingPool(1 << 20, pin=True, engine=ThreadCopies(), device_path_for_cpu=True)
    out = pool.stage(torch.arange(10, dtype=torch.int64))  # the device path asks for pinning
    assert torch.equal(out, torch.arange(10)) and not out.is_pinned()
    assert pool.pinned_bytes == 0 and pool.pin is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_round_trips_through_pinned_buffers(tmp_path: Path) -> None:
    ref = {k: v.cuda() for k, v in numbered_tensors(4, 100_000).items()}
    session = Session()
    with casnap.settings.override(chunk_size=CHUNK):
        Snapshot.async_take(f"{tmp_path}/r/a", {"m": StateDict(ref)}, session=session).wait()
        Snapshot.take(f"{tmp_path}/r/b", {"m": StateDict(ref)}, session=session)
    assert session.staging.pinned_bytes > 0
    for name in ("a", "b"):
        got = _restored(f"{tmp_path}/r/{name}", {k: v.cpu() for k, v in ref.items()})
        assert all(torch.equal(got[k], ref[k].cpu()) for k in ref)


def test_gpu_benchmark_skips_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the benchmark would run")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_take.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert "skip" in run.stdout.lower()
