"""Helpers shared by the tests: where a repository keeps an object, damaging it,
reading what a take or a retention pass recorded (narrowed to what the test established),
and the state the tests take (seeded random tensors, a step's state)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casnap.format.entries import Entry, TensorEntry

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

    from casnap import Snapshot
    from casnap.api.checkpointer import Checkpointer
    from casnap.chunks.frames import WriteStats
    from casnap.gc.reclaim import ReclaimResult
    from casnap.ops.retention import RetentionResult


def meta_dir(repo_url: str | Path) -> Path:
    """The ``.casnap`` folder of the local repository at ``repo_url``."""
    return Path(repo_url) / ".casnap"


def chunk_path(repo_url: str | Path, h: str) -> Path:
    """The file of loose chunk ``h`` (``chunks/<h[:2]>/<h>``)."""
    return meta_dir(repo_url) / "chunks" / h[:2] / h


def pack_path(repo_url: str | Path, pack: str) -> Path:
    """The file of pack ``pack`` (``packs/<p[:2]>/<p>``)."""
    return meta_dir(repo_url) / "packs" / pack[:2] / pack


def flip_byte(path: str | Path, offset: int, mask: int = 0x01) -> None:
    """Damage ``path`` in place (same file, same length): XOR the byte at ``offset``
    with ``mask``."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


def tensor_entry(entries: Mapping[str, Entry], key: str) -> TensorEntry:
    """``entries[key]``, the manifest entry of a tensor stored whole (its chunks)."""
    entry = entries[key]
    assert isinstance(entry, TensorEntry), f"{key} is a {type(entry).__name__}"
    return entry


def take_stats(snap: Snapshot) -> WriteStats:
    """What the last take of ``snap`` wrote (every take sets it)."""
    assert snap.last_take_stats is not None, "no take ran through this Snapshot"
    return snap.last_take_stats


def retention_of(ckpt: Checkpointer) -> RetentionResult:
    """What the last retention pass of ``ckpt`` did (each commit that runs one sets it)."""
    assert ckpt.last_retention is not None, "no retention pass ran"
    return ckpt.last_retention


def reclaimed_of(ckpt: Checkpointer) -> ReclaimResult:
    """What the last retention pass of ``ckpt`` reclaimed (a pass that reclaimed)."""
    reclaimed = retention_of(ckpt).reclaimed
    assert reclaimed is not None, "the last retention pass reclaimed nothing"
    return reclaimed


Shape = int | tuple[int, ...]


def random_tensors(shapes: Mapping[str, Shape], seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 tensors of normal values, one per name of ``shapes`` in its order, drawn
    from one generator seeded with ``seed``: the same call gives the same values in every
    process, and leaves torch's global generator alone."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def numbered_tensors(
    n: int, shape: Shape = 64, *, prefix: str = "p", seed: int = 0
) -> dict[str, torch.Tensor]:
    """``n`` :func:`random_tensors` of one ``shape``, named ``p0``, ``p1``, ... (``prefix``)."""
    return random_tensors({f"{prefix}{i}": shape for i in range(n)}, seed)


def step_state(step: int, numel: int, value: float | None = None) -> dict[str, Any]:
    """A training step's state: ``w``, ``numel`` elements all ``value`` (the step's by
    default), and the ``step``."""
    import torch

    return {"w": torch.full((numel,), float(step) if value is None else value), "step": step}


def smaps_kib(address: int, field: str) -> int:
    """``field`` (``Rss``, ``Anonymous``, ...) in KiB of the mapping of this process
    holding ``address``, from Linux's /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def counted_repo(root: str, chunk_size: int) -> tuple[Any, Any]:
    """A repository at ``root`` (created if needed) on a store that counts every request:
    (the :class:`casnap.Repository`, its :class:`casnap.store.CountingStore`)."""
    from casnap import Repository
    from casnap.store import CountingStore, LocalStore

    store = CountingStore(LocalStore(root))
    return Repository.on_store(store, chunk_size=chunk_size), store


def kill_when_ready(argv: list[str], ready: Path, env: dict[str, str], wait: float = 300) -> None:
    """Run ``argv``; SIGKILL it once it writes ``ready`` (the moment it chose: chunks
    written, a commit not yet). Fails, with the child's stderr, if it ends before."""
    import os
    import signal
    import subprocess
    import time

    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + wait
        while not ready.exists():
            if child.poll() is not None:
                err = child.stderr.read().decode() if child.stderr else ""
                raise AssertionError(f"the child ended before it was ready: {err}")
            assert time.monotonic() < deadline, f"no {ready} within {wait} s"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
        if child.stderr:
            child.stderr.close()
