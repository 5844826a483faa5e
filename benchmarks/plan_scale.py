"""Planning a distributed take at scale, by simulation: the coordinator for up to 1,024 ranks.

    .venv/bin/python benchmarks/plan_scale.py [--ranks 8,64,256,1024] [--repeat 3]

No tensors and no processes: each simulated rank's planning message (what
``exchange_plans`` sends for a cold take) is built from metadata, pickled as the gather
carries it, and the coordinator's pure step (decode, replica check, writer assignment,
manifest) runs on them here. The layout: a 70B Llama-like model in bf16 as DTensors under
HSDP (``Shard(0)`` within groups of 8 ranks, ``Replicate()`` across them), plus a per-rank
step counter. Prints one JSON line per world size: the coordinator's time by stage (median
of ``--repeat``, fastest as ``min_s``), its peak Python memory (tracemalloc; the received
messages apart as ``received_bytes``), max/mean of the bytes per writer, the bytes each
rank sends with its chunk count, and the manifest's size.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from casnap.distributed.coordinate import (  # noqa: E402
    assemble_entries,
    coordinate,
    manifest_of,
)
from casnap.distributed.plan_cache import Gathered, PlanMessage, message_of  # noqa: E402
from casnap.format.codec import HEADER_SIZE  # noqa: E402
from casnap.format.entries import ChunkRef, PrimitiveEntry  # noqa: E402
from casnap.format.manifest_bytes import serialize as serialize_manifest  # noqa: E402
from casnap.index.summaries import summarize
from casnap.take.plan import RankPlan, ShardedPlan, ShardPlan  # noqa: E402

GROUP = 8  # FSDP shards within a node group


def llama70b_shapes(layers: int = 80) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-2/3-70B-like model (about 70.6e9 parameters)."""
    d, ff, kv, vocab = 8192, 28672, 1024, 128_256
    layer = {"attention.wq": (d, d), "attention.wk": (kv, d), "attention.wv": (kv, d),
             "attention.wo": (d, d), "feed_forward.w1": (ff, d), "feed_forward.w2": (d, ff),
             "feed_forward.w3": (ff, d), "attention_norm": (d,), "ffn_norm": (d,)}  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, d)}
    for i in range(layers):
        shapes.update({f"layers.{i}.{k}.weight": shape for k, shape in layer.items()})
    shapes.update({"norm.weight": (d,), "output.weight": (vocab, d)})
    return shapes


def _digest(*parts: object) -> str:
    return blake3.blake3("/".join(map(str, parts)).encode()).hexdigest()


