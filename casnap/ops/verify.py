"""verify: prove the repository is whole, without changing it.

Every ref must resolve to a manifest that parses and validates, and every
chunk a manifest references must exist (one listing of the store, not a probe
per chunk). With ``read_data`` every referenced chunk is fetched, decoded and
re-hashed; ``part=(k, n)`` restricts that to the chunks whose hash falls in
part ``k`` of ``n``, so a long scrub can run a slice at a time. Problems are
collected and reported, never repaired. The one thing verify writes is a
damage record for each chunk copy whose bytes fail their hash, through the
verified reader's containment (:mod:`casnap.chunks.damage`), so that no later
take references that copy; on a read-only store it warns instead. The local
index is never consulted (only told to forget damaged chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from casnap.chunks.damage import decode_frame
from casnap.chunks.io import Span, object_name, plan_reads
from casnap.errors import (
    CasnapError,
    ConfigError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectRefusedError,
    expect_type,
)
from casnap.format.manifest import ChunkRef, Manifest
from casnap.repo.damage import DAMAGED, list_damage
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import TAGS, read_tag

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Problem:
    kind: str  # "ref", "tag", "manifest", "missing-object", "unreadable-object",
    # "corrupt-chunk", "damage-records"
    subject: str  # the ref, manifest or object concerned
    detail: str
    snapshots: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "subject": self.subject, "detail": self.detail,
                "snapshots": list(self.snapshots)}  # fmt: skip


@dataclass
class VerifyReport:
    snapshots: int = 0
    manifests: int = 0
    chunks: int = 0  # distinct chunks referenced
    chunks_read: int = 0  # chunks re-hashed (read_data)
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "snapshots": self.snapshots, "manifests": self.manifests,
                "chunks": self.chunks, "chunks_read": self.chunks_read,
                "bytes_read": self.bytes_read,
                "problems": [p.to_json() for p in self.problems]}  # fmt: skip


def in_part(chunk_hash: str, part: tuple[int, int] | None) -> bool:
    if part is None:
        return True
    k, n = part
    return int(chunk_hash[:8], 16) % n == k


def verify(
    repo: RepoStorage,
    *,
    read_data: bool = False,
    part: tuple[int, int] | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every ref, manifest and chunk; see the module docstring."""
    if part is not None:
        expect_type(part, tuple, "part", "a (k, n) tuple of ints")
        ok = len(part) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in part)
        if not ok or not (part[1] >= 1 and 0 <= part[0] < part[1]):
            raise ConfigError(f"part {part!r} must be (k, n) with 0 <= k < n", "part")
    report = VerifyReport()
    owners: dict[tuple[str | None, str], set[str]] = {}  # (pack, hash) -> snapshots
    refs: dict[tuple[str | None, str], ChunkRef] = {}
    manifests: dict[str, Manifest | None] = {}
    for name in repo.list_snapshots():
        report.snapshots += 1
        try:
            mhash = repo.read_ref(name).manifest
        except CasnapError as exc:
            report.problems.append(Problem("ref", name, str(exc), (name,)))
            continue
        if mhash not in manifests:
            try:
                manifests[mhash] = repo.read_manifest(mhash)
            except CasnapError as exc:
                manifests[mhash] = None
                report.problems.append(Problem("manifest", mhash, str(exc), (name,)))
        m = manifests[mhash]
        if m is None:
            continue
        for ref in m.chunk_refs():
            key = (ref.pack, ref.hash)
            refs[key] = ref
            owners.setdefault(key, set()).add(name)
    _check_tags(repo, report)
    report.manifests = sum(m is not None for m in manifests.values())
    report.chunks = len(refs)

    present = set(repo.store.list("chunks")) | set(repo.store.list("packs"))
    missing: dict[str, set[str]] = {}
    for key, ref in refs.items():
        obj = object_name(ref)
        if obj not in present:
            missing.setdefault(obj, set()).update(owners[key])
    for obj, names in sorted(missing.items()):
        report.problems.append(Problem("missing-object", obj, "referenced but not in the store",
                                       tuple(sorted(names))))  # fmt: skip

    _report_recorded(repo, refs, owners, report, part if read_data else (0, 0))

    if read_data:
        todo = [r for r in refs.values()
                if object_name(r) not in missing and in_part(r.hash, part)]  # fmt: skip
        spans = plan_reads(todo)
        for i, span in enumerate(spans):
            _scrub(repo, span, report, owners)
            if progress is not None:
                progress(i + 1, len(spans))
    return report


