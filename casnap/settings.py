"""Defaults, overridable by ``CASNAP_*`` environment variables.

Settings are read when an operation starts and passed down explicitly; no
module keeps mutable global configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from casnap.errors import CasnapError

MiB = 1 << 20

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


def io_workers_for(local: bool) -> int:
    """Concurrent store requests for a local or a remote store (``CASNAP_IO_WORKERS`` wins)."""
    return _env_int("CASNAP_IO_WORKERS", DEFAULT_IO_WORKERS if local else DEFAULT_REMOTE_IO_WORKERS)


def read_workers_for(local: bool) -> int:
    """Concurrent reads of a restore or read_object (``CASNAP_IO_WORKERS`` wins)."""
    default = DEFAULT_READ_WORKERS if local else DEFAULT_REMOTE_IO_WORKERS
    return _env_int("CASNAP_IO_WORKERS", default)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise CasnapError(f"{name}={raw!r} is not an integer") from exc
    if value < 0:
        raise CasnapError(f"{name}={raw!r} must not be negative")
    return value


def staging_cache_bytes() -> int | None:
    """``CASNAP_STAGING_CACHE``: idle async-staging buffers kept for the next take (None: unset)."""
    raw = os.environ.get("CASNAP_STAGING_CACHE")
    if raw is None or raw == "":
        return None
    return _env_int("CASNAP_STAGING_CACHE", 0)


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name) or default


def default_memory_budget() -> int:
    """A quarter of the memory available now, at least 64 MiB (``CASNAP_MEMORY_BUDGET``)."""
    available = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        available = 0
    fallback = max(64 * MiB, available // 4) if available else 1024 * MiB
    return _env_int("CASNAP_MEMORY_BUDGET", fallback)


@dataclass(frozen=True)
class Settings:
    """Tunables of a take or restore. ``Settings.from_env()`` gives the defaults."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_threshold: int = DEFAULT_PACK_THRESHOLD
    pack_target: int = DEFAULT_PACK_TARGET
    compression: str = "auto"  # "auto" (zstd where it pays) or "none"
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    io_workers: int = DEFAULT_IO_WORKERS

    @classmethod
    def from_env(cls) -> Settings:
        s = cls(
            chunk_size=_env_int("CASNAP_CHUNK_SIZE", DEFAULT_CHUNK_SIZE),
            pack_threshold=_env_int("CASNAP_PACK_THRESHOLD", DEFAULT_PACK_THRESHOLD),
            pack_target=_env_int("CASNAP_PACK_TARGET", DEFAULT_PACK_TARGET),
            compression=_env_str("CASNAP_COMPRESSION", "auto"),
            zstd_level=_env_int("CASNAP_ZSTD_LEVEL", DEFAULT_ZSTD_LEVEL),
            io_workers=_env_int("CASNAP_IO_WORKERS", DEFAULT_IO_WORKERS),
        )
        s.validate()
        return s

    def with_overrides(self, **kwargs: object) -> Settings:
        s = replace(self, **kwargs)  # type: ignore[arg-type]
        s.validate()
        return s

    @property
    def pack_limit(self) -> int:
        """Chunks below this many bytes are packed (never more than a quarter chunk)."""
        return min(self.pack_threshold, self.chunk_size // 4)

    def validate(self) -> None:
        if self.chunk_size < 4096 or self.chunk_size > 1 << 30:
            raise CasnapError(f"chunk_size {self.chunk_size} must be in [4 KiB, 1 GiB]")
        if self.compression not in ("auto", "none"):
            raise CasnapError(f"compression {self.compression!r} must be 'auto' or 'none'")
        if self.io_workers < 1:
            raise CasnapError("io_workers must be at least 1")
