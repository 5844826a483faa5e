"""Byte-grouped float chunks: casnap's grouped codec against zstd's own level-1 table.

    .venv/bin/python benchmarks/grouped_codec.py [--repeats 10]

For 4 MiB chunks of several kinds of float data, times ``codec.encode`` told to
use the grouped codec (its small hash table) and, on the same bytes in the
same run, the byte-grouped stream compressed as before, with
``zstandard.ZstdCompressor(level=1)``. Prints per kind the codec that
``encode``'s sample picks, both times, their ratio and both sizes as a
fraction of the raw chunk (one thread: the writer compresses one chunk per
thread).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import zstandard

from casnap.format import codec
from casnap.format.names import digest_of

N = 1 << 20  # fp32 elements: 4 MiB


def _kinds() -> dict[str, tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(1024, 1024).weight.detach().reshape(-1)
    rows = torch.randn(128, 1024, generator=g)[torch.randint(0, 128, (1024,), generator=g)]
    return {
        "fp32 Linear init + 3": (linear + 3, 4),
        "bf16 weights": ((torch.randn(2 * N, generator=g) * 0.02).bfloat16(), 2),
        "fp16 weights": ((torch.randn(2 * N, generator=g) * 0.02).half(), 2),
        "fp32 quantized": (torch.round(torch.randn(N, generator=g) * 4) / 4, 4),
        "fp32 relu": (torch.relu(torch.randn(N, generator=g)), 4),
        "fp32 128 rows repeated": (rows.reshape(-1), 4),
        "fp64 weights": (torch.randn(N // 2, generator=g, dtype=torch.float64), 8),
    }


def _ms(f: Callable[[], object], repeats: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - start) / repeats * 1e3


def _old_grouped(data: bytes, elem: int) -> bytes:
    stream = zstandard.ZstdCompressor(level=1).compressobj(size=len(data))
    parts = [stream.compress(data[i::elem]) for i in range(elem)]
    return b"".join([*parts, stream.flush()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'data':24s} {'picked':13s} {'casnap':>9s} {'zstd L1':>9s} {'ratio':>6s}  sizes")
    for name, (t, elem) in _kinds().items():
        data = bytes(t.contiguous().view(torch.uint8).numpy())
        digest = digest_of(data)
        picked = codec.choose_codec(data, elem_size=elem)[0]
        used = codec.CODEC_NAMES[picked]
        grouped = codec.CODEC_ZSTD_GROUPED

        def ours_encode() -> tuple[bytes, codec.Buffer]:
            return codec.encode(data, digest, elem_size=elem, choice=grouped)  # noqa: B023

        body = ours_encode()[1]
        ours = _ms(ours_encode, args.repeats)
        old = _ms(lambda: _old_grouped(data, elem), args.repeats)  # noqa: B023
        old_size = len(_old_grouped(data, elem)) / len(data)
        print(
            f"{name:24s} {used:13s} {ours:7.2f}ms {old:7.2f}ms {ours / old:6.2f}"
            f"  {len(body) / len(data):.3f} / {old_size:.3f}"
        )


if __name__ == "__main__":
    main()
