"""Helpers shared by the tests: where a repository keeps an object, and damaging it."""

from __future__ import annotations

from pathlib import Path


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
