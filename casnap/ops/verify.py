"""verify: prove the repository is whole, without changing it (docs/repository.md,
"Checking"; docs/damage.md, "What verify can and cannot see").

Every ref and tag must resolve to a manifest that parses and validates, and
every chunk it references must exist (one listing of the store, not a probe
per chunk); ``read_data`` also re-hashes them, ``part=(k, n)`` one slice. The
one thing verify writes is a damage record per chunk copy that fails its hash
(:mod:`casnap.chunks.decode`; a warning on a read-only store). The local index
is never consulted; objects no root reaches are counted
(:attr:`VerifyReport.unreferenced`), never a problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from casnap.chunks.decode import decode_frame, loose_copy
from casnap.chunks.read import Span, fetch_span, object_name, plan_reads
from casnap.errors import (
    CasnapError,
    ConfigError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectRefusedError,
    RepositoryNotFoundError,
    SnapshotNotFoundError,
    UnsupportedFormatError,
    expect_type,
)
from casnap.format.entries import ChunkRef
from casnap.ops.unreferenced import Unreferenced, find_unreferenced
from casnap.python_gc import python_gc_paused
from casnap.repo.damage import DAMAGED, DamagedCopy, list_damage
from casnap.repo.named import stored_names
from casnap.repo.repository import CONFIG_KEY, META, RepoStorage, chunk_key
from casnap.repo.tags import TAGS, read_tag
from casnap.store import open_store

Progress = Callable[[int, int], None]  # progress(done_bytes, total_bytes)
_OBJECTS = ("manifests", "chunks", "packs")


@dataclass(frozen=True)
class Problem:
    # "config", "ref", "tag", "manifest", "missing-object", "unreadable-object",
    # "corrupt-chunk", "damage-records"
    kind: str
    subject: str  # the ref, tag, manifest or object concerned
    detail: str
    snapshots: tuple[str, ...] = ()  # the snapshots it makes unrestorable (in whole or part)
    tags: tuple[str, ...] = ()  # the tags whose pinned manifest it affects


@dataclass
class VerifyReport:
    snapshots: int = 0
    tags: int = 0
    manifests: int = 0
    chunks: int = 0  # distinct chunks referenced
    chunks_read: int = 0  # chunks re-hashed (read_data)
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    # What no ref or tag reaches (gc's to delete): space, not damage, so never a
    # problem. None when a root's manifest could not be read (its chunks unknown).
    unreferenced: Unreferenced | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, **dataclasses.asdict(self)}


def in_part(chunk_hash: str, part: tuple[int, int] | None) -> bool:
    if part is None:
        return True
    k, n = part
    return int(chunk_hash[:8], 16) % n == k


Holder = tuple[str, str]  # ("snapshot", name) or ("tag", name): what a problem affects
Key = tuple[str | None, str]  # (pack or None, chunk hash): one stored copy of a chunk


class Owners:
    """Who needs each stored copy of a chunk, and how.

    A snapshot needs the chunks its manifest names *directly*; it needs the
    bases of a delta only *through* that delta (the chain's head), and a read
    of a packed delta whose chain cannot be rebuilt falls back to a good loose
    ``chunks/<h>`` of the head (:func:`casnap.chunks.decode.decode_frame`). So
    a problem with a base affects a snapshot only while the head it reaches the
    base through has no such stand-in: verify's verdict is the restore's.
    """

    def __init__(self) -> None:
        self.refs: dict[Key, ChunkRef] = {}
        self.direct: dict[Key, set[Holder]] = {}
        self.chained: dict[Key, dict[Key, set[Holder]]] = {}  # base -> head -> holders

    def add(self, refs: Iterable[ChunkRef], holders: set[Holder]) -> None:
        """The chunks one manifest names (:meth:`Manifest.distinct_refs`), for ``holders``."""
        for ref in refs:
            head = (ref.pack, ref.hash)
            self.refs[head] = ref
            self.direct.setdefault(head, set()).update(holders)
            for link in ref.chain()[1:]:
                key = (link.pack, link.hash)
                self.refs[key] = link
                self.chained.setdefault(key, {}).setdefault(head, set()).update(holders)

    def affected(self, key: Key, stands_in: Callable[[ChunkRef], bool]) -> set[Holder]:
        """The holders a problem with copy ``key`` leaves unrestorable; ``stands_in(head)``
        says whether a delta head has a good loose ``chunks/<h>`` (asked only when it matters)."""
        out = set(self.direct.get(key, ()))
        for head, holders in sorted(self.chained.get(key, {}).items(), key=str):
            if not holders <= out and not stands_in(self.refs[head]):
                out |= holders
        return out


def _problem(kind: str, subject: str, detail: str, holders: Iterable[Holder] = ()) -> Problem:
    held = set(holders)
    return Problem(
        kind,
        subject,
        detail,
        tuple(sorted(n for k, n in held if k == "snapshot")),
        tuple(sorted(n for k, n in held if k == "tag")),
    )


def roots(repo: RepoStorage, report: VerifyReport) -> dict[str, set[Holder]]:
    """Every manifest a ref or a tag names, with who names it; unreadable roots are problems."""
    roots: dict[str, set[Holder]] = {}
    names, damaged = stored_names(repo.store, "refs")
    for key, reason in damaged:  # a long name's ref that cannot say its name
        report.snapshots += 1
        report.problems.append(_problem("ref", f"{META}/{key}", reason))
    for name in names:
        report.snapshots += 1
        try:
            mhash = repo.read_ref(name).manifest
        except CasnapError as exc:
            report.problems.append(_problem("ref", name, str(exc), [("snapshot", name)]))
            continue
        roots.setdefault(mhash, set()).add(("snapshot", name))
    tags, damaged = stored_names(repo.store, TAGS)
    for key, reason in damaged:
        report.tags += 1
        report.problems.append(_problem("tag", f"{META}/{key}", reason))
    for tag in tags:
        report.tags += 1
        try:
            info = read_tag(repo, tag)
        except CasnapError as exc:
            report.problems.append(_problem("tag", tag, str(exc), [("tag", tag)]))
            continue
        roots.setdefault(info.manifest, set()).add(("tag", tag))
    return roots


def verify(
    repo: RepoStorage,
    *,
    read_data: bool = False,
    part: tuple[int, int] | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every ref, tag, manifest and chunk; see the module docstring."""
    if part is not None:
        expect_type(part, tuple, "part", "a (k, n) tuple of ints")
        ok = len(part) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in part)
        if not ok or not (part[1] >= 1 and 0 <= part[0] < part[1]):
            raise ConfigError(f"part {part!r} must be (k, n) with 0 <= k < n", "part")
    report = VerifyReport()
    owners = Owners()
    refs = owners.refs
    named = roots(repo, report)
    whole = not report.problems  # every ref and tag read (and below: every root's manifest)
    # Owners grows by several objects per reference and forms no cycles: with collection
    # on, each manifest parsed set off a full one walking all of it, so verify took
    # 2.4x as long per doubling of the history (docs/repository.md, "Checking").
    with python_gc_paused():
        for mhash, holders in sorted(named.items()):
            try:
                m = repo.read_manifest(mhash)
            except CasnapError as exc:
                report.problems.append(_problem("manifest", mhash, str(exc), holders))
                whole = whole and isinstance(exc, SnapshotNotFoundError)  # references none
                continue
            report.manifests += 1
            owners.add([*m.parts, *m.distinct_refs()], holders)  # a delta's bases, its parts
            del m  # freed before the next one is parsed
    report.chunks = len(refs)

    listed = [i for kind in ("chunks", "packs") for i in repo.store.list_info(kind)]
    present = {i.key for i in listed}
    if whole:
        used = {object_name(r) for r in refs.values()}
        try:  # a damaged frame's replacement chunks/<h> (`casnap repair`): gc keeps it
            used |= {chunk_key(c.chunk) for c in list_damage(repo) if (c.pack, c.chunk) in refs}
        except CasnapError:
            pass  # reported as a problem below
        report.unreferenced = find_unreferenced(repo, set(named), used, listed)
    stands_in = StandIns(repo, present, record=read_data)
    missing: dict[str, set[Holder]] = {}
    for key, ref in refs.items():
        obj = object_name(ref)
        if obj not in present:
            missing.setdefault(obj, set()).update(owners.affected(key, stands_in))
    for obj, holders in sorted(missing.items()):
        report.problems.append(
            _problem("missing-object", obj, "referenced but not in the store", holders)
        )

    _report_recorded(repo, owners, report, part if read_data else (0, 0), present, stands_in)

    if read_data:
        todo = [r for r in refs.values() if object_name(r) not in missing and in_part(r.hash, part)]
        spans = plan_reads(todo)
        total = sum(r.size for r in todo)  # progress in bytes re-hashed
        done = 0
        for span in spans:
            _scrub(repo, span, report, owners, stands_in)
            done += sum(ref.size for _, ref in span.items)
            if progress is not None:
                progress(done, total)
    return report


