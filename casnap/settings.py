"""Every tunable of casnap in one table, read one way (docs/settings.md).

Each setting has a name (``chunk_size``), an environment variable
(``CASNAP_CHUNK_SIZE``), a kind, a default and bounds (``VARIABLES``). A value
comes from, highest first: an active ``override(...)`` block (scoped to the
current thread and the tasks it starts, a ``ContextVar``), the environment
variable, the default. A value that cannot be used raises ``ConfigError``
naming the variable; nothing is silently ignored. Operations read settings
when they start and pass them down; background work casnap starts for a call
runs in a copy of the caller's context::

    with casnap.settings.override(chunk_size="1MiB", memory_budget="2GiB"):
        Snapshot.take(path, app_state)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from casnap.errors import ConfigError, expect_type
from casnap.settings_kinds import Variable

MiB = 1 << 20
GiB = 1 << 30

# Chosen by benchmarks/chunk_size.py; see docs/chunking.md.
DEFAULT_CHUNK_SIZE = 4 * MiB
# Chunks smaller than this are packed with others into one pack object.
DEFAULT_PACK_THRESHOLD = 512 * 1024
# A pack is closed once its frames reach this size.
DEFAULT_PACK_TARGET = 4 * MiB
DEFAULT_ZSTD_LEVEL = 1
DEFAULT_IO_WORKERS = 4
# Cold reads from a local disk gain from a deeper queue than writes do: a cold
# 1 GiB restore (virtio disk, 2 cores) took 1.32 s with 4 readers, 1.29 s with
# 8 and 1.18 s with 12, torch.load 1.32 s (benchmarks/read_workers.py).
DEFAULT_READ_WORKERS = 12
# Object stores answer each request with latency, not bandwidth: keep many in flight.
DEFAULT_REMOTE_IO_WORKERS = 16
DEFAULT_LEASE_TTL = 120.0
# The longest lease TTL: readers bound every lease and gc lock by it
# (casnap/repo/lease_record.py), so no record can hold others up for longer.
MAX_LEASE_TTL = 1800.0
DEFAULT_DIST_TIMEOUT = 600.0
DEFAULT_INDEX_MAP_SIZE = 4 * GiB


def _table(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


VARIABLES: Mapping[str, Variable] = _table(
    Variable(
        "chunk_size",
        "size",
        None,
        "Bytes per chunk of a new take. Unset: the repository's "
        "own chunk size (4 MiB for a new one).",
        minimum=4096,
        maximum=GiB,
    ),
    Variable(
        "pack_threshold",
        "size",
        DEFAULT_PACK_THRESHOLD,
        "Chunks smaller than this (and "
        "than a quarter chunk) are packed with others into one object.",
        minimum=0,
    ),
    Variable(
        "pack_target",
        "size",
        DEFAULT_PACK_TARGET,
        "A pack object is closed once it holds this many bytes.",
        minimum=1,
    ),
    Variable(
        "compression",
        "choice",
        "auto",
        "auto: zstd where it pays; none: store raw.",
        choices=("auto", "none"),
    ),
    Variable(
        "zstd_level",
        "int",
        DEFAULT_ZSTD_LEVEL,
        "zstd level of compressed chunks.",
        minimum=-7,
        maximum=22,
    ),
    Variable(
        "delta",
        "bool",
        True,
        "Whether a take may store a changed chunk as a delta against the whole chunk "
        "a read of the same chunk of its parent snapshot decodes, where that pays "
        '(docs/format.md, "Delta chunks").',
    ),
    Variable(
        "auto_parent",
        "bool",
        True,
        "Whether a take given no parent, outside a session's lineage, descends from "
        'the newest snapshot committed in its folder (docs/repository.md, "Parents").',
    ),
    Variable(
        "io_workers",
        "int",
        None,
        "Concurrent store requests of a take, restore or "
        "export. Unset: 4 writers and 12 readers on a local disk, 16 on a remote store.",
        minimum=1,
        maximum=1024,
    ),
    Variable(
        "memory_budget",
        "size",
        None,
        "Bytes of host memory a take, restore or "
        "export may hold. Unset: a quarter of available memory, at least 64 MiB.",
        minimum=1,
    ),
    Variable(
        "staging_cache",
        "size",
        None,
        "Idle async-staging buffers a Session keeps for the next take (takes without a "
        "session: the process, read at every take). Unset: the memory budget.",
        minimum=0,
    ),
    Variable(
        "replica_mismatch",
        "choice",
        "warn",
        "What a distributed take does when "
        "values declared replicated differ between ranks. warn: keep each rank's own "
        "value and warn (docs/distributed.md); error: fail the take on every rank.",
        choices=("warn", "error"),
    ),
    Variable(
        "lease_ttl",
        "float",
        DEFAULT_LEASE_TTL,
        "Seconds a take's lease (and gc's lock) lives without renewal.",
        minimum=0.001,
        maximum=MAX_LEASE_TTL,
    ),
    Variable(
        "dist_timeout",
        "float",
        DEFAULT_DIST_TIMEOUT,
        "Seconds a rank of a distributed take waits for the others before the take fails.",
        minimum=0.001,
        maximum=7 * 86400,
    ),
    Variable(
        "store_retries",
        "int",
        4,
        "Times a remote store request that failed transiently "
        "(timeout, dropped connection, HTTP 429/5xx) is repeated before the error is "
        "raised.",
        minimum=0,
        maximum=100,
    ),
    Variable(
        "store_retry_delay",
        "float",
        0.2,
        "Seconds: the longest wait before the first "
        "retry, doubled for each further retry (at most 10 s), with random jitter.",
        minimum=0,
        maximum=600,
    ),
    Variable(
        "remote_timeout",
        "float",
        20.0,
        "Seconds the command line waits for a remote "
        "store's first answer (opening the repository) before it gives up with one "
        "line naming the URL; 0 waits as long as the store's own retries take.",
        minimum=0,
        maximum=7 * 86400,
    ),
    Variable("index", "bool", True, "Whether takes and history use the local LMDB index."),
    Variable(
        "index_dir", "path", None, "Where the local index lives. Unset: ~/.cache/casnap/index."
    ),
    Variable(
        "index_map_size",
        "size",
        DEFAULT_INDEX_MAP_SIZE,
        "LMDB map size of the index (address space, not disk).",
        minimum=MiB,
    ),
    Variable(
        "state_dir",
        "path",
        None,
        "Where the CLI remembers state between runs (the "
        "part of `verify --part` to check next). Unset: ~/.cache/casnap.",
    ),
)

# What override() blocks set, per thread and task; a ContextVar, not process-wide state.
_OVERRIDES: ContextVar[Mapping[str, Any]] = ContextVar("casnap_settings_overrides")


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        known = ", ".join(VARIABLES)
        raise ConfigError(f"unknown setting {name!r}; known: {known}", name) from None


def is_set(name: str) -> bool:
    """Whether ``name`` has a value from an override or its environment variable."""
    var = _variable(name)
    return name in _OVERRIDES.get({}) or bool(os.environ.get(var.env, "").strip())


def get(name: str, default: Any = None) -> Any:
    """The value of setting ``name``: override, else environment, else ``default``/the table's.

    ``default`` is for settings whose fallback is computed by the caller (the
    table's default is None for those).
    """
    var = _variable(name)
    overrides = _OVERRIDES.get({})
    if name in overrides:
        return overrides[name]
    raw = os.environ.get(var.env, "")
    if raw.strip():
        return var.parse(raw, "env")
    return var.default if default is None else default


@contextmanager
def override(**values: Any) -> Iterator[None]:
    """Use these values inside the block (this thread and what it starts); restore them after.

    Values are checked like environment variables (``ConfigError`` names the
    bad one); ``None`` removes an override made by an outer block.
    """
    current = dict(_OVERRIDES.get({}))
    for name, raw in values.items():
        var = _variable(name)
        if raw is None:
            current.pop(name, None)
        else:
            current[name] = var.parse(raw, "override")
    token = _OVERRIDES.set(current)
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


# -- derived values ----------------------------------------------------------


def io_workers_for(local: bool) -> int:
    """Concurrent store requests of a take on a local or a remote store."""
    return int(get("io_workers", DEFAULT_IO_WORKERS if local else DEFAULT_REMOTE_IO_WORKERS))


def read_workers_for(local: bool) -> int:
    """Concurrent reads of a restore or read_object."""
    return int(get("io_workers", DEFAULT_READ_WORKERS if local else DEFAULT_REMOTE_IO_WORKERS))


def staging_cache_bytes() -> int:
    """Idle async-staging buffers kept for the next take: the setting, else the memory budget."""
    value = get("staging_cache")
    return default_memory_budget() if value is None else int(value)


def default_memory_budget() -> int:
    """The memory budget setting, else a quarter of the memory available now (at least 64 MiB)."""
    if is_set("memory_budget"):
        return int(get("memory_budget"))
    available = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        available = 0
    return max(64 * MiB, available // 4) if available else 1024 * MiB


def lease_ttl() -> float:
    """Seconds a lease lives without renewal."""
    return float(get("lease_ttl"))


def dist_timeout() -> float:
    """Seconds any rank waits for the others before failing the take (bounded failure)."""
    return float(get("dist_timeout"))


def index_enabled() -> bool:
    """Whether takes and history use the index."""
    return bool(get("index"))


def index_root() -> Path:
    """The folder that holds one index per repository."""
    return Path(get("index_dir", Path.home() / ".cache" / "casnap" / "index"))


def index_map_size() -> int:
    return int(get("index_map_size"))


def state_dir() -> Path:
    """Where the CLI keeps state between runs."""
    return Path(get("state_dir", Path.home() / ".cache" / "casnap"))


# -- the settings of one take ------------------------------------------------

# The settings one take may override: ``Snapshot.take(..., settings={"chunk_size": ...})``.
TAKE_SETTINGS = (
    "chunk_size",
    "compression",
    "replica_mismatch",
    "delta",
    "auto_parent",
)


def take_overrides(settings: object) -> dict[str, Any]:
    """A take's ``settings`` argument as overrides: a dict of :data:`TAKE_SETTINGS`
    names, else :class:`casnap.ConfigError` (values are checked where applied)."""
    if settings is None:
        return {}
    expect_type(settings, Mapping, "settings", "a dict of take settings or None")
    assert isinstance(settings, Mapping)
    for name in settings:
        if name not in TAKE_SETTINGS:
            raise ConfigError(
                f"unknown take setting {name!r}: a take's settings are "
                f"{', '.join(TAKE_SETTINGS)} (the others are CASNAP_* variables, "
                "docs/settings.md)",
                str(name),
            )
    return dict(settings)


def check_storage_options(options: Mapping[str, Any]) -> None:
    """Refuse, saying where it goes, a key of ``storage_options`` that is casnap's:
    they are the store's options only (fsspec's), as in torchsnapshot and DCP."""
    for key in options:
        if key == "repository" or key in TAKE_SETTINGS:
            use = "repository=..." if key == "repository" else f"settings={{{key!r}: ...}}"
            raise ConfigError(
                f"storage_options are the store's (fsspec) options only; pass {key!r} as {use}",
                key,
            )


@dataclass(frozen=True)
class Settings:
    """Tunables of a take or restore. ``Settings.from_env()`` gives the current values."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_threshold: int = DEFAULT_PACK_THRESHOLD
    pack_target: int = DEFAULT_PACK_TARGET
    compression: str = "auto"  # "auto" (zstd where it pays) or "none"
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    io_workers: int = DEFAULT_IO_WORKERS
    replica_mismatch: str = "warn"  # or "error" (distributed takes; rank 0's value holds)
    delta: bool = True  # changed chunks as deltas against the parent's (docs/format.md)
    auto_parent: bool = True  # no parent given: the newest in the folder (casnap.take.parent)

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            chunk_size=get("chunk_size", DEFAULT_CHUNK_SIZE),
            pack_threshold=get("pack_threshold"),
            pack_target=get("pack_target"),
            compression=get("compression"),
            zstd_level=get("zstd_level"),
            io_workers=get("io_workers", DEFAULT_IO_WORKERS),
            replica_mismatch=get("replica_mismatch"),
            delta=get("delta"),
            auto_parent=get("auto_parent"),
        )

    def with_overrides(self, **kwargs: object) -> Settings:
        """These settings with ``kwargs`` (a take's ``settings``) checked and applied."""
        checked: dict[str, Any] = {}
        for name, raw in kwargs.items():
            if name not in self.__dataclass_fields__:
                raise ConfigError(f"unknown take option {name!r}", name)
            checked[name] = _variable(name).parse(raw, "override")
        return replace(self, **checked)

    @property
    def pack_limit(self) -> int:
        """Chunks below this many bytes are packed (never more than a quarter chunk)."""
        return min(self.pack_threshold, self.chunk_size // 4)
