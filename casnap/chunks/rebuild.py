"""Rebuilding a delta chunk from its chain with one digest check (docs/chunking.md).

A delta's chain ends in a whole frame; each link XORs its runs into the
bytes below it (:mod:`casnap.format.delta`). :func:`rebuild` decodes the
whole frame without its own check, applies every delta in place and checks
only the result's digest: a sparse chain costs about what reading the whole
chunk does. Any failure is an answer (None), never an error: the careful
path, :func:`casnap.chunks.decode.decode_frame`, then decodes link by link
and names the copy at fault.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from casnap.chunks.stored import contain, fetch_frame
from casnap.errors import CasnapError, ObjectRefusedError
from casnap.format import codec
from casnap.format.delta import DeltaRuns, delta_runs
from casnap.format.entries import ChunkRef
from casnap.format.names import digest_of
from casnap.repo.reach import object_key
from casnap.repo.repository import RepoStorage

Buffer = codec.Buffer


def delta_frame(
    raw: Buffer, link: ChunkRef
) -> tuple[str, codec.FrameHeader, memoryview, bytes] | None:
    """``raw``'s key, header, payload and base digest if it is the delta frame ``link``
    names, else None."""
    key = object_key(link)
    hdr = codec.parse_header(raw, key)
    if hdr.codec != codec.CODEC_DELTA or hdr.frame_length != len(raw):
        return None
    if hdr.digest.hex() != link.hash or hdr.raw_length != link.size or link.base is None:
        return None
    return key, hdr, memoryview(raw)[codec.HEADER_SIZE :], bytes.fromhex(link.base.hash)


def link_runs(raw: Buffer, link: ChunkRef) -> DeltaRuns | None:
    """The checked runs of delta frame ``raw`` of ``link``; None if the frame is not that delta."""
    frame = delta_frame(raw, link)
    if frame is None:
        return None
    key, hdr, payload, base_digest = frame
    return delta_runs(hdr, payload, key, base_digest)


def apply_link(raw: Buffer, link: ChunkRef, out: Any) -> bool:
    """XOR delta frame ``raw`` of ``link`` into ``out``; False if the frame is not that delta."""
    runs = link_runs(raw, link)
    if runs is None:
        return False
    runs.xor_into(out)
    return True


def rebuild(repo: RepoStorage, ref: ChunkRef, frame: Buffer) -> Buffer | None:
    """The delta ``ref`` rebuilt with one digest check, of the result; None if anything fails.

    The whole frame at the chain's end is decoded without its own check and
    every delta is XORed into it in place: a sparse chain costs about what
    reading the whole chunk does. The result's digest covers every link
    (a damaged one yields other bytes), so the careful path is only needed
    to say which link failed.
    """
    chain = ref.chain()
    try:
        frames = [frame, *fetch_chain(repo, chain[1:])]
        whole = chain[-1]
        out = bytearray(
            codec.decode(
                frames[-1],
                object_key(whole),
                bytes.fromhex(whole.hash),
                whole.size,
                check_digest=False,
            )
        )
        for link, raw in zip(reversed(chain[:-1]), reversed(frames[:-1]), strict=True):
            if not apply_link(raw, link, out):
                return None
    except (CasnapError, ValueError):
        return None
    return out if digest_of(out).hex() == ref.hash else None


def fetch_chain(repo: RepoStorage, chain: list[ChunkRef]) -> list[Buffer]:
    """Every frame of ``chain``, concurrently where each request waits on a network."""

    def one(ref: ChunkRef) -> Buffer:
        try:
            return fetch_frame(repo, ref)
        except ObjectRefusedError as exc:  # a FIFO, a link: damage to that copy
            contain(repo, ref, exc)
            raise

    if len(chain) <= 1 or repo.root.capabilities.local:  # local: a page-cache copy each
        return [one(ref) for ref in chain]
    with ThreadPoolExecutor(len(chain), thread_name_prefix="casnap-chain") as pool:
        return list(pool.map(one, chain))
