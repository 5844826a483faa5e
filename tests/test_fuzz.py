"""Fuzz the parsers of untrusted input: a malicious file gives a CasnapError, never a crash."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casnap.errors import CasnapError
from casnap.format import codec
from casnap.format.entries import ChunkRef, PrimitiveEntry, TensorEntry
from casnap.format.json_text import canonical_json
from casnap.format.manifest import Manifest
from casnap.format.manifest_bytes import serialize
from casnap.format.names import digest_of, hash_bytes
from casnap.format.parse import parse_config, parse_manifest, parse_ref

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_VALID = serialize(
    Manifest(
        created_at="2026-01-01T00:00:00+00:00",
        entries={
            "0/s": PrimitiveEntry(type="int", value=1),
            "0/t": TensorEntry(
                dtype="float32",
                shape=[3, 2],
                chunk_size=16,
                chunks=[
                    ChunkRef(hash="a" * 64, size=16, length=72),
                    ChunkRef(hash="b" * 64, size=8, pack="c" * 64, offset=100, length=64),
                ],
            ),
        },
    )
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(st.binary(max_size=2000))
def test_random_bytes_never_crash_the_manifest_parser(data):
    for name in (hash_bytes(data), "0" * 64):
        try:
            parse_manifest(data, name)
        except CasnapError:
            pass


@FUZZ
@given(st.data())
def test_mutated_manifests_are_accepted_or_refused_cleanly(data):
    doc = json.loads(_VALID)
    path = data.draw(
        st.sampled_from(
            [
                ("entries", "0/t", "shape"),
                ("entries", "0/t", "dtype"),
                ("entries", "0/t", "chunk_size"),
                ("entries", "0/t", "chunks"),
                ("entries", "0/s", "value"),
                ("entries", "0/s", "type"),
                ("format_version",),
                ("parents",),
                ("entries",),
                ("world_size",),
                ("metadata",),
            ]
        )
    )
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = data.draw(json_values)
    blob = canonical_json(doc)
    try:
        m = parse_manifest(blob, hash_bytes(blob))
    except CasnapError:
        return
    for e in m.entries.values():  # anything accepted is internally consistent
        if isinstance(e, TensorEntry):
            assert sum(c.size for c in e.chunks) == e.nbytes


@FUZZ
@given(st.binary(max_size=300))
def test_random_refs_and_configs_never_crash(data):
    for parse in (lambda d: parse_ref(d, "x"), parse_config):
        try:
            parse(data)
        except CasnapError:
            pass


@FUZZ
@given(
    st.binary(min_size=0, max_size=4000), st.booleans(), st.sampled_from([0, 2, 4, 8]), st.data()
)
def test_corrupted_frames_are_integrity_errors(payload, compress, elem, data):
    digest = digest_of(payload)
    head, body = codec.encode(payload, digest, compress=compress, elem_size=elem)
    frame = bytearray(head + bytes(body))
    assert bytes(codec.decode(bytes(frame), "f", digest, len(payload))) == payload
    # flip one byte, or truncate: never silently wrong, never a crash
    if data.draw(st.booleans()) and frame:
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] ^= data.draw(st.integers(1, 255))
    else:
        frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]
    try:
        out = codec.decode(bytes(frame), "f", digest, len(payload))
    except CasnapError:
        return
    assert bytes(out) == payload  # e.g. a flip in the reserved field is harmless