class _Probed:
    """Object keys answered by one ``exists`` each: for a check that touches few of them."""

    def __init__(self, repo: RepoStorage) -> None:
        self.repo = repo

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.repo.store.exists(key)


def check_snapshot(repo: RepoStorage, name: str) -> VerifyReport:
    """Cheap checks of one snapshot, before a restore reads its data: its ref and
    manifest read and validate, and none of the chunk copies it references has
    been recorded as damaged by an earlier read (docs/damage.md). Reads the ref,
    the manifest and the list of damage records; no chunk is fetched (a restore
    verifies every chunk's hash as it reads it).

    Example: ``if not check_snapshot(repo, "step_100").ok: ...``.
    """
    report = VerifyReport(snapshots=1)
    holders: set[Holder] = {("snapshot", name)}
    try:
        mhash = repo.read_ref(name).manifest
        manifest = repo.read_manifest(mhash)
    except CasnapError as exc:
        report.problems.append(_problem("manifest", name, f"{type(exc).__name__}: {exc}", holders))
        return report
    report.manifests = 1
    owners = Owners()
    owners.add([*manifest.parts, *manifest.distinct_refs()], holders)
    report.chunks = len(owners.refs)
    present = _Probed(repo)
    _report_recorded(repo, owners, report, (0, 0), present, StandIns(repo, present, False))
    return report


