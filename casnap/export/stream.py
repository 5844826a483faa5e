"""Streaming chunks into an export file under the memory budget, atomically.

The file layout (offsets) is planned before anything is read; then every chunk
is fetched through the verified reader and written at its offset (``pwrite``) as
it arrives, into a temporary file renamed into place only once complete
(docs/export.md, "Memory and failures").
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from casnap.chunks.budget import ByteBudget, check_budget
from casnap.chunks.read import Buffer, read_chunks
from casnap.chunks.target import Consumer
from casnap.errors import OutputSpaceError
from casnap.export.select import ExportItem, ExportSource
from casnap.format.entries import ChunkRef
from casnap.settings import Settings

Progress = Callable[[int, int], None]
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    path: str
    format: Literal["safetensors", "torch"]
    names: tuple[str, ...]  # tensor names in the file, in data order
    tensor_bytes: int  # tensor data written
    file_bytes: int  # size of the file
    fetched_bytes: int  # bytes read from the store (frames, as stored)
    peak_buffer_bytes: int  # most bytes the read budget held at once
    skipped: tuple[str, ...] = ()  # non-tensor keys in the selection, not exported

    @classmethod
    def of(
        cls,
        out_path: PathLike,
        fmt: Literal["safetensors", "torch"],
        items: list[ExportItem],
        read: tuple[int, int],
        file_bytes: int,
        skipped: list[str],
    ) -> ExportResult:
        """The result of writing ``items`` (``read``: the bytes fetched and the budget's peak)."""
        names = tuple(it.name for it in items)
        data = sum(it.entry.nbytes for it in items)
        return cls(os.fspath(out_path), fmt, names, data, file_bytes, *read, tuple(skipped))


# The file system cannot hold the file: too large for it, full, or over quota.
_NO_SPACE = (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)


def check_space(directory: str, size: int, final: str) -> None:
    """Refuse, before writing, an export larger than the free space of ``directory``.

    The sizes come from the manifest (untrusted): a damaged shape must not
    start writing terabytes. Every byte of an export is written, so a file
    larger than the free space cannot succeed.
    """
    try:
        st = os.statvfs(directory)
    except OSError:
        return  # nothing to check against; the write itself will tell
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise OutputSpaceError(
            f"{final}: the export would write {size} bytes, and {directory} has {free} bytes "
            "free; the manifest declares more than fits (is it damaged?)",
            final,
            size,
        )


@contextmanager
def atomic_output(out_path: PathLike, size: int) -> Iterator[int]:
    """A file descriptor of a temporary file of ``size`` bytes that becomes ``out_path`` on
    success only.

    A file that does not fit (larger than the free space, or than the file
    system allows) raises :class:`OutputSpaceError`, leaving no file behind.
    """
    final = os.path.abspath(os.fspath(out_path))
    directory, base = os.path.split(final)
    check_space(directory, size, final)
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.casnap-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    done = False
    try:
        try:
            os.ftruncate(fd, size)
            yield fd
        except (OSError, OverflowError) as exc:
            if isinstance(exc, OutputSpaceError):
                raise
            if isinstance(exc, OSError) and exc.errno not in _NO_SPACE:
                raise
            reason = exc.strerror if isinstance(exc, OSError) else "File too large"
            raise OutputSpaceError(
                f"{final}: cannot write the {size} bytes of this export: {reason}", final, size
            ) from exc
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        done = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            os.unlink(tmp)
    try:  # make the rename durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # not every platform can open or fsync a directory


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def stream(
    snapshot: ExportSource,
    items: list[ExportItem],
    offsets: list[int],
    fd: int,
    memory_budget_bytes: int | None,
    progress: Progress | None,
    with_crc: bool = False,
) -> tuple[int, int, list[int]]:
    """Fetch every chunk of ``items`` and write item ``j``'s bytes at ``offsets[j]``.

    Returns the bytes fetched, the budget's peak and (``with_crc``) each chunk's CRC-32.
    """
    refs: list[ChunkRef] = []
    dest: list[int] = []
    for item, base in zip(items, offsets):
        for c, ref in enumerate(item.entry.chunks):
            refs.append(ref)
            dest.append(base + c * item.entry.chunk_size)
    crcs = [0] * len(refs)
    total = sum(item.entry.nbytes for item in items)
    done = 0
    failures: list[BaseException] = []
    lock = threading.Lock()

    def sink(i: int, data: Buffer) -> None:
        nonlocal done
        if failures:
            return  # the export has failed; let the reader drain
        try:
            pwrite_all(fd, data, dest[i])
            if with_crc:
                crcs[i] = zlib.crc32(data)
            with lock:
                done += len(data)
                if progress is not None:
                    progress(done, total)
        except Exception as exc:  # a full disk, or the progress callback
            with lock:
                failures.append(exc)

    budget = ByteBudget(check_budget(memory_budget_bytes))
    fetched = 0
    if refs:
        workers = Settings.from_env().io_workers
        with ThreadPoolExecutor(workers, thread_name_prefix="casnap-export") as pool:
            fetched = read_chunks(snapshot.repository.storage, refs, Consumer(sink), pool, budget)
    if failures:
        raise failures[0]
    return fetched, budget.peak, crcs
