"""The one error hierarchy of casnap.

Every error casnap raises derives from :class:`CasnapError`; each subclass also
derives from the builtin exception it means, so ``except FileNotFoundError``
keeps working for code that does not know casnap.

Reach them here: ``from casnap.errors import CopyIntegrityError``. The few a
user catches every day are also at the top level (``casnap.SnapshotNotFoundError``;
docs/architecture.md, "Public API").
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any


class CasnapError(Exception):
    """Root of every error raised by casnap."""


class StoreError(CasnapError, OSError):
    """An object store operation failed (I/O, network, permissions).

    ``transient`` says whether repeating the same call may succeed (a timeout,
    a dropped connection, a throttled or failing server) rather than fail the
    same way (a permission, a full disk); the retry wrapper retries only those.
    """

    def __init__(self, message: str, key: str | None = None, *, transient: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.transient = transient


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """An object that should exist in the store does not."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-only write found the object already present."""


class ObjectChangedError(StoreError, FileExistsError):
    """A conditional replace found the object other than expected: another writer
    replaced, created or deleted it since it was read (``ObjectStore.replace``).
    Never transient: repeating the same replace meets the same object."""


class ConditionalReplaceUnsupportedError(StoreError, NotImplementedError):
    """The backend cannot replace an object conditionally (``ObjectStore.replace``);
    ``Capabilities.conditional_replace`` says which backends can."""


class RepositoryError(CasnapError):
    """The repository is missing, malformed or of an unsupported version."""


class RepositoryNotFoundError(RepositoryError, FileNotFoundError):
    """No repository exists where one was expected."""


class UnsupportedFormatError(RepositoryError, ValueError):
    """A config, manifest or chunk uses a format version this reader refuses."""


class SnapshotNotFoundError(CasnapError, FileNotFoundError):
    """No snapshot of that name exists."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class SnapshotExistsError(CasnapError, FileExistsError):
    """The snapshot name is already taken; snapshots are immutable."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class SnapshotChangedError(SnapshotExistsError):
    """A snapshot name was moved by another writer between reading and replacing it
    (a re-save to the same name); the replace was not made."""


class CheckpointExistsError(SnapshotExistsError, RuntimeError):
    """A DCP save with ``CasnapWriter(overwrite=False)`` found its checkpoint id taken.

    Also a ``RuntimeError`` whose message starts with the words of DCP's own
    ``FileSystemWriter`` (``"Checkpoint already exists and
    self.overwrite=False."``), so code written for DCP's refusal matches it.
    """


class IntegrityError(CasnapError, ValueError):
    """Stored bytes do not match their hash, or an object is malformed."""

    def __init__(self, message: str, object_name: str | None = None) -> None:
        super().__init__(message)
        self.object_name = object_name


class CopyIntegrityError(IntegrityError):
    """A copy left snapshots out: an object they need is damaged or missing at the source.

    ``failed`` maps each such snapshot to why; the other snapshots were copied,
    and ``result`` (a :class:`casnap.ops.copy.CopyResult`) says what was sent.
    """

    def __init__(
        self, message: str, failed: dict[str, str] | None = None, result: object = None
    ) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})
        self.result = result


class DeltaBaseError(IntegrityError):
    """A delta chunk cannot be rebuilt because its base cannot be read (missing or
    damaged: the message names it) or was not given; the delta's own frame is not
    known to be damaged, so it is never recorded as such (docs/format.md, "Delta chunks")."""


class ManifestValidationError(IntegrityError):
    """A manifest failed validation (untrusted input is checked before use)."""


class ObjectRefusedError(StoreError, IntegrityError):
    """The store holds something at ``key`` that casnap will not read.

    Not a regular file (a FIFO, a device, a socket, a symbolic link), or larger
    than the limit for what the key should hold (``docs/format.md``). Both a
    :class:`StoreError` (never transient: repeating the read refuses it again)
    and an :class:`IntegrityError` (the repository is damaged or tampered with).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message, key)

    @property
    def object_name(self) -> str | None:
        return self.key  # one name, kept right when a PrefixStore rewrites the key

    @object_name.setter
    def object_name(self, value: str | None) -> None:
        pass  # IntegrityError.__init__ sets it; the key is the name


class InvalidNameError(CasnapError, ValueError):
    """A snapshot, ref or object name that is malformed or could leave the repository."""


class StateError(CasnapError):
    """A problem with the application state being taken or restored."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class UnsupportedValueError(StateError, TypeError):
    """A value in the state cannot be stored (or only with pickling allowed)."""


class ObjectLoadError(StateError, pickle.UnpicklingError):
    """A pickled entry's verified bytes cannot be unpickled here (for example its
    class no longer exists). Not damage: the stored bytes match their hash, so
    another snapshot of the same state would fail the same way. A restore that
    raises it has modified nothing."""


class PickleNotAllowedError(StateError, TypeError):
    """An entry needs pickle to store or load and the caller did not opt in.

    A ``TypeError`` (a value of a type that cannot go through without the
    opt-in), not an ``OSError``: nothing about the file system is wrong.
    """


class MissingKeyError(StateError, KeyError):
    """The target expects a key the snapshot does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnexpectedKeyError(StateError, KeyError):
    """The snapshot holds a key the target does not expect."""

    def __str__(self) -> str:
        return str(self.args[0])


class ShapeMismatchError(StateError, ValueError):
    """A stored tensor's shape or dtype differs from the restore target."""


class RetentionError(CasnapError, ValueError):
    """A retention rule or plan that is invalid, or that would delete every snapshot."""


