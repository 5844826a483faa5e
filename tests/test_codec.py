"""Frame codecs: raw, zstd, and zstd over byte-grouped float elements."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import zstandard
from helpers import tensor_entry

from casnap import Snapshot, StateDict
from casnap.errors import IntegrityError
from casnap.format import codec
from casnap.format.names import digest_of
from casnap.torch_io.tensors import byte_view


def frame_of(data: bytes, elem: int = 0) -> tuple[bytes, int]:
    head, body = codec.encode(data, digest_of(data), elem_size=elem)
    return head + bytes(body), codec.parse_header(head, "f").codec


def weights(dtype: torch.dtype, n: int = 1 << 20) -> bytes:
    t = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    return bytes(byte_view(t))


def test_bf16_weights_are_byte_grouped_and_stored_under_three_quarters():
    data = weights(torch.bfloat16)
    frame, used = frame_of(data, elem=2)
    assert used == codec.CODEC_ZSTD_GROUPED
    assert len(frame) <= 0.75 * len(data)
    assert bytes(codec.decode(frame, "f", digest_of(data), len(data))) == data


@pytest.mark.parametrize(
    "dtype, shift",
    [(torch.bfloat16, 0.0), (torch.float32, 0.0), (torch.float32, 3.0), (torch.float16, 0.0)],
)
def test_grouped_float_planes_are_no_larger_than_with_zstds_own_table(dtype, shift):
    """The grouped codec's small hash table (frame.compressor(grouped=True)) keeps the
    frames of float weights as small as zstd's level-1 table does, or smaller."""
    data = bytes(byte_view((torch.randn(1 << 20) * 0.02 + shift).to(dtype)))
    elem = torch.finfo(dtype).bits // 8
    head, body = codec.encode(
        data, digest_of(data), elem_size=elem, choice=codec.CODEC_ZSTD_GROUPED
    )
    stream = zstandard.ZstdCompressor(level=1).compressobj(size=len(data))  # as encode does
    own = b"".join([stream.compress(codec.group_bytes(data, elem)), stream.flush()])
    assert len(body) <= len(own)
    assert bytes(codec.decode(head + bytes(body), "f", digest_of(data), len(data))) == data


def test_fp32_weights_stay_raw_because_compression_does_not_pay_enough():
    data = weights(torch.float32)
    frame, used = frame_of(data, elem=4)
    assert used == codec.CODEC_RAW and len(frame) == len(data) + codec.HEADER_SIZE


def test_zeros_use_plain_zstd_and_noise_stays_raw():
    zeros = bytes(1 << 16)
    assert frame_of(zeros)[1] == codec.CODEC_ZSTD
    noise = bytes(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).tolist())
    assert frame_of(noise, elem=4)[1] == codec.CODEC_RAW


@pytest.mark.parametrize("elem", [2, 4, 8])
def test_group_and_ungroup_are_inverse(elem):
    data = bytes(range(256)) * 3 * elem
    assert bytes(codec.ungroup_bytes(codec.group_bytes(data, elem), elem)) == data


@pytest.mark.parametrize("elem", [2, 4, 8])
def test_a_grouped_frame_holds_zstd_of_the_grouped_bytes_and_decodes(elem):
    """encode feeds zstd one byte position at a time: one frame of group_bytes' layout."""
    data = (bytes(range(200)) + bytes(56)) * 64 * elem  # compressible, grouped or not
    head, body = codec.encode(
        data, digest_of(data), elem_size=elem, choice=codec.CODEC_ZSTD_GROUPED
    )
    hdr = codec.parse_header(head, "f")
    assert (hdr.codec, hdr.elem_size) == (codec.CODEC_ZSTD_GROUPED, elem)
    payload = zstandard.ZstdDecompressor().decompress(bytes(body))  # the size is in the frame
    assert payload == codec.group_bytes(data, elem)
    assert bytes(codec.decode(head + bytes(body), "f", digest_of(data), len(data))) == data


def test_a_grouped_frame_with_a_bad_element_size_is_refused():
    data = weights(torch.bfloat16, 4096)
    frame, used = frame_of(data, elem=2)
    assert used == codec.CODEC_ZSTD_GROUPED
    bad = bytearray(frame)
    bad[6] = 3  # element size field
    with pytest.raises(IntegrityError, match="element size"):
        codec.decode(bytes(bad), "f", digest_of(data), len(data))


def test_bf16_snapshot_round_trips_and_is_stored_small(tmp_path):
    state = StateDict(w=(torch.randn(1 << 21) * 0.02).to(torch.bfloat16))
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": state})
    stored = sum(c.length for c in tensor_entry(snap.get_manifest(), "0/m/w").chunks)
    assert stored <= 0.75 * state["w"].numel() * 2
    out = StateDict(w=torch.empty_like(state["w"]))
    Snapshot(str(tmp_path / "repo" / "s1")).restore({"m": out})
    assert torch.equal(out["w"].view(torch.int16), state["w"].view(torch.int16))


def test_a_byte_view_keeps_its_tensor_alive():
    """byte_view of a temporary tensor stays valid: the view holds the tensor."""
    t = torch.arange(1 << 20, dtype=torch.int32)
    alive = weakref.ref(t)
    view = byte_view(t)
    del t
    gc.collect()
    assert alive() is not None
    assert torch.frombuffer(view, dtype=torch.int32)[-1].item() == (1 << 20) - 1
    del view
    gc.collect()
    assert alive() is None