def shard_boxes(
    shapes: dict[str, tuple[int, ...]], chunk_size: int, itemsize: int = 2
) -> list[dict[str, ShardPlan]]:
    """For each of the GROUP shard positions, every parameter's box and its chunk ids.

    ``Shard(0)`` as FSDP2 cuts: ceil(rows / GROUP) rows per rank, the last ones
    shorter (possibly empty). The digests stand for the bytes: equal boxes
    (the same position in another group) have equal digests.
    """
    out: list[dict[str, ShardPlan]] = [{} for _ in range(GROUP)]
    for name, shape in shapes.items():
        rows, rest = shape[0], shape[1:]
        step = -(-rows // GROUP)
        row_bytes = itemsize * math.prod(rest)
        for i in range(GROUP):
            start = min(rows, i * step)
            size = min(step, rows - start)
            nbytes = size * row_bytes
            count = -(-nbytes // chunk_size)
            ids = tuple(
                (_digest(name, i, c), min(chunk_size, nbytes - c * chunk_size))
                for c in range(count)
            )
            out[i][name] = ShardPlan((start, *([0] * len(rest))), (size, *rest), ids)
    return out


def rank_plan(
    rank: int,
    boxes: list[dict[str, ShardPlan]],
    shapes: dict[str, tuple[int, ...]],
    chunk_size: int,
) -> RankPlan:
    """What rank ``rank`` of the HSDP job plans: its box of every parameter, and a step."""
    own = boxes[rank % GROUP]
    entries: dict[str, Any] = {
        f"{rank}/model/{name}": ShardedPlan("dtensor", "bfloat16", shapes[name], (box,))
        for name, box in own.items()
    }
    entries[f"{rank}/train/step"] = PrimitiveEntry(type="int", value=1000)
    return RankPlan(rank, chunk_size, entries)


def rank_messages(ranks: int, chunk_mib: float, layers: int = 80) -> list[bytes]:
    """Every rank's pickled planning message, as the gather carries it (a cold take:
    no plan cache, so every rank sends its structure)."""
    chunk_size = int(chunk_mib * (1 << 20))
    shapes = llama70b_shapes(layers)
    boxes = shard_boxes(shapes, chunk_size)
    return [
        pickle.dumps(message_of(rank_plan(r, boxes, shapes, chunk_size)), pickle.HIGHEST_PROTOCOL)
        for r in range(ranks)
    ]


def coordinator(blobs: list[bytes], serialize: bool, times: dict[str, float]) -> dict[str, Any]:
    """What the planning step costs on one rank once the messages are gathered, then what
    rank 0 does once the chunks are written (entries, manifest, its JSON)."""

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t0
        return out

    messages: list[PlanMessage] = timed("decode", lambda: [pickle.loads(b) for b in blobs])
    gathered = Gathered(messages, [m.structure for m in messages])  # type: ignore[misc]
    planned = timed("plan", lambda: coordinate(gathered, "warn"))
    refs = {
        h: ChunkRef.model_construct(hash=h, size=n, pack=None, offset=0, length=HEADER_SIZE + n)
        for h, n in planned.sizes.items()
    }  # where the writers would post them: loose objects
    entries = timed("entries", lambda: assemble_entries(planned, refs))
    manifest = timed("manifest", lambda: manifest_of(entries, len(blobs), [], {}))
    data = timed("serialize", lambda: serialize_manifest(manifest)) if serialize else b""
    # Rank 0 records the manifest's summary in the local index at commit (log, du).
    timed("summary", lambda: summarize("0" * 64, manifest))
    load = [b for b in planned.load if b]
    return {
        "max_over_mean": round(max(load) / (sum(load) / len(load)), 4),
        "writing_ranks": len(load),
        "unique_chunks": len(planned.writers),
        "manifest_bytes": len(data),
        "entries": len(manifest.entries),
        "_planned": planned,
    }


def measure(
    ranks: int, chunk_mib: float, layers: int = 80, serialize: bool = True, repeat: int = 3
) -> dict[str, Any]:
    blobs = rank_messages(ranks, chunk_mib, layers)
    chunks = len(pickle.loads(blobs[-1]).content.digests) // 32
    runs = []
    for _ in range(repeat):
        gc.collect()
        times: dict[str, float] = {}
        out = coordinator(blobs, serialize, times)
        del out["_planned"]
        runs.append((sum(times.values()), times))  # not the simulated writers' posting
    runs.sort(key=lambda r: r[0])
    total, times = runs[len(runs) // 2]  # the median run
    gc.collect()
    tracemalloc.start()  # a second run for memory: tracing slows Python down several times
    base = tracemalloc.get_traced_memory()[0]
    coordinator(blobs, serialize, {})
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    planning = times["decode"] + times["plan"]
    return {
        "ranks": ranks,
        "coordinator_s": round(total, 3),
        "min_s": round(runs[0][0], 3),
        "planning_s": round(planning, 3),
        "stages_s": {k: round(v, 3) for k, v in times.items()},
        "peak_mib": round(peak / (1 << 20), 1),
        **out,
        "sent_bytes_per_rank": max(len(b) for b in blobs),
        "chunks_per_rank": chunks,
        "received_bytes": sum(len(b) for b in blobs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,64,256,1024")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--no-serialize", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the median's times")
    args = parser.parse_args()
    for n in (int(x) for x in args.ranks.split(",")):
        row = measure(n, args.chunk_mib, args.layers, not args.no_serialize, args.repeat)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
