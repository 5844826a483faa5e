"""The files under one LMDB environment, made safe to map on a full or damaged disk.

LMDB maps two files, and a fault on a map is a signal, not an error: a write
to a hole the filesystem cannot fill (no space) and a read past the end of a
file are both SIGBUS. Everything here runs before LMDB touches either map, so
that those cases surface as an OSError or an lmdb error the caller turns into
"run without the index" (docs/index.md, "Full, read-only or damaged").
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

# The data file is never written through its map (the caller opens without
# writemap: LMDB then writes it with pwrite, which fails with ENOSPC), the lock
# file's blocks are reserved before LMDB maps it, and a data file shorter than
# the database it describes is damage.
MAX_READERS = 126  # LMDB's default, explicit because the lock file's size follows from it
LOCK_BYTES = 8192  # LMDB 0.9's lock file for 126 readers: 192-byte header + 125 x 64-byte slots


class IndexFileTruncated(lmdb.CorruptedError):
    """data.mdb ends before the last page its meta page names: reading it would fault."""


def reserve_lock_file(lock: Path) -> None:
    """Allocate the lock file's blocks now, so that LMDB's writes to its map cannot fault.

    LMDB creates the lock file with ftruncate (a hole) and writes its reader
    table through a shared map; on a full disk the first write to a hole is a
    SIGBUS. An error here (ENOSPC, EROFS, ...) is an OSError instead. The
    size is never changed once the file has one: another process may have it
    mapped at that size. Called only while this process has no environment
    open on the path, since closing the descriptor drops this process's
    fcntl locks on the file.
    """
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        size = max(st.st_size, LOCK_BYTES)
        if st.st_blocks * 512 < size and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def check_data_file(env: lmdb.Environment, data: Path) -> None:
    """Raise IndexFileTruncated if data.mdb is shorter than its database (before any read).

    Only the meta pages have been read yet, and LMDB refuses a file too short
    to hold them. Without writemap the file only grows, and a page is written
    before a meta page names it, so a short file is damage, never a race.
    """
    need = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    size = os.stat(data).st_size
    if size < need:
        raise IndexFileTruncated(f"{data} is {size} bytes, its database needs {need}")
