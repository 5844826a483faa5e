"""The local index's storage layer: the entries in an LMDB environment.

Chunk locations and manifest summaries, each value sealed with a short
blake3 check, in one LMDB environment per repository and machine
(:mod:`casnap.index.lmdb_envs` keeps them open per process). :class:`RepoIndex`
is one process's handle on one repository's index; :func:`open_index` checks
the store's gc epoch before chunk entries may be used. The callers' API is
:mod:`casnap.index`; docs/index.md has the protocol.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import blake3
import lmdb

from casnap.errors import ObjectNotFoundError, StoreError
from casnap.format.codec import HEADER_SIZE, MAX_CHUNK_SIZE
from casnap.format.entries import ChunkRef
from casnap.format.manifest_bytes import trusted_chunk_ref
from casnap.format.names import check_hash
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.index import lmdb_envs
from casnap.index.lmdb_envs import Env
from casnap.index.summaries import (
    ManifestSummary,
    SummaryLine,
    decode_line,
    decode_summary,
    encode_line,
    encode_summary,
)
from casnap.repo.repository import RepoStorage
from casnap.settings import index_enabled

_log = logging.getLogger("casnap.index")  # the logger users configure (docs/index.md)

GC_EPOCH_KEY = "gc-epoch"  # below .casnap/; written by gc after a sweep that deleted something

_META_CHUNKS_FOR = b"chunks-for"  # store URL + gc epoch the chunk entries were recorded under
_LINE = b"L"  # a summary's log line is under its manifest's key + this (33 bytes)
_CHECK = 8  # bytes of blake3 that guard every value against a damaged page
_LOOSE = struct.Struct("<QQ")  # raw size, frame length
_PACKED = struct.Struct("<QQQ32s")  # raw size, frame length, offset, pack digest


def enabled() -> bool:
    """Whether takes and history use the index (``CASNAP_INDEX=0`` turns it off)."""
    return index_enabled()


# -- values ------------------------------------------------------------------


def _seal(key: bytes, body: bytes) -> bytes:
    h = blake3.blake3(key)
    h.update(body)
    return body + h.digest(length=_CHECK)


def _unseal(key: bytes, value: bytes) -> bytes | None:
    body = value[:-_CHECK]
    h = blake3.blake3(key)
    h.update(body)
    return body if len(value) > _CHECK and h.digest(length=_CHECK) == value[-_CHECK:] else None


def _encode_chunk(ref: ChunkRef) -> bytes:
    if ref.pack is None:
        return _LOOSE.pack(ref.size, ref.length)
    return _PACKED.pack(ref.size, ref.length, ref.offset, bytes.fromhex(ref.pack))


def _decode_chunk(h: str, body: bytes) -> ChunkRef:
    """The location sealed under ``h``; ValueError (a miss) when it breaks ChunkRef's rules.

    Built without pydantic's validation (20,000 lookups of a re-take spent
    more in it than in LMDB), so the rules that concern a location are
    checked here: a frame no longer than its header plus the raw bytes, no
    larger chunk than a chunk can be. The hash and pack id are hex of fixed-size keys.
    """
    if len(body) == _LOOSE.size:
        size, length = _LOOSE.unpack(body)
        pack, offset = None, 0
    else:
        size, length, offset, raw_pack = _PACKED.unpack(body)
        pack = raw_pack.hex()
    if size > MAX_CHUNK_SIZE or not HEADER_SIZE <= length <= HEADER_SIZE + size:
        raise ValueError(f"index entry of chunk {h} is not a location")
    return trusted_chunk_ref(h, size, pack, offset, length)


def _store_identity(repo: RepoStorage) -> str:
    url = repo.url.removeprefix("file://")
    return url if "://" in url else os.path.realpath(url)


def read_epoch_bytes(repo: RepoStorage) -> bytes | None:
    """The store's gc epoch object as bytes (None when no gc ever deleted anything)."""
    try:
        return repo.store.get(GC_EPOCH_KEY, limit=MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        return None


class RepoIndex:
    """The index of one repository, as seen by this process.

    Chunk methods work only on an index opened with the gc epoch checked
    (``open_index(repo)``); summaries work on any.
    """

    def __init__(self, env: Env, chunks_for: bytes | None) -> None:
        self._env = env
        self._chunks_for = chunks_for
        env.users.add(self)

    @property
    def path(self) -> Path:
        return self._env.path

    def _failed(self, what: str, exc: Exception) -> None:
        """Carry on without the index this time (see :func:`casnap.index.lmdb_envs.failed`)."""
        lmdb_envs.failed(self._env, what, exc)

    def _still_ours(self, txn: lmdb.Transaction) -> bool:
        """Whether the chunk entries are still those of the store and epoch this handle
        checked. Another process (or handle) opening the index for another copy of the
        repository (``cp -r``: the same repo id, another URL) drops them and records
        its own, which name objects only that copy holds: a take must not see those."""
        return bool(txn.get(_META_CHUNKS_FOR, db=self._env.meta) == self._chunks_for)

    def lookup_chunk(self, h: str, size: int) -> ChunkRef | None:
        """Where chunk ``h`` of ``size`` raw bytes is stored, if the index knows it."""
        if self._chunks_for is None or not self._env.usable:
            return None
        key = bytes.fromhex(h)
        try:
            with self._env.begin(db=self._env.chunks, buffers=False) as txn:
                value = txn.get(key) if self._still_ours(txn) else None
            if value is None:
                return None
            body = _unseal(key, value)
            ref = _decode_chunk(h, body) if body is not None else None
        except lmdb.Error as exc:
            self._failed("read", exc)
            return None
        except (ValueError, struct.error):
            return None  # a damaged entry is a miss, never a location
        return ref if ref is not None and ref.size == size else None

    def lookup_chunks(self, wanted: Sequence[tuple[str, int]]) -> list[ChunkRef | None]:
        """:meth:`lookup_chunk` of each ``(hash, size)``, in one read transaction."""
        out: list[ChunkRef | None] = [None] * len(wanted)
        if self._chunks_for is None or not self._env.usable or not wanted:
            return out
        try:
            with self._env.begin(db=self._env.chunks, buffers=False) as txn:
                if not self._still_ours(txn):
                    return out
                for i, (h, size) in enumerate(wanted):
                    key = bytes.fromhex(h)
                    value = txn.get(key)
                    if value is None:
                        continue
                    try:
                        body = _unseal(key, value)
                        ref = _decode_chunk(h, body) if body is not None else None
                    except (ValueError, struct.error):
                        continue  # a damaged entry is a miss, never a location
                    if ref is not None and ref.size == size:
                        out[i] = ref
        except lmdb.Error as exc:
            self._failed("read", exc)
            return [None] * len(wanted)
        return out

    def record_chunks(self, refs: Iterable[ChunkRef]) -> int:
        """Record chunks known to exist now; refused if a gc happened since ``open_index``."""
        if self._chunks_for is None or not self._env.usable:
            return 0
        items = list(refs)  # encoded one at a time: no (key, body) pair kept per chunk
        if not items:
            return 0
        e = self._env
        try:
            with e.begin(write=True) as txn:
                if txn.get(_META_CHUNKS_FOR, db=e.meta) != self._chunks_for:
                    return 0  # a gc ran since this take looked: these facts may be old
                for r in items:
                    key = bytes.fromhex(r.hash)
                    txn.put(key, _seal(key, _encode_chunk(r)), db=e.chunks)
        except lmdb.MapFullError:
            self._evict()
            return 0
        except lmdb.Error as exc:
            self._failed("record chunks", exc)
            return 0
        return len(items)

    def forget_chunks(self, hashes: Iterable[str]) -> int:
        """Drop the entries of ``hashes`` (a read found their stored copy damaged).

        Works on any handle, epoch checked or not: forgetting is always safe,
        a take then probes or writes the chunk again (docs/damage.md).
        """
        if not self._env.usable:
            return 0
        keys = [bytes.fromhex(h) for h in hashes]
        forgotten = 0
        try:
            with self._env.begin(write=True, db=self._env.chunks) as txn:
                for key in keys:
                    forgotten += bool(txn.delete(key))
        except lmdb.Error as exc:
            self._failed("forget chunks", exc)
            return 0
        return forgotten

    def summary(self, manifest_hash: str) -> ManifestSummary | None:
        if not self._env.usable:
            return None
        key = bytes.fromhex(check_hash(manifest_hash, "manifest name"))
        try:
            with self._env.begin(db=self._env.manifests) as txn:
                value = txn.get(key)
            body = _unseal(key, value) if value is not None else None
            return decode_summary(manifest_hash, body) if body is not None else None
        except lmdb.Error as exc:
            self._failed("read", exc)
        except (ValueError, KeyError, TypeError, struct.error):
            pass  # a damaged entry is a miss
        return None

    def lines(self, hashes: Iterable[str]) -> dict[str, SummaryLine]:
        """The log lines of ``hashes`` the index holds, in one read transaction."""
        out: dict[str, SummaryLine] = {}
        if not self._env.usable:
            return out
        try:
            with self._env.begin(db=self._env.manifests) as txn:
                for h in hashes:
                    key = bytes.fromhex(check_hash(h, "manifest name")) + _LINE
                    value = txn.get(key)
                    body = _unseal(key, value) if value is not None else None
                    try:
                        if body is not None:
                            out[h] = decode_line(h, body)
                    except (ValueError, KeyError, TypeError, struct.error):
                        pass  # a damaged entry is a miss
        except lmdb.Error as exc:
            self._failed("read", exc)
        return out

    def record_summaries(
        self, summaries: Iterable[ManifestSummary], lines: Iterable[SummaryLine] = ()
    ) -> None:
        if not self._env.usable:
            return
        items = [(bytes.fromhex(s.manifest), encode_summary(s)) for s in summaries]
        items += [(bytes.fromhex(x.manifest) + _LINE, encode_line(x)) for x in lines]
        try:
            with self._env.begin(write=True, db=self._env.manifests) as txn:
                for key, body in items:
                    txn.put(key, _seal(key, body))
        except lmdb.MapFullError:
            self._evict()
        except lmdb.Error as exc:
            self._failed("record summaries", exc)

    def _evict(self) -> None:
        """The map is full: a cache may forget everything (CASNAP_INDEX_MAP_SIZE raises it)."""
        _log.warning("casnap index at %s is full; clearing it", self._env.path)
        e = self._env
        try:
            with e.begin(write=True) as txn:
                txn.drop(e.chunks, delete=False)
                txn.drop(e.manifests, delete=False)
        except lmdb.Error as exc:
            self._failed("clear", exc)


def open_index(repo: RepoStorage, *, chunks: bool = True) -> RepoIndex | None:
    """The index of ``repo``, or None when disabled or unusable (never an error).

    With ``chunks=True`` (what a take uses) the store's gc epoch is read first
    (one small get) and chunk entries recorded under another epoch or URL are
    dropped, so chunk lookups only return entries no gc may have invalidated.
    A take must call this inside its gc-exclusion window (docs/index.md).
    """
    if not enabled():
        return None
    index = lmdb_envs.acquire(repo.config.repo_id, lambda env: RepoIndex(env, None))
    if index is None or not chunks:
        return index
    env = index._env
    try:
        epoch = read_epoch_bytes(repo)
    except StoreError:
        return index  # cannot tell what gc did: no chunk facts this time
    marker = b"-" if epoch is None else blake3.blake3(epoch).hexdigest().encode()
    chunks_for = _store_identity(repo).encode() + b"\n" + marker
    try:
        with env.begin(db=env.meta) as txn:
            current = txn.get(_META_CHUNKS_FOR)
        if current != chunks_for:
            with env.begin(write=True) as txn:
                if txn.get(_META_CHUNKS_FOR, db=env.meta) != chunks_for:
                    txn.drop(env.chunks, delete=False)
                    txn.put(_META_CHUNKS_FOR, chunks_for, db=env.meta)
    except lmdb.Error as exc:
        index._failed("check the gc epoch", exc)
        return None
    index._chunks_for = chunks_for
    return index