class StandIns:
    """Whether a packed delta head has a good loose ``chunks/<h>`` a read falls back to:
    read and verified with ``record`` (a ``read_data`` verify; damage it finds is
    recorded, as the restore's fallback would), else judged by its presence and
    the absence of a damage record. Each head is asked once."""

    def __init__(self, repo: RepoStorage, present: Container[str], record: bool) -> None:
        self.repo, self.present, self.record = repo, present, record
        self._seen: dict[str, bool] = {}

    def __call__(self, head: ChunkRef) -> bool:
        if head.pack is None or chunk_key(head.hash) not in self.present:
            return False
        if head.hash not in self._seen:
            if self.record:
                good = loose_copy(self.repo, head.hash, head.size) is not None
            else:
                good = not self.repo.store.exists(DamagedCopy(head.hash, None).key)
            self._seen[head.hash] = good
        return self._seen[head.hash]


def _report_recorded(
    repo: RepoStorage,
    owners: Owners,
    report: VerifyReport,
    reread: tuple[int, int] | None,
    present: Container[str],
    stands_in: Callable[[ChunkRef], bool],
) -> None:
    """Report referenced copies an earlier read recorded as damaged and this run does not re-read.

    ``reread`` is the part re-hashed now (None: all; ``(0, 0)``: none). A
    restore that met damage is then visible to a plain ``verify`` too. A
    damaged pack frame whose replacement ``chunks/<h>`` exists (written by
    ``casnap repair``) reads from the replacement: not a problem unless its
    bytes fail too, which ``--read-data`` checks.
    """
    try:
        recorded = {(c.pack, c.chunk) for c in list_damage(repo)}
    except CasnapError as exc:
        report.problems.append(Problem("damage-records", DAMAGED, f"cannot list: {exc}"))
        return
    for key in sorted(recorded & owners.refs.keys(), key=str):
        if reread != (0, 0) and in_part(key[1], reread):
            continue  # re-hashed below: reported from the bytes themselves
        if key[0] is not None and chunk_key(key[1]) in present and (None, key[1]) not in recorded:
            continue  # replaced by `casnap repair`: reads fall back to chunks/<h>
        ref = owners.refs[key]
        subject = f"{object_name(ref)} ({ref.hash[:12]})"
        detail = "recorded as damaged by an earlier read (docs/damage.md); run with --read-data"
        holders = owners.affected(key, stands_in)
        report.problems.append(_problem("corrupt-chunk", subject, detail, holders))


def _scrub(
    repo: RepoStorage,
    span: Span,
    report: VerifyReport,
    owners: Owners,
    stands_in: Callable[[ChunkRef], bool],
) -> None:
    """Fetch one object (or one range of a pack) and re-hash every chunk in it."""
    try:
        blob = fetch_span(repo, span)  # records a refused object as damage
    except (ObjectNotFoundError, ObjectRefusedError) as exc:  # refused: a FIFO, a link, ...
        users: set[Holder] = set().union(
            *(owners.affected((r.pack, r.hash), stands_in) for _, r in span.items)
        )
        kind = "missing-object" if isinstance(exc, ObjectNotFoundError) else "unreadable-object"
        report.problems.append(_problem(kind, span.key, str(exc), users))
        return
    report.bytes_read += len(blob)
    view = memoryview(blob)
    for _, ref in span.items:
        frame = (
            view
            if span.end < 0
            else view[ref.offset - span.start : ref.offset - span.start + ref.length]
        )
        try:
            decode_frame(repo, span.key, ref, frame)  # records the damage it finds
        except IntegrityError as exc:
            subject = f"{span.key} ({ref.hash[:12]})"
            holders = owners.affected((ref.pack, ref.hash), stands_in)
            report.problems.append(_problem("corrupt-chunk", subject, str(exc), holders))
        report.chunks_read += 1


def verify_config_failure(
    url: str, storage_options: dict[str, Any] | None, exc: CasnapError
) -> VerifyReport | None:
    """The report on a repository whose config is missing or damaged, so it cannot be opened.

    None when nothing of a repository is at ``url`` (no refs, manifests,
    chunks or packs): then there is no repository, not a damaged one. Else
    every snapshot is affected (no chunk size, no format without the config).
    """
    meta = open_store(url, storage_options).child(META)
    try:
        names, damaged = stored_names(meta, "refs")
        names += [f"{META}/{key}" for key, _ in damaged]  # named by their key: all are affected
        if not names and not any(next(iter(meta.list(kind)), None) for kind in _OBJECTS):
            return None
    except CasnapError:
        return None
    detail = str(exc) if not isinstance(exc, RepositoryNotFoundError) else "missing"
    if isinstance(exc, UnsupportedFormatError):
        detail += " (or the config is damaged)"
    report = VerifyReport(snapshots=len(names))
    problem = Problem("config", f"{META}/{CONFIG_KEY}", detail, tuple(names))
    report.problems.append(problem)
    return report
