"""How ranks compare a large replicated chunk without every rank hashing it.

A replicated chunk of at least :data:`CHECKED_MIN` bytes gets a *check id*
instead of a blake3 digest: a keyed blake3 of its place (logical key, chunk
index), its size and its row sums (each :data:`ROW_BYTES`-byte row's 8-byte
words added modulo 2**64, plus the bytes past the last whole row); only its
writer hashes it. What the check detects and what it cannot is in
docs/distributed.md, "How replicas are compared".
"""

from __future__ import annotations

import blake3
import torch

from casnap.torch_io.tensors import byte_view

# Replicated chunks of at least this many bytes are compared by check id (the
# reduction's fixed cost is worth it only on chunks well above a blake3 call's).
CHECKED_MIN = 256 << 10
ROW_BYTES = 512  # bytes per row summed (64 words of 8 bytes)
# Words per reduction call: below torch's grain size (32,768 elements), so each call runs
# on the calling thread. Several ranks share a host's cores; one reduction spread over
# torch's intra-op threads on each of them was 5-20x slower (4 ranks on 2 cores).
_STEP = 32768 - ROW_BYTES // 8
_CONTEXT = "casnap replica check v1: row sums of a replicated chunk"


def check_id(piece: memoryview, place: str) -> bytes | None:
    """The check id of one replicated chunk, or None when it must be hashed (read-only
    or small bytes): see the module docstring. ``place`` names the chunk's position
    (logical key and chunk index) identically on every rank."""
    n = len(piece)
    if n < CHECKED_MIN or piece.readonly:
        return None
    body = n - n % ROW_BYTES
    words = torch.frombuffer(piece[:body], dtype=torch.int64)
    row = ROW_BYTES // 8
    sums = torch.empty(len(words) // row, dtype=torch.int64)
    for at in range(0, len(words), _STEP):  # int64 accumulation wraps modulo 2**64
        torch.sum(
            words[at : at + _STEP].view(-1, row), 1, out=sums[at // row : (at + _STEP) // row]
        )
    h = blake3.blake3(derive_key_context=_CONTEXT)
    h.update(f"{place}\0{n}\0".encode())
    h.update(byte_view(sums))
    h.update(piece[body:])
    return h.digest()
