"""The small records of a repository: its config, refs, tags and damage records (docs/format.md).

Each is a few hundred bytes of canonical JSON under ``.casnap/``; parsing
them from untrusted bytes is :mod:`casnap.format.parse`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from casnap.format.entries import FormatModel, HashStr
from casnap.format.json_text import canonical_json
from casnap.format.versions import FORMAT_VERSION, Version


class RepoConfig(FormatModel):
    """``.casnap/config.json``: written once when the repository is created."""

    format_version: Version = FORMAT_VERSION
    repo_id: StrictStr
    hash: Literal["blake3"] = "blake3"
    chunk_size: Annotated[int, Field(ge=4096, le=1 << 30), StrictInt]
    created_at: StrictStr
    # Created on purpose (``casnap init``, ``Repository.init``) to hold the runs
    # below it; absent (older repositories, and those a take created) is false.
    shared: StrictBool = False


class Ref(FormatModel):
    """``.casnap/refs/<name>``: the commit point of a snapshot."""

    manifest: HashStr
    created_at: StrictStr
    # The snapshot's name, only in a ref stored under a hashed key (a name too long
    # for a flat key, names.name_key): the key alone cannot be decoded back to it.
    name: StrictStr | None = None


class TagRecord(FormatModel):
    """``.casnap/tags/<tag>``: a pin on the manifest a snapshot had when it was tagged."""

    snapshot: StrictStr
    manifest: HashStr
    created_at: StrictStr
    # The tag's name, only in a tag stored under a hashed key (as Ref.name).
    tag: StrictStr | None = None


def record_bytes(record: Ref | TagRecord) -> bytes:
    """A ref or tag as stored: canonical JSON without the name fields that are None,
    so a record under a flat key is the same bytes as before those fields existed."""
    return canonical_json(record.model_dump(exclude_none=True))


class DamageRecord(FormatModel):
    """``.casnap/damaged/<chunk>/<pack or "chunk">``: a read found this copy of a chunk damaged.

    The key alone says which copy (takes only list the folder); the body is
    for people and a later ``repair`` (docs/damage.md).
    """

    chunk: HashStr
    pack: HashStr | None  # None: the loose object chunks/<chunk>
    detected_at: StrictStr
    detail: StrictStr