def _check_tags(repo: RepoStorage, report: VerifyReport) -> None:
    """Every tag must read: a tag is a gc root, and gc refuses to sweep past one it cannot read."""
    try:
        keys = sorted(repo.store.list(TAGS))
    except CasnapError as exc:
        report.problems.append(Problem("tag", TAGS, f"cannot list: {exc}"))
        return
    for key in keys:
        tag = key[len(TAGS) + 1 :]
        try:
            read_tag(repo, tag)
        except ObjectNotFoundError:
            continue  # removed since the listing
        except CasnapError as exc:
            report.problems.append(Problem("tag", tag, str(exc)))


def _report_recorded(
    repo: RepoStorage,
    refs: dict[tuple[str | None, str], ChunkRef],
    owners: dict[tuple[str | None, str], set[str]],
    report: VerifyReport,
    reread: tuple[int, int] | None,
) -> None:
    """Report referenced copies an earlier read recorded as damaged and this run does not re-read.

    ``reread`` is the part re-hashed now (None: all; ``(0, 0)``: none). A
    restore that met damage is then visible to a plain ``verify`` too.
    """
    try:
        recorded = {(c.pack, c.chunk) for c in list_damage(repo)}
    except CasnapError as exc:
        report.problems.append(Problem("damage-records", DAMAGED, f"cannot list: {exc}"))
        return
    for key in sorted(recorded & refs.keys(), key=str):
        if reread != (0, 0) and in_part(key[1], reread):
            continue  # re-hashed below: reported from the bytes themselves
        ref = refs[key]
        subject = f"{object_name(ref)} ({ref.hash[:12]})"
        detail = "recorded as damaged by an earlier read (docs/damage.md); run with --read-data"
        report.problems.append(Problem("corrupt-chunk", subject, detail,
                                       tuple(sorted(owners[key]))))  # fmt: skip


def _scrub(
    repo: RepoStorage,
    span: Span,
    report: VerifyReport,
    owners: dict[tuple[str | None, str], set[str]],
) -> None:
    """Fetch one object (or one range of a pack) and re-hash every chunk in it."""
    try:
        if span.end < 0:
            blob = repo.store.get(span.key)
        else:
            blob = repo.store.get_range(span.key, span.start, span.end)
    except (ObjectNotFoundError, ObjectRefusedError) as exc:  # refused: a FIFO, a link, ...
        users: set[str] = set().union(*(owners[(r.pack, r.hash)] for _, r in span.items))
        kind = "missing-object" if isinstance(exc, ObjectNotFoundError) else "unreadable-object"
        report.problems.append(Problem(kind, span.key, str(exc), tuple(sorted(users))))
        return
    report.bytes_read += len(blob)
    view = memoryview(blob)
    for _, ref in span.items:
        frame = view if span.end < 0 else view[ref.offset - span.start :
                                               ref.offset - span.start + ref.length]  # fmt: skip
        try:
            decode_frame(repo, span.key, ref, frame)  # records the damage it finds
        except IntegrityError as exc:
            holders = tuple(sorted(owners[(ref.pack, ref.hash)]))
            subject = f"{span.key} ({ref.hash[:12]})"
            report.problems.append(Problem("corrupt-chunk", subject, str(exc), holders))
        report.chunks_read += 1
