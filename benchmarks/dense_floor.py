"""Dense state against the machine's floors, and restore into new tensors against its peers.

    .venv/bin/python benchmarks/dense_floor.py [--size-mib 1024] [--read-size-mib 2048]
        [--repeats 3] [--workdir bench-out/scratch] [--json] [--take-only]

On one transformer-shaped fp32 state, steps interleaved within each repeat, medians: the
first take ÷ the best raw write + fsync (<= 1.15; ``--take-only`` measures only these); the
in-place restore, warm ÷ a warm read + blake3 on both cores (<= 1.5); restore into new
tensors ÷ ``torch.load``, warm and cold (<= 1.0); ``read_object`` of the largest tensor of a
cold ``--read-size-mib`` snapshot ÷ ``safe_open(...).get_tensor(key).clone()`` (the lazy
call and the floor of a verified read, cold read + blake3, printed beside it).
benchmarks/README.md ("Floors") says how each is measured; ``mallopt`` gives large
allocations fresh pages, as in a process that just started.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import blake3
import torch
from harness import (
    drop_page_cache,
    empty_like_state,
    fsync_path,
    make_state,
    same_state,
    scratch_dir,
    state_bytes,
    transformer_shapes,
)
from safetensors import safe_open
from safetensors.torch import save_file

import casnap
from casnap.torch_io.tensors import byte_view

State = dict[str, torch.Tensor]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def raw_write(state: State, folder: str, threads: int, step: int | None = None) -> None:
    """The state's bytes into ``threads`` files (tensors dealt round-robin by size), fsynced;
    one ``write`` per tensor, or per ``step`` bytes of it."""
    os.makedirs(folder)
    shares: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for t in sorted(state.values(), key=lambda t: -t.nbytes):
        i = loads.index(min(loads))
        shares[i].append(t)
        loads[i] += t.nbytes

    def write(i: int) -> None:
        path = os.path.join(folder, f"part{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in shares[i]:
                view = byte_view(t)
                done = 0
                while done < len(view):
                    end = len(view) if step is None else done + step
                    done += os.write(fd, view[done:end])
            os.fsync(fd)
        finally:
            os.close(fd)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    fsync_path(folder)


def read_and_hash(path: str, target: State) -> None:
    """Read ``path`` (one writer's file) into ``target``'s memory and blake3 it on two cores."""
    with open(path, "rb", buffering=0) as fh:
        for t in sorted(target.values(), key=lambda t: -t.nbytes):
            view = byte_view(t)
            got = 0
            while got < len(view):
                got += fh.readinto(view[got:])
            blake3.blake3(view, max_threads=2).digest()


def restore_into(snap: str, target: State) -> None:
    """Restore ``snap`` into ``target`` (filled in place; empty: with tensors it allocates)."""
    sd = casnap.StateDict(target)
    casnap.Snapshot(snap).restore({"model": sd})
    target.update(sd)


# The raw writers: one thread into one file or 8 into 8, one write() per tensor or per
# 256 KiB (this VM's kernel copies 256 KiB writes into the page cache for about a third
# of the CPU that writes of several MiB take: larger folios to allocate).
_RAW: list[tuple[str, int, int | None]] = [
    ("raw write+fsync x1", 1, None),
    ("raw write+fsync x8", 8, None),
    ("raw write+fsync x1, 256 KiB writes", 1, 256 << 10),
    ("raw write+fsync x8, 256 KiB writes", 8, 256 << 10),
]


def _cold(cold_ok: bool) -> None:
    if cold_ok:
        drop_page_cache()


def measure(
    size: int, read_size: int, repeats: int, work: str, take_only: bool = False
) -> dict[str, Any]:
    _d, _n, shapes = transformer_shapes(size)
    state = make_state(shapes)
    nbytes = state_bytes(state)
    target = empty_like_state(state, touch=True)  # a live model's resident tensors
    cold_ok = drop_page_cache() is None
    s: dict[str, list[float]] = {}

    def rec(name: str, seconds: float) -> None:
        s.setdefault(name, []).append(seconds)

    for i in range(repeats):
        for name, threads, step in _RAW:
            _cold(cold_ok)  # no dirty pages of the previous step
            folder = f"{work}/raw{i}-{threads}-{step}"
            rec(name, _timed(partial(raw_write, state, folder, threads, step))[0])
        _cold(cold_ok)
        snap = f"{work}/repo{i}/s"
        take = partial(casnap.Snapshot.take, snap, {"model": casnap.StateDict(state)})
        rec("casnap first take", _timed(take)[0])
        for _name, threads, step in _RAW[1:]:  # the first, one file, is read back below
            shutil.rmtree(f"{work}/raw{i}-{threads}-{step}")
        if take_only:
            shutil.rmtree(f"{work}/repo{i}")
            shutil.rmtree(f"{work}/raw{i}-1-None")
            continue
        # warm: the raw file and the chunks were just written and are in the page cache
        raw = f"{work}/raw{i}-1-None/part0"
        read_and_hash(raw, target)  # settle: both equally warm
        rec("warm read+blake3 (2 cores)", _timed(partial(read_and_hash, raw, target))[0])
        rec("casnap restore in place (warm)", _timed(partial(restore_into, snap, target))[0])
        pt = f"{work}/t{i}.pt"
        torch.save(state, pt)
        fsync_path(pt)
        for cache in ("cold", "warm"):
            if cache == "cold":
                _cold(cold_ok)
            dt, loaded = _timed(partial(torch.load, pt, weights_only=True))
            rec(f"torch.load ({cache})", dt)
            del loaded
            if cache == "cold":
                _cold(cold_ok)
            fresh: State = {}  # an empty StateDict: the restore allocates every tensor
            dt, _ = _timed(partial(restore_into, snap, fresh))
            rec(f"casnap restore, new tensors ({cache})", dt)
            if i == 0:
                assert same_state(fresh, state), "restore is not bit-exact"
            del fresh
        shutil.rmtree(f"{work}/raw{i}-1-None")
        os.unlink(pt)
    if take_only:
        return {"state_bytes": nbytes, "medians_s": _medians(s), "cold": cold_ok, **_take(s)}
    out = _ratios(s, nbytes)
    out["read_object"] = read_one(read_size, repeats, work, cold_ok)
    out["cold"] = cold_ok
    return out


def read_one(size: int, repeats: int, work: str, cold_ok: bool) -> dict[str, Any]:
    """One tensor (the largest) out of a cold ``size``-byte snapshot and safetensors file."""
    _d, _n, shapes = transformer_shapes(size)
    state = make_state(shapes)
    key = sorted(state.items(), key=lambda kv: kv[1].nbytes)[-1][0]
    st_path = f"{work}/big.safetensors"
    save_file(state, st_path)
    fsync_path(st_path)
    casnap.Snapshot.take(f"{work}/big/s", {"model": casnap.StateDict(state)})
    want = state[key].clone()
    del state
    # warm-up: imports and first-call set-up of both readers, on the same files
    with safe_open(st_path, framework="pt") as f:
        f.get_tensor(key)
    casnap.Snapshot(f"{work}/big/s").read_object(f"0/model/{key}")
    span = _safetensors_span(st_path, key)
    read_one_floor(st_path, span, want)  # warm-up
    runs: list[list[float]] = [[], [], [], []]  # seconds: safetensors, lazy, casnap, floor
    st, lazy, cs, floor = runs
    for _ in range(repeats):
        for out in (lazy, st):
            _cold(cold_ok)

            def st_read(out: list[float] = out) -> torch.Tensor:
                with safe_open(st_path, framework="pt") as f:
                    t = f.get_tensor(key)
                    return t if out is lazy else t.clone()

            dt, got = _timed(st_read)
            out.append(dt)
            assert torch.equal(got, want)
            # The lazy tensor maps the file: alive, its pages survive the next drop of
            # the page cache, and the "cold" clone after it would read warm pages.
            del got
        _cold(cold_ok)
        floor.append(_timed(partial(read_one_floor, st_path, span, want))[0])
        _cold(cold_ok)
        dt, got = _timed(lambda: casnap.Snapshot(f"{work}/big/s").read_object(f"0/model/{key}"))
        cs.append(dt)
        assert torch.equal(got, want)
        del got
    a, b, f = statistics.median(cs), statistics.median(st), statistics.median(floor)
    return {
        "snapshot_bytes": size,
        "tensor": key,
        "tensor_bytes": want.nbytes,
        "casnap_s": a,
        "safetensors_s": b,
        "safetensors_lazy_s": statistics.median(lazy),
        "read_blake3_floor_s": f,
        "ratio": a / b,
        "floor_ratio": f / b,
        "over_floor": a / f,
    }


def _safetensors_span(path: str, key: str) -> tuple[int, int]:
    """Where ``key``'s bytes lie in the safetensors file at ``path`` (start, end)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    begin, end = header[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def read_one_floor(path: str, span: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """The floor of a verified read: the tensor's bytes read into a new tensor (one
    ``preadv``, aligned as safetensors lays them out), then blake3 of them on both cores."""
    out = torch.empty_like(like)
    view = byte_view(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            got += os.preadv(fd, [view[got:]], span[0] + got)
    finally:
        os.close(fd)
    blake3.blake3(view, max_threads=2).digest()
    return out


def _medians(s: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in s.items()}


def _take(s: dict[str, list[float]]) -> dict[str, Any]:
    """The take's ratio to the best raw write: of the medians, and in each repeat
    (the take against the best raw write of the same repeat, which moves less on a
    loaded machine); and against the best of the two writers issue #14 named (one
    write per tensor), as measured before the 256 KiB writers were added."""
    med = _medians(s)
    names = [name for name, _t, _s in _RAW]
    take = s["casnap first take"]
    each = [t / min(s[n][i] for n in names) for i, t in enumerate(take)]
    return {
        "take_over_write_floor": med["casnap first take"] / min(med[n] for n in names),
        "take_ratios": each,
        "take_over_whole_tensor_writes": med["casnap first take"] / min(med[n] for n in names[:2]),
    }


# The printed ratios after the take's: (label, key in the output, target, the step whose
# median is over the median of the other).
_RATIO_ROWS = [
    ("restore in place / warm read+blake3", "restore_over_read_hash_floor", 1.5,
     "casnap restore in place (warm)", "warm read+blake3 (2 cores)"),
    ("new tensors / torch.load, warm", "new_tensors_over_torch_load_warm", 1.0,
     "casnap restore, new tensors (warm)", "torch.load (warm)"),
    ("new tensors / torch.load, cold", "new_tensors_over_torch_load_cold", 1.0,
     "casnap restore, new tensors (cold)", "torch.load (cold)"),
]  # fmt: skip


def _ratios(s: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    med = _medians(s)
    ratios = {key: med[a] / med[b] for _, key, _, a, b in _RATIO_ROWS}
    return {"state_bytes": nbytes, "medians_s": med, **_take(s), **ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--read-size-mib", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="bench-out/scratch")
    p.add_argument("--json", action="store_true")
    p.add_argument("--take-only", action="store_true", help="only the take and the raw writes")
    args = p.parse_args(argv)
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fresh pages, as in a new process
    with scratch_dir(args.workdir) as work:
        out = measure(
            args.size_mib << 20, args.read_size_mib << 20, args.repeats, work, args.take_only
        )
    if args.json:
        print(json.dumps(out))
        return 0
    warm = "" if out["cold"] else " (page cache could not be dropped: cold rows are warm)"
    print(f"dense state {out['state_bytes'] / 2**20:.0f} MiB, medians of {args.repeats}{warm}:")
    for name, v in out["medians_s"].items():
        print(f"  {name:38s} {v:7.3f} s")
    each = ", ".join(f"{r:.2f}" for r in out["take_ratios"])
    print(
        f"  take / best raw write+fsync            {out['take_over_write_floor']:5.2f}x (<= 1.15;"
        f" in each repeat {each}; against the two one-write-per-tensor writers alone"
        f" {out['take_over_whole_tensor_writes']:.2f}x)"
    )
    if args.take_only:
        return 0
    for label, key, limit, _, _ in _RATIO_ROWS:
        print(f"  {label:38s} {out[key]:5.2f}x (<= {limit})")
    r = out["read_object"]
    print(
        f"  read_object / safe_open.get_tensor     {r['ratio']:5.2f}x (<= 1.0): "
        f"{r['tensor_bytes'] / 2**20:.0f} MiB of a {r['snapshot_bytes'] / 2**20:.0f} MiB "
        f"snapshot, cold, casnap {r['casnap_s']:.3f} s, safetensors {r['safetensors_s']:.3f} s"
        f" (lazy get_tensor alone {r['safetensors_lazy_s']:.3f} s)"
    )
    print(
        f"  read+blake3 floor / safe_open.get_tensor {r['floor_ratio']:5.2f}x, read_object / "
        f"that floor {r['over_floor']:5.2f}x: the floor reads the tensor's bytes cold into a "
        f"new tensor and hashes them on both cores, {r['read_blake3_floor_s']:.3f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
