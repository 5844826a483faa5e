"""What the casnap benchmarks share: the test state, timing, page cache, disk usage, output.

Not part of the casnap package; imported by the scripts next to it
(``python benchmarks/<script>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
VOCAB = 32_000  # rows of the embedding; a common tokenizer size


# -- the state under test --------------------------------------------------


def _layer_shapes(d: int, i: int) -> dict[str, tuple[int, ...]]:
    p = f"layers.{i}."
    return {
        p + "ln1.weight": (d,),
        p + "ln1.bias": (d,),
        p + "attn.qkv.weight": (3 * d, d),
        p + "attn.qkv.bias": (3 * d,),
        p + "attn.out.weight": (d, d),
        p + "attn.out.bias": (d,),
        p + "ln2.weight": (d,),
        p + "ln2.bias": (d,),
        p + "mlp.fc1.weight": (4 * d, d),
        p + "mlp.fc1.bias": (4 * d,),
        p + "mlp.fc2.weight": (d, 4 * d),
        p + "mlp.fc2.bias": (d,),
    }


def _numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def transformer_shapes(target_bytes: int) -> tuple[int, int, dict[str, tuple[int, ...]]]:
    """(hidden size, layer count, shapes) of an fp32 transformer close to ``target_bytes``.

    The widest hidden size (a multiple of 256) that leaves room for at least
    four layers next to a 32k-row embedding, with the layer count that lands
    closest to the target (within half a layer).
    """
    for d in range(4096, 0, -256):
        emb = VOCAB * d * 4
        per_layer = _numel(_layer_shapes(d, 0)) * 4
        layers = round((target_bytes - emb) / per_layer)
        if layers >= 4 or d == 256:
            shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, d)}
            for i in range(max(layers, 1)):
                shapes.update(_layer_shapes(d, i))
            shapes["ln_f.weight"] = (d,)
            shapes["ln_f.bias"] = (d,)
            return d, max(layers, 1), shapes
    raise AssertionError("unreachable")


def make_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct, weight-like fp32 values (no two chunks equal, compressible like real weights)."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if key.endswith("ln1.weight") or key.endswith("ln2.weight") or key == "ln_f.weight":
            t = 1.0 + 0.01 * t
        else:
            t = 0.02 * t
        state[key] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def empty_like_state(state: dict[str, torch.Tensor], touch: bool) -> dict[str, torch.Tensor]:
    """Same shapes; ``touch`` zero-fills so the pages are resident (a live model's state)."""
    out = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}
    if touch:
        for t in out.values():
            t.zero_()
    return out


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- environment -----------------------------------------------------------


def filesystem_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from /proc/mounts."""
    path, best = os.path.realpath(path), ("/", "unknown")
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            mounts = [fields[1:3] for fields in map(str.split, fh) if len(fields) >= 3]
    except OSError:
        return best
    for mnt, fstype in mounts:
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, fstype)
    return best


_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}


@contextmanager
def scratch_dir(parent: str) -> Iterator[str]:
    """A fresh directory under ``parent`` on a real disk, removed afterwards."""
    os.makedirs(parent, exist_ok=True)
    _mnt, fstype = filesystem_of(parent)
    if fstype in _MEMORY_FS:
        raise SystemExit(f"{parent} is on {fstype} (memory); pass --workdir on a real disk")
    path = tempfile.mkdtemp(prefix="run-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def drop_page_cache() -> str | None:
    """Write back dirty pages and drop the page cache; None on success, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
    except OSError as exc:
        return f"cannot drop the page cache: {exc.strerror or exc}"
    return None


def settle(cold: bool) -> None:
    """Start every timed step from the same place: no dirty pages, no garbage, cache as asked."""
    gc.collect()
    if cold:
        drop_page_cache()
    else:
        os.sync()


def disk_usage(path: str) -> tuple[int, int, int]:
    """(bytes on disk as ``du`` counts them, apparent bytes, files) below ``path``."""
    used = apparent = files = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            used += st.st_blocks * 512
            apparent += st.st_size
            files += 1
    return used, apparent, files


def fsync_one(path: str) -> None:
    """fsync one file or folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync a file and its directory: what a durable save needs."""
    fsync_one(path)
    fsync_one(os.path.dirname(os.path.abspath(path)))


