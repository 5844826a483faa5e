"""Chunk size trade-off: take and restore speed against dedup granularity.

    .venv/bin/python benchmarks/chunk_size.py [--size-gib 0.5] [--repeats 3]
        [--chunk-sizes 256K,1M,4M,16M,64M] [--out bench-out/chunk_size.json]

For every chunk size (``storage_options={"chunk_size": N}``), ``--repeats``
times into a fresh repository: take the state, restore it in place, then take
it again twice with 1% of the embedding's rows changed, once at scattered
random rows (what a sparse embedding update touches) and once as one
contiguous block, each against the first snapshot. Bytes written are the
take's own stats and the growth of ``chunks/`` + ``packs/`` on disk. The page
cache is dropped before every timed step when permitted. Prints a Markdown
table and writes JSON; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
from harness import (
    GiB,
    MiB,
    Samples,
    disk_usage,
    drop_page_cache,
    empty_like_state,
    filesystem_of,
    human_bytes,
    machine,
    make_state,
    markdown_table,
    same_state,
    scratch_dir,
    settle,
    state_bytes,
    transformer_shapes,
    write_json,
)

import casnap

EMBED = "embed.weight"
CHANGED_FRACTION = 0.01


@dataclass(frozen=True)
class Variants:
    state: dict[str, torch.Tensor]
    scattered: dict[str, torch.Tensor]  # 1% of embedding rows changed, at random rows
    block: dict[str, torch.Tensor]  # 1% of embedding rows changed, one contiguous block
    changed_bytes: int


def variants(state: dict[str, torch.Tensor], seed: int = 1) -> Variants:
    emb = state[EMBED]
    rows = emb.shape[0]
    n = max(1, round(rows * CHANGED_FRACTION))
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(rows, generator=gen)[:n]
    scattered = emb.clone()
    scattered[picked] += 1e-3 * torch.randn((n, emb.shape[1]), generator=gen)
    start = int(torch.randint(0, rows - n + 1, (1,), generator=gen))
    block = emb.clone()
    block[start : start + n] += 1e-3 * torch.randn((n, emb.shape[1]), generator=gen)
    changed = n * emb.shape[1] * emb.element_size()
    return Variants(state, {**state, EMBED: scattered}, {**state, EMBED: block}, changed)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _objects(repo: str) -> tuple[int, int]:
    """(du bytes, files) of the chunk and pack objects in the repository at ``repo``."""
    used = files = 0
    for sub in ("chunks", "packs"):
        u, _a, f = disk_usage(os.path.join(repo, ".casnap", sub))
        used, files = used + u, files + f
    return used, files


def take(
    rec: Samples,
    op: str,
    path: str,
    state: dict[str, torch.Tensor],
    chunk_size: int,
    cold: bool,
    parents: list[str] | None = None,
) -> casnap.Snapshot:
    repo = os.path.dirname(path)
    before, files_before = _objects(repo)
    settle(cold)
    snap = rec.time(
        op,
        lambda: casnap.Snapshot.take(
            path,
            {"model": casnap.StateDict(state)},
            storage_options={"chunk_size": chunk_size},
            parents=parents,
        ),
    )
    after, files_after = _objects(repo)
    stats = snap.last_take_stats
    rec.count(op, "bytes_written", stats.stored_bytes_written)
    rec.count(op, "chunks_written", stats.chunks_written)
    rec.count(op, "objects_written", stats.objects_written)
    rec.count(op, "disk_growth", after - before)
    rec.count(op, "files_added", files_after - files_before)
    return snap


def restore(
    rec: Samples, snap: casnap.Snapshot, state: dict[str, torch.Tensor], cold: bool, verify: bool
) -> None:
    """Restore in place into resident tensors of the state's shapes (a live model)."""
    target = empty_like_state(state, touch=True)
    settle(cold)
    rec.time("restore", lambda: snap.restore({"model": casnap.StateDict(target)}))
    if verify and not same_state(state, target):
        raise SystemExit(f"{snap.path}: restore did not reproduce the state")


def bench_one(v: Variants, chunk_size: int, work: str, cold: bool, verify: bool) -> Samples:
    rec = Samples()
    repo = os.path.join(work, "repo")
    first = take(rec, "take", os.path.join(repo, "full"), v.state, chunk_size, cold)
    _du, manifests, _files = disk_usage(os.path.join(repo, ".casnap", "manifests"))
    rec.count("take", "manifest_bytes", manifests)
    restore(rec, first, v.state, cold, verify)
    parent = [first.manifest_hash]
    take(rec, "scattered", os.path.join(repo, "scattered"), v.scattered, chunk_size, cold, parent)
    take(rec, "block", os.path.join(repo, "block"), v.block, chunk_size, cold, parent)
    return rec


