"""A state of many small tensors: first take and unchanged re-take against torch.save + fsync.

    .venv/bin/python benchmarks/small_tensors.py [--tensors 20000 2000] [--numel 64]
        [--repeats 5] [--workdir bench-out/scratch] [--profile first|retake|alone] [--json]
    .venv/bin/python benchmarks/small_tensors.py --metadata 100 [--refs 1000000]

Per-tensor overheads decide this case, not bandwidth (20,000 tensors of 256 B are 5 MB).
Per ``--tensors`` count and repeat, interleaved with torch.save + fsync of the same dict:
the first take into a fresh repository, an unchanged re-take in the same session, and two
unchanged re-takes without one (``Snapshot.take(f"{root}/step_{n}", ...)``, parent the
newest in the folder; the second is the steady state and the target row). Prints medians
and the ratios of wall and of CPU time (first <= 1.5x, re-take <= 0.5x, without a session
<= 0.6x). ``--profile`` prints cProfile's top of one first take, re-take or ``alone``.
``--metadata N`` measures what manifests cost instead: the metadata bytes per chunk
reference of N snapshots of a 64 MiB state (16 tensors, 256 KiB chunks, 10% of the chunks
``+= 1.0`` per take, one Session; every file of ``.casnap/`` but chunk data), and what an
unchanged re-take of a synthetic manifest of ``--refs`` references writes (docs/format.md).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import time
from functools import partial
from typing import Any

import torch
from harness import scratch_dir

from casnap import Session, Snapshot, StateDict
from casnap.format.manifest import Dumped
from casnap.format.manifest_bytes import (
    entry_texts,
    trusted_chunk_ref,
    trusted_manifest,
    trusted_tensor_entry,
)
from casnap.repo.repository import RepoStorage, now_iso
from casnap.take.reuse import REUSE


def _state(tensors: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}


def _clock(fn: Any) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) of ``fn()``: on a shared machine the
    CPU ratio moves less than the wall one."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def _save(state: dict[str, torch.Tensor], path: str) -> None:
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def measure(tensors: int, numel: int, repeats: int, work: str) -> dict[str, Any]:
    """Medians of ``repeats`` first takes, re-takes and torch.save + fsync."""
    state = _state(tensors, numel)
    app = {"model": StateDict(state)}
    first, retake, cold, alone, save = [], [], [], [], []
    for i in range(repeats):
        session = Session()  # one training process per repeat
        repo = os.path.join(work, f"repo{i}")
        pt = os.path.join(work, f"t{i}.pt")
        first.append(_clock(partial(Snapshot.take, f"{repo}/s0", app, session=session)))
        retake.append(_clock(partial(Snapshot.take, f"{repo}/s1", app, session=session)))
        # Without a session: the parent (s1) is not one this process took without a
        # session, as for a new process per save; then the loop's next take (parent s2).
        REUSE.clear()  # as in a new process: no parent in memory (casnap.take.reuse)
        cold.append(_clock(partial(Snapshot.take, f"{repo}/s2", app)))
        alone.append(_clock(partial(Snapshot.take, f"{repo}/s3", app)))
        save.append(_clock(partial(_save, state, pt)))
        shutil.rmtree(repo)
        os.unlink(pt)
    runs = {"first": first, "retake": retake, "retake_no_session": alone, "save": save}
    runs["retake_new_process"] = cold
    out: dict[str, Any] = {"tensors": tensors, "tensor_bytes": numel * 4, "repeats": repeats}
    wall = {k: statistics.median(w for w, _ in x) for k, x in runs.items()}
    cpu = {k: statistics.median(c for _, c in x) for k, x in runs.items()}
    for k in runs:
        out[f"{k}_s"] = wall[k]
        if k != "save":
            out[f"{k}_ratio"], out[f"{k}_cpu_ratio"] = wall[k] / wall["save"], cpu[k] / cpu["save"]
    return out


# The printed rows: label, key, and the target (None: no target, no CPU ratio shown).
_ROWS = [
    ("casnap first take", "first", 1.5),
    ("casnap unchanged take", "retake", 0.5),
    ("same, without session", "retake_no_session", 0.6),
    ("same, parent not taken", "retake_new_process", None),
]


def profile(tensors: int, numel: int, which: str, work: str) -> None:
    state = _state(tensors, numel)
    app = {"model": StateDict(state)}
    session = Session()
    repo = os.path.join(work, "prof")
    prof = cProfile.Profile()
    if which == "first":
        prof.enable()
    Snapshot.take(os.path.join(repo, "s0"), app, session=session)
    if which == "first":
        prof.disable()
    elif which == "retake":
        prof.enable()
        Snapshot.take(os.path.join(repo, "s1"), app, session=session)
        prof.disable()
    else:  # the session-less loop's second take (parent s1, taken without a session)
        Snapshot.take(os.path.join(repo, "s1"), app)
        prof.enable()
        Snapshot.take(os.path.join(repo, "s2"), app)
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def metadata_per_ref(work: str, snapshots: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    numel = 64 * 1024  # a 256 KiB chunk of float32
    state = {f"w{i:02d}": torch.randn(16 * numel, generator=g) for i in range(16)}
    session, opts, names = Session(), {"chunk_size": 256 << 10}, []
    for s in range(snapshots):
        for c in torch.randperm(256, generator=g)[:26].tolist() if s else []:  # 10%
            state[f"w{c // 16:02d}"][(c % 16) * numel : (c % 16 + 1) * numel] += 1.0
        names.append(f"s{s:05d}")
        path = os.path.join(work, "history", names[-1])
        Snapshot.take(path, {"m": StateDict(state)}, session=session, settings=opts)
    storage = RepoStorage.open(os.path.join(work, "history"))
    parts, refs = set(), 0
    for name in names:
        m = storage.read_manifest(storage.resolve(name))
        parts |= {p.hash for p in m.parts}
        refs += len(m.chunk_refs())
    meta, total = os.path.join(work, "history", ".casnap"), 0
    for folder, _, files in os.walk(meta):
        top = os.path.relpath(folder, meta).split(os.sep)[0]
        for f in files:  # chunk data: packs, and loose chunks that are not parts
            if top != "packs" and (top != "chunks" or f in parts):
                total += os.path.getsize(os.path.join(folder, f))
    return {"snapshots": snapshots, "chunk_refs": refs, "bytes_per_ref": total / refs}


def unchanged_metadata(work: str, refs: int, per_entry: int = 1000) -> dict[str, Any]:
    """The bytes an unchanged re-take of a manifest of ``refs`` references writes."""
    storage = RepoStorage.open_or_create(os.path.join(work, "synthetic"))
    entries: dict[str, Any] = {}
    for e in range(refs // per_entry):
        chunks = [
            trusted_chunk_ref(os.urandom(32).hex(), 4096, None, 0, 4152) for _ in range(per_entry)
        ]
        shape = [4096 * per_entry]
        entries[f"0/m/t{e:06d}"] = trusted_tensor_entry("uint8", shape, 4096, chunks, False, None)
    first = trusted_manifest(entries, created_at=now_iso(), parents=[])
    texts = entry_texts(first)
    h, stored = storage.write_manifest(first, texts)
    meta = os.path.join(work, "synthetic", ".casnap")
    before = {os.path.join(d, f) for d, _, fs in os.walk(meta) for f in fs}
    child = trusted_manifest(first.entries, created_at=now_iso(), parents=[h])
    storage.write_manifest(child, entry_texts(child, Dumped(stored, texts)))
    new = {os.path.join(d, f) for d, _, fs in os.walk(meta) for f in fs} - before
    whole = len(first.model_copy(update={"parts": []}).model_dump_json())  # all inline, about
    return {"refs": refs, "retake_bytes": sum(map(os.path.getsize, new)), "inline_bytes": whole}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tensors", type=int, nargs="+", default=[20000, 2000])
    p.add_argument("--numel", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default="bench-out/scratch")
    p.add_argument("--profile", choices=["first", "retake", "alone"])
    p.add_argument("--json", action="store_true", help="print one JSON line per count")
    p.add_argument("--metadata", type=int, help="snapshots of the metadata measurement")
    p.add_argument("--refs", type=int, default=10**6, help="chunk refs of the synthetic re-take")
    args = p.parse_args(argv)
    with scratch_dir(args.workdir) as work:
        if args.metadata:
            print(json.dumps(metadata_per_ref(work, args.metadata)))
            print(json.dumps(unchanged_metadata(work, args.refs)))
            return 0
        if args.profile:
            profile(args.tensors[0], args.numel, args.profile, work)
            return 0
        for n in args.tensors:
            m = measure(n, args.numel, args.repeats, work)
            if args.json:
                print(json.dumps(m))
                continue
            print(f"{n} tensors of {args.numel * 4} B, medians of {args.repeats}:")
            for label, key, limit in _ROWS:
                ratio = f"{m[key + '_s']:6.3f} s  {m[key + '_ratio']:5.2f}x torch.save"
                if limit is None:
                    print(f"  {label:22s} {ratio} (a new process per save)")
                else:
                    cpu = m[key + "_cpu_ratio"]
                    print(f"  {label:22s} {ratio} (target <= {limit}x), CPU {cpu:4.2f}x")
            print(f"  torch.save + fsync     {m['save_s']:6.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