def machine() -> dict[str, Any]:
    import casnap

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "casnap": casnap.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    info.update(source_revision(os.path.dirname(os.path.dirname(casnap.__file__))))
    return info


def source_revision(checkout: str) -> dict[str, Any]:
    """The casnap commit measured, and whether its sources had uncommitted changes."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    return {"casnap_commit": commit, "casnap_dirty": bool(git("status", "--porcelain", "casnap"))}


# -- recording and output ----------------------------------------------------


@dataclass
class Samples:
    """Per-operation timings and byte counts from every repeat."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def time(self, op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.add(op, time.perf_counter() - t0)
        return out

    def add(self, op: str, seconds: float) -> None:
        self.seconds.setdefault(op, []).append(seconds)

    def count(self, op: str, name: str, value: int) -> None:
        self.counters.setdefault(op, {}).setdefault(name, []).append(int(value))

    def median(self, op: str) -> float:
        return statistics.median(self.seconds[op])

    def counter(self, op: str, name: str) -> int | None:
        values = self.counters.get(op, {}).get(name)
        return int(statistics.median(values)) if values else None

    def as_json(self) -> dict[str, Any]:
        ops: dict[str, Any] = {}
        for op in dict.fromkeys([*self.seconds, *self.counters]):
            entry: dict[str, Any] = {}
            if op in self.seconds:
                xs = self.seconds[op]
                entry.update(
                    median_s=statistics.median(xs), min_s=min(xs), max_s=max(xs), samples_s=xs
                )
            for name, values in self.counters.get(op, {}).items():
                entry[name] = int(statistics.median(values))
                entry[name + "_samples"] = values
            ops[op] = entry
        return ops


def human_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    right = [i > 0 for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        cols = zip(cells, widths, right, strict=True)
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in cols]
        return "| " + " | ".join(padded) + " |"

    dashes = [("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right)]
    sep = "|" + "|".join(dashes) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def write_json(path: str, payload: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False)
        fh.write("\n")
    os.replace(tmp, path)


# -- multi-rank benchmarks (dist_take.py) -----------------------------------------


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict[str, Any]:
    """Run ``worker(rank, world, out, *args)`` on ``world`` CPU processes; rank 0's result.

    Each rank calls :func:`join_group` first and :func:`finish_rank` last. The
    index and lease state go to the scratch folder, removed afterwards.
    """
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="casnap-dist-bench-")
    os.environ.setdefault("CASNAP_INDEX_DIR", os.path.join(tmp, "index"))
    os.environ.setdefault("CASNAP_STATE_DIR", os.path.join(tmp, "state"))
    try:
        mp.spawn(worker, args=(world, tmp, *args), nprocs=world)
        with open(os.path.join(tmp, "result.json"), encoding="utf-8") as fh:
            result: dict[str, Any] = json.load(fh)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def join_group(rank: int, world: int, out: str) -> None:
    """Initialise the gloo group of one benchmark rank (file rendezvous in ``out``)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out, 'init')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )


def finish_rank(rank: int, out: str, result: dict[str, Any]) -> None:
    """Rank 0 writes ``result`` for :func:`spawn_ranks`; every rank exits at once."""
    import torch.distributed as dist

    if rank == 0:
        with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    dist.barrier()
    # Exit without tearing gloo down: a teardown race has been seen to hang one rank.
    os._exit(0)


def proc_io() -> dict[str, int]:
    """This process's I/O counters (Linux /proc/self/io: rchar, wchar, write_bytes...)."""
    with open("/proc/self/io", encoding="ascii") as fh:
        return {k.strip(): int(v) for k, v in (line.split(":") for line in fh)}


def manifest_file(root: str, snap: Any) -> str | None:
    """The file of ``snap``'s manifest in the local repository at ``root``, if there."""
    h = snap.manifest_hash  # layout of docs/format.md: .casnap/manifests/<h[:2]>/<h>
    path = os.path.join(root, ".casnap", "manifests", h[:2], h)
    return path if os.path.exists(path) else None


def comma_list(value: str, allowed: tuple[str, ...] | list[str]) -> list[str]:
    """A comma-separated argument as a list, each item one of ``allowed``."""
    import argparse

    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items
