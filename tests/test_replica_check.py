"""The check id that ranks compare for a large replicated chunk (casnap.distributed.replica_check).

What it sees and what it cannot, as docs/distributed.md states: any change of
one 8-byte word, moves between 512-byte rows, the bytes past the last row; not
words swapped inside one row. The end-to-end takes are in
tests/test_replicated_divergence.py (``-m dist``).
"""

from __future__ import annotations

import torch

from casnap.distributed.replica_check import CHECKED_MIN, ROW_BYTES, check_id
from casnap.format.names import digest_of
from casnap.torch_io.tensors import byte_view

N = CHECKED_MIN + 3 * ROW_BYTES + 100  # whole rows, then a partial one


def _chunk(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)


def _id(t: torch.Tensor, place: str = "model/w\x000") -> bytes | None:
    return check_id(byte_view(t), place)


def test_equal_bytes_in_two_buffers_have_one_id_and_it_is_no_content_hash() -> None:
    a, b = _chunk(), _chunk()
    assert a.data_ptr() != b.data_ptr()
    assert _id(a) == _id(b) is not None
    assert _id(a) != digest_of(byte_view(a))  # a check id never names stored bytes


def test_the_place_is_part_of_the_id() -> None:
    a = _chunk()
    assert _id(a, "model/w\x000") != _id(a, "model/w\x001")
    assert _id(a, "model/w\x000") != _id(a, "model/v\x000")


def test_every_single_byte_change_is_seen() -> None:
    a = _chunk()
    base = _id(a)
    for at in (0, 7, 8, ROW_BYTES - 1, ROW_BYTES, N // 2, N - 101, N - 100, N - 1):
        b = a.clone()
        b[at] ^= 0x80  # the top bit of a byte: a sign, in the last byte of a value
        assert _id(b) != base, at


def test_a_change_of_one_word_in_every_row_is_seen() -> None:
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    words[:: ROW_BYTES // 8] += 1  # e.g. a missed optimizer step: many small changes
    assert _id(b) != _id(a)


def test_words_moved_between_rows_are_seen() -> None:
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    row = ROW_BYTES // 8
    words[3], words[row + 3] = words[row + 3].clone(), words[3].clone()
    assert _id(b) != _id(a)


def test_words_swapped_inside_one_row_are_not_seen() -> None:
    """The documented blind spot: each row's words are summed, so their order is lost."""
    a = _chunk()
    b = a.clone()
    words = b[: N - N % ROW_BYTES].view(torch.int64)
    words[3], words[5] = words[5].clone(), words[3].clone()
    assert not torch.equal(a, b)
    assert _id(b) == _id(a)


def test_small_or_read_only_chunks_are_hashed_instead() -> None:
    small = torch.zeros(CHECKED_MIN - 1, dtype=torch.uint8)
    assert _id(small) is None
    assert check_id(memoryview(bytes(N)), "k\x000") is None
