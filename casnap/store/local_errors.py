"""A local store's OS errors as the store contract's errors (:mod:`casnap.store.local`)."""

from __future__ import annotations

import errno
import os
import stat

from casnap.errors import ObjectExistsError, ObjectNotFoundError, ObjectRefusedError, StoreError

# A key whose path runs into a file, or names a folder, is simply not an object.
NOT_AN_OBJECT = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
# Errors a repeat of the same call may not meet (an interrupted call, a busy
# or timed-out network file system); a full disk or a permission is permanent.
TRANSIENT = (errno.EINTR, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE)


def refused(key: str, mode: int) -> ObjectRefusedError:
    if stat.S_ISLNK(mode):
        what = "a symbolic link"
    elif stat.S_ISFIFO(mode):
        what = "a FIFO"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        what = "a device"
    elif stat.S_ISSOCK(mode):
        what = "a socket"
    else:
        what = "a special file"
    return ObjectRefusedError(
        f"object {key!r} is {what}, not a regular file; casnap reads only regular files", key
    )


def refuse_special(path: str, key: str, exc: OSError) -> None:
    """Raise ObjectRefusedError if ``open`` failed because ``path`` is not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise refused(key, mode) from exc


def walk_error(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):  # a folder removed while listing is fine
        raise exc


def translate(exc: OSError, key: str, *, writing: bool = False) -> StoreError:
    if exc.errno in NOT_AN_OBJECT and not writing:
        return ObjectNotFoundError(f"object {key!r} not found", key)
    if isinstance(exc, FileExistsError):
        return ObjectExistsError(f"object {key!r} already exists", key)
    if exc.errno == errno.ENOSPC:
        return StoreError(f"no space left on device while writing {key!r}", key)
    return StoreError(f"{exc.strerror or exc} ({key!r})", key, transient=exc.errno in TRANSIENT)