class ArgumentTypeError(CasnapError, TypeError):
    """An argument of a public function has the wrong type (``name``: the argument)."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class ConfigError(CasnapError, ValueError):
    """A setting or argument has a value casnap cannot use (``name``: the variable or argument)."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class LeaseLostError(CasnapError, RuntimeError):
    """A lease (or the gc lock) could not be kept alive; its holder must not commit."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class GcBusyError(CasnapError, TimeoutError):
    """Another gc holds ``.casnap/gc.lock`` and did not release it in time (``holder``)."""

    def __init__(self, message: str, holder: Any = None) -> None:
        super().__init__(message)
        self.holder = holder


class GcBlockedError(CasnapError, TimeoutError):
    """Takes (leases) stayed in flight for longer than gc was willing to wait."""

    def __init__(self, message: str, leases: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.leases = leases


class DistributedTakeError(CasnapError, RuntimeError):
    """A distributed take failed on one or more ranks; no ref was written."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class ReplicaMismatchError(DistributedTakeError, ValueError):
    """Values declared replicated differ between ranks (``mismatches``: key -> rank groups)."""

    def __init__(self, message: str, mismatches: dict[str, list[list[int]]]) -> None:
        ranks = sorted({r for groups in mismatches.values() for g in groups for r in g})
        super().__init__(message, tuple(ranks))
        self.mismatches = mismatches


class CasnapWarning(UserWarning):
    """Root of the warnings casnap emits (filter them with ``warnings.filterwarnings``)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this
    function, name the nearest line outside casnap: the user's call, however deep
    inside casnap the warning is raised (``skip_file_prefixes`` before Python 3.12)."""
    frame = sys._getframe(1)  # the function about to call warnings.warn
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


class ReplicaMismatchWarning(CasnapWarning):
    """Values declared replicated differ between ranks; each rank's own value was kept.

    ``mismatches``: key -> groups of ranks that agree, as :class:`ReplicaMismatchError`'s.
    """

    def __init__(self, message: str, mismatches: dict[str, list[list[int]]]) -> None:
        super().__init__(message)
        self.mismatches = mismatches


class GcRefusedError(CasnapError, RuntimeError):
    """gc cannot tell what is reachable (a root is unreadable), so it deletes nothing."""


class TooLargeError(CasnapError, MemoryError):
    """What a snapshot declares needs more memory than this process can allocate.

    Raised before anything is allocated: ``key`` is the largest entry,
    ``nbytes`` what the read would allocate, ``limit`` what can be allocated.
    """

    def __init__(
        self, message: str, key: str | None = None, nbytes: int = 0, limit: int = 0
    ) -> None:
        super().__init__(message)
        self.key = key
        self.nbytes = nbytes
        self.limit = limit


class OutputSpaceError(CasnapError, OSError):
    """An export's file does not fit: larger than the file system allows or than its free space."""

    def __init__(self, message: str, path: str | None = None, nbytes: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.nbytes = nbytes


# -- argument checks shared by the public entry points -------------------------


def expect_type(value: Any, types: type | tuple[type, ...], name: str, wanted: str) -> Any:
    """``value`` if it is one of ``types`` (a bool is not an int here), else ArgumentTypeError."""
    ok = isinstance(value, types)
    if ok and isinstance(value, bool):
        ok = bool in (types if isinstance(types, tuple) else (types,))
    if not ok:
        raise ArgumentTypeError(
            f"{name} must be {wanted}, got {type(value).__name__} {value!r:.80}", name
        )
    return value


def as_path(value: Any, name: str = "path") -> str:
    """A path or URL argument as text: a ``str`` or ``os.PathLike``, else ArgumentTypeError."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes) or not isinstance(value, str):
        expect_type(value, str, name, "a path or URL (str or os.PathLike)")
    return str(value)


def as_names(value: Any, name: str) -> list[str] | None:
    """An optional list of strings (a bare string is refused: it is not a list of names)."""
    if value is None:
        return None
    expect_type(value, (list, tuple), name, "a list of strings")
    for item in value:
        expect_type(item, str, f"{name}[...]", "a string")
    return list(value)


class SourceNotFoundError(ObjectNotFoundError):
    """The path given to import does not exist (exit code 3 on the command line)."""


class SourceFormatError(ConfigError):
    """The source is none of the formats import reads, or holds what it refuses to
    read (a pickled object ``weights_only`` loading rejects): exit code 2."""


class DamagedSourceError(IntegrityError):
    """The source is of a known format but truncated or malformed: exit code 4."""


__all__ = [
    "CasnapError",
    "StoreError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "ObjectChangedError",
    "ConditionalReplaceUnsupportedError",
    "RepositoryError",
    "RepositoryNotFoundError",
    "UnsupportedFormatError",
    "SnapshotNotFoundError",
    "SnapshotExistsError",
    "SnapshotChangedError",
    "CheckpointExistsError",
    "IntegrityError",
    "CopyIntegrityError",
    "DeltaBaseError",
    "ManifestValidationError",
    "ObjectRefusedError",
    "InvalidNameError",
    "StateError",
    "UnsupportedValueError",
    "ObjectLoadError",
    "PickleNotAllowedError",
    "MissingKeyError",
    "UnexpectedKeyError",
    "ShapeMismatchError",
    "RetentionError",
    "ArgumentTypeError",
    "ConfigError",
    "LeaseLostError",
    "GcBusyError",
    "GcBlockedError",
    "DistributedTakeError",
    "ReplicaMismatchError",
    "CasnapWarning",
    "ReplicaMismatchWarning",
    "GcRefusedError",
    "TooLargeError",
    "OutputSpaceError",
    "SourceNotFoundError",
    "SourceFormatError",
    "DamagedSourceError",
]
