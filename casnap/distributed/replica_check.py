"""How ranks compare a large replicated chunk without every rank hashing it.

A value declared replicated is held by every rank, and one rank writes it.
Hashing it with blake3 on every rank (its content address) made each rank
pay for the whole replicated state: on 4 ranks of a 64 MiB DDP model, 256 MiB
of blake3 for 64 MiB written. Instead, a replicated chunk of at least
:data:`CHECKED_MIN` bytes gets a *check id* in the plan, and only the rank
that writes it computes its blake3 digest, in the writer's threads (the
chunk's location, posted to rank 0, names its real hash).

The check id is the blake3 (a key derived for this use only, so it never
equals a content address) of the chunk's place (logical key and chunk
index), its size, and its *row sums*: the chunk cut into rows of
:data:`ROW_BYTES` bytes, each row's 8-byte words added modulo 2**64 (one
memory-speed torch reduction), plus the bytes past the last whole row. Equal
replicas have equal check ids on every rank, so the planning exchange
compares them exactly as it compared hashes, and the assignment gives each
one writer. Because the place is part of the id, two chunks can share one
only if they are the same chunk of the same key: a coincidence of two check
ids can at worst hide a divergence, never make one value's bytes stand for
another's.

What the check detects: two copies of a chunk differ, and some row's sum
differs (or the bytes past the last row differ). That covers every
difference confined to one 8-byte word per row (any bit flips in a value,
one changed value), any change of a row's total, and moves of data between
rows; a difference with no structure (other seeds, a missed step, the
rounding of a non-deterministic reduction) goes unseen only if every row it
touches sums to the same value modulo 2**64, about 2**-64 per row touched.
What it cannot see: differences that cancel within each row, such as 8-byte
words swapped or permuted inside one 512-byte row, or +d in one word and -d
in another of the same row. Values smaller than :data:`CHECKED_MIN` (biases,
norms, small tensors) are hashed with blake3 by every rank as before, and
any difference in them is detected.
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
