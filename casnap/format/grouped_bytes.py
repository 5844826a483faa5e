"""A grouped manifest's canonical JSON, assembled from one text per entry object.

What a distributed take writes is ``canonical_json(manifest.to_jsonable())``
(pinned by tests/test_grouped_bytes.py): the keys one rank holds in
``entries``, the rest in ``rank_groups``. Dumping that through pydantic and
``json.dumps`` costs a model dump per key of every group, and a sharded
entry's dump (every shard's every chunk) is the same for each path it
appears under. Here each entry object is dumped once, a dense tensor's and a
sharded entry's from a template (their strings and ints need no escaping:
the models admit nothing else; a delta reference, a quantized tensor or shard is
dumped the usual way), and the texts are spliced into the document in the
order ``canonical_json`` sorts them.

Example::

    >>> data = serialize(manifest)  # a manifest of world_size > 1 comes here
"""

from __future__ import annotations

import json
from collections.abc import Callable

from casnap.format.entries import ChunkRef, Entry, ShardedEntry, TensorEntry
from casnap.format.json_text import canonical_json
from casnap.format.manifest import Groups, Manifest


def _dumped(entry: Entry | ChunkRef) -> str:
    return canonical_json(entry.model_dump(mode="json")).decode("utf-8")


def ref_text(r: ChunkRef) -> str:
    """A chunk reference's canonical JSON text (a whole frame's from a template)."""
    if r.base is not None:  # a delta: its chain nests, dumped the usual way
        return _dumped(r)
    pack = "null" if r.pack is None else f'"{r.pack}"'
    return (
        f'{{"hash":"{r.hash}","length":{r.length},"offset":{r.offset},'
        f'"pack":{pack},"size":{r.size}}}'
    )


def _string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _ints(values: list[int]) -> str:
    return ",".join([str(v) for v in values])


def _refs_text(refs: list[ChunkRef]) -> str:
    return ",".join([ref_text(r) for r in refs])


def _sharded_text(e: ShardedEntry) -> str:
    shards = ",".join(
        [
            f'{{"chunk_size":{s.chunk_size},"chunks":[{_refs_text(s.chunks)}],'
            f'"offsets":[{_ints(s.offsets)}],"sizes":[{_ints(s.sizes)}]}}'
            for s in e.shards
        ]
    )
    dtype, layout = _string(e.dtype), _string(e.layout)
    return (
        f'{{"dtype":{dtype},"kind":"sharded","layout":{layout},'
        f'"shape":[{_ints(e.shape)}],"shards":[{shards}]}}'
    )


def _tensor_text(e: TensorEntry) -> str:
    chunks = ",".join([ref_text(r) for r in e.chunks])
    replicated = "true" if e.replicated else "false"
    return (
        f'{{"chunk_size":{e.chunk_size},"chunks":[{chunks}],'
        f'"dtype":{_string(e.dtype)},"kind":"tensor",'
        f'"replicated":{replicated},"shape":[{_ints(e.shape)}]}}'
    )


def value_text(entry: Entry) -> str:
    """``canonical_json(entry.model_dump(mode="json"))`` as text, from a template where
    one exists."""
    if type(entry) is ShardedEntry and not entry.quantized_shards:
        return _sharded_text(entry)
    if type(entry) is TensorEntry and entry.quantized is None:
        return _tensor_text(entry)
    return _dumped(entry)


def _object_text(held: dict[str, Entry], text: Callable[[Entry], str]) -> str:
    """``{"path":<entry>,...}`` with the paths sorted as ``canonical_json`` sorts them."""
    members = [f"{_string(p)}:{text(held[p])}" for p in sorted(held)]
    return "{" + ",".join(members) + "}"


def grouped_bytes(manifest: Manifest, plain: dict[str, Entry], groups: Groups) -> bytes:
    """``canonical_json(manifest.to_jsonable())`` for ``plain`` and ``groups`` (what
    :meth:`Manifest.rank_groups_split` gives), each entry object's text made once."""
    texts: dict[int, str] = {}  # id(entry) -> its text; the entries outlive this call

    def text(e: Entry) -> str:
        t = texts.get(id(e))
        if t is None:
            t = texts[id(e)] = value_text(e)
        return t

    fields = {
        k: canonical_json(v).decode("utf-8")
        for k, v in manifest.model_dump(mode="json", exclude={"entries", "rank_groups"}).items()
    }
    fields["entries"] = _object_text(plain, text)
    if groups:
        fields["rank_groups"] = (
            "["
            + ",".join(
                [
                    f'{{"entries":{_object_text(held, text)},'
                    f'"ranks":[{",".join([f"[{lo},{hi}]" for lo, hi in ranks])}]}}'
                    for ranks, held in groups
                ]
            )
            + "]"
        )
    body = ",".join([f"{json.dumps(k)}:{fields[k]}" for k in sorted(fields)])
    return ("{" + body + "}").encode("utf-8")