def merge(into: Samples, other: Samples) -> None:
    for op, xs in other.seconds.items():
        for x in xs:
            into.add(op, x)
    for op, counters in other.counters.items():
        for name, values in counters.items():
            for value in values:
                into.count(op, name, value)


def table(results: dict[int, Samples], errors: dict[int, str], nbytes: int, v: Variants) -> str:
    peer_cs = 4 * MiB if 4 * MiB in results else min(results, default=4 * MiB)
    peer = results.get(peer_cs)
    rows = []
    for cs in sorted({*results, *errors}):
        if cs in errors:
            rows.append([human_bytes(cs), "error: " + errors[cs]] + [""] * 8)
            continue
        rec = results[cs]
        take_s, restore_s = rec.median("take"), rec.median("restore")
        scattered = rec.counter("scattered", "bytes_written")
        block = rec.counter("block", "bytes_written")
        assert peer is not None and scattered is not None and block is not None
        rows.append(
            [
                human_bytes(cs),
                f"{take_s:.3f}",
                f"{nbytes / GiB / take_s:.2f}",
                f"{take_s / peer.median('take'):.2f}",
                f"{restore_s:.3f}",
                f"{nbytes / GiB / restore_s:.2f}",
                f"{human_bytes(scattered)} ({scattered / v.changed_bytes:.1f}×)",
                f"{human_bytes(block)} ({block / v.changed_bytes:.1f}×)",
                str(rec.counter("take", "files_added")),
                human_bytes(rec.counter("take", "manifest_bytes")),
            ]
        )
    headers = [
        "chunk size",
        "take s",
        "take GiB/s",
        f"take × {human_bytes(peer_cs)}",
        "restore s",
        "restore GiB/s",
        "1% rows scattered: written",
        "1% rows block: written",
        "objects",
        "manifest",
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5, help="state size (default 0.5)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per chunk size (median)")
    p.add_argument("--chunk-sizes", default="256K,1M,4M,16M,64M")
    p.add_argument("--out", default="bench-out/chunk_size.json")
    p.add_argument(
        "--workdir",
        default="bench-out/scratch",
        help="parent of the scratch directories (must be a real disk)",
    )
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.chunk_sizes.split(",") if s.strip()]

    d, layers, shapes = transformer_shapes(int(args.size_gib * GiB))
    v = variants(make_state(shapes, seed=0))
    nbytes = state_bytes(v.state)
    why_warm = "--warm given" if args.warm else drop_page_cache()
    cold = why_warm is None
    mnt, fstype = filesystem_of(os.path.abspath(args.workdir))
    emb = v.state[EMBED]
    print(
        f"state: {len(v.state)} fp32 tensors, {human_bytes(nbytes)} (hidden {d}, {layers} "
        f"layers); embedding {list(emb.shape)} = {human_bytes(emb.numel() * 4)}; 1% of its "
        f"rows = {human_bytes(v.changed_bytes)}"
    )
    print(
        f"scratch: {os.path.abspath(args.workdir)} on {fstype} ({mnt}); "
        f"{'cold (page cache dropped before each step)' if cold else 'warm: ' + str(why_warm)}; "
        f"repeats: {args.repeats}",
        flush=True,
    )

    results: dict[int, Samples] = {}
    errors: dict[int, str] = {}
    for r in range(args.repeats):
        for cs in sizes:
            if cs in errors:
                continue
            with scratch_dir(args.workdir) as work:
                try:
                    rec = bench_one(v, cs, work, cold, verify=r == 0)
                except casnap.CasnapError as exc:
                    errors[cs] = f"{type(exc).__name__}: {exc}"
                    continue
            merge(results.setdefault(cs, Samples()), rec)
            print(
                f"  repeat {r + 1}/{args.repeats}: chunk size {human_bytes(cs)} done",
                file=sys.stderr,
                flush=True,
            )

    print()
    print(table(results, errors, nbytes, v))
    payload = {
        "benchmark": "chunk_size",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine(),
        "state": {
            "bytes": nbytes,
            "tensors": len(v.state),
            "hidden": d,
            "layers": layers,
            "embedding_shape": list(emb.shape),
            "changed_fraction": CHANGED_FRACTION,
            "changed_bytes": v.changed_bytes,
        },
        "scratch": {"path": os.path.abspath(args.workdir), "fstype": fstype, "mount": mnt},
        "cache": "cold" if cold else "warm",
        "cache_note": None if cold else why_warm,
        "repeats": args.repeats,
        "results": {str(cs): rec.as_json() for cs, rec in sorted(results.items())},
        "errors": {str(cs): msg for cs, msg in errors.items()},
    }
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
