"""Tags: named pins on snapshots, and the tags a snapshot carries in its metadata.

A repository tag (``.casnap/tags/<tag>``, written create-only; its record is
in docs/format.md, "Tags") pins the manifest the snapshot had when tagged, a
gc root even after the snapshot's ref is deleted; moving a tag is
``remove_tag`` then ``add_tag``. ``metadata["tags"]`` describe a snapshot but
pin nothing. Retention (``KeepTagged``) honours both (docs/retention.md, "Tags").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from casnap.errors import (
    ManifestValidationError,
    ObjectExistsError,
    ObjectNotFoundError,
    SnapshotNotFoundError,
    expect_type,
)
from casnap.format.json_text import load_json
from casnap.format.names import check_ref_name, is_hashed_key, name_key
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.format.records import TagRecord, record_bytes
from casnap.repo.leases import hold_lease
from casnap.repo.named import check_recorded_name, named_keys, names_in
from casnap.repo.repository import RepoStorage, manifest_key, now_iso

TAGS = "tags"
MAX_TAG_BYTES = MAX_RECORD_BYTES  # a tag file is tiny; anything larger is not one of ours


def tag_key(tag: str) -> str:
    """The store key (below ``.casnap/``) of a tag; the name is validated like a ref name."""
    return f"{TAGS}/{name_key(check_ref_name(tag, 'tag name'))}"


def _stored_key(repo: RepoStorage, tag: str) -> str:
    """Where ``tag`` is: its key, or where an older version put it if only that exists."""
    key, *old = named_keys(TAGS, check_ref_name(tag, "tag name"))
    if old and not repo.store.exists(key):
        return next((k for k in old if repo.store.exists(k)), key)
    return key


def tag_names(repo: RepoStorage) -> list[str]:
    """Every tag's name, in natural order, without reading the tags (``verify`` reads each itself),
    but for the few under a hashed key, whose record says the name (a damaged one is refused)."""
    return names_in(repo.store, TAGS)


@dataclass(frozen=True)
class TagInfo:
    """One repository tag: the snapshot it was put on and the manifest it pins."""

    tag: str
    snapshot: str
    manifest: str
    created_at: str


def _parse_tag(tag: str, data: bytes, key: str | None = None) -> TagInfo:
    """``key``: where it was read (default: where ``tag`` is written)."""
    what = f"tag {tag!r}"
    if len(data) > MAX_TAG_BYTES:
        raise ManifestValidationError(f"{what} is larger than {MAX_TAG_BYTES} bytes", tag)
    raw = load_json(data, what)
    try:
        record = TagRecord.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestValidationError(
            f"{what} is malformed at {where}: {first['msg']}", tag
        ) from exc
    stored = key[len(TAGS) + 1 :] if key is not None else name_key(tag)
    check_recorded_name(TAGS, stored, tag, record.tag)
    return TagInfo(tag, record.snapshot, record.manifest, record.created_at)


def add_tag(repo: RepoStorage, tag: str, snapshot_name: str) -> TagInfo:
    """Pin ``snapshot_name``'s current manifest under ``tag`` (create-only).

    Raises :class:`casnap.errors.ObjectExistsError` (a ``FileExistsError``) when the
    tag exists, :class:`casnap.SnapshotNotFoundError` when the snapshot does
    not, and :class:`casnap.errors.InvalidNameError` for a malformed tag name.

    Example: ``add_tag(repo, "best", "step_000004200")``.
    """
    expect_type(repo, RepoStorage, "repo", "a casnap repository")
    key, *old = named_keys(TAGS, check_ref_name(tag, "tag name"))
    # Under a lease, so no gc can sweep between resolving the ref and writing the tag.
    with hold_lease(repo, kind="tag"):
        manifest = repo.resolve(snapshot_name)
        recorded = tag if is_hashed_key(key[len(TAGS) + 1 :]) else None  # a long name's key
        record = TagRecord(
            snapshot=snapshot_name, manifest=manifest, created_at=now_iso(), tag=recorded
        )
        try:
            for taken in old:  # the tag where an older version put it
                if repo.store.exists(taken):
                    raise ObjectExistsError(f"{taken} exists", taken)
            repo.store.put(key, record_bytes(record), create_only=True)
        except ObjectExistsError as exc:
            raise ObjectExistsError(
                f"tag {tag!r} already exists in {repo.url}; remove it first to move it", key
            ) from exc
        # The ref may have been deleted (and its manifest collected) before the lease;
        # a tag must never name a missing manifest, so undo it if that happened.
        if not repo.store.exists(manifest_key(manifest)):
            repo.store.delete(key)
            raise SnapshotNotFoundError(
                f"snapshot {snapshot_name!r} was deleted while it was being tagged", snapshot_name
            )
    return TagInfo(tag, snapshot_name, manifest, record.created_at)


def read_tag(repo: RepoStorage, tag: str) -> TagInfo:
    """One tag; :class:`casnap.errors.ObjectNotFoundError` when it does not exist."""
    expect_type(repo, RepoStorage, "repo", "a casnap repository")
    key = _stored_key(repo, tag)
    try:
        data = repo.store.get(key, limit=MAX_TAG_BYTES)
    except ObjectNotFoundError as exc:
        raise ObjectNotFoundError(f"no tag {tag!r} in {repo.url}", key) from exc
    return _parse_tag(tag, data, key)


def remove_tag(repo: RepoStorage, tag: str) -> TagInfo:
    """Delete ``tag`` and return what it pinned; the snapshot's ref is untouched.

    Raises :class:`casnap.errors.ObjectNotFoundError` (a ``FileNotFoundError``) when
    there is no such tag. Once removed, the manifest it pinned is reclaimable
    by gc unless a ref or another tag still reaches it.
    """
    expect_type(repo, RepoStorage, "repo", "a casnap repository")
    info = read_tag(repo, tag)
    for key in named_keys(TAGS, tag):
        repo.store.delete(key)
    return info


def list_tags(repo: RepoStorage) -> dict[str, TagInfo]:
    """Every repository tag by name, in natural order. Gc roots: see ``TagInfo.manifest``.

    A malformed tag file raises :class:`casnap.errors.ManifestValidationError` rather
    than being skipped, so a collector can never lose a root silently.
    """
    expect_type(repo, RepoStorage, "repo", "a casnap repository")
    out: dict[str, TagInfo] = {}
    for tag in tag_names(repo):
        try:
            out[tag] = read_tag(repo, tag)
        except ObjectNotFoundError:
            continue  # removed while listing
    return out


def metadata_tags(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """The tags a snapshot carries in ``metadata["tags"]`` (non-strings are ignored)."""
    raw = metadata.get("tags")
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list):
        return ()
    return tuple(t for t in raw if isinstance(t, str))
