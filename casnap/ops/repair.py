"""repair: write good copies of damaged or missing chunks, then say what stays unrecoverable.

The model is restic's ``repair``, reduced to what content addressing makes
safe (docs/damage.md, "Repair"): any bytes that hash to a chunk's name are
the chunk. :func:`find_repairs` finds every bad copy a ref or tag reaches and
asks the sources (:mod:`casnap.ops.repair_sources`) in turn for its bytes;
executing puts the verified bytes at ``chunks/<h>``, durably, and rewrites no
manifest, ref, tag or pack, so a repair killed at any point leaves every
snapshot at least as restorable as before. What no source supplies is
reported per snapshot and tag as unrecoverable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from casnap.chunks.decode import loose_copy
from casnap.chunks.frames import encode_chunk
from casnap.chunks.read import object_name
from casnap.errors import CasnapError, IntegrityError
from casnap.format import codec
from casnap.format.entries import DTYPE_ITEMSIZE, ChunkRef, ShardedEntry, TensorEntry, chunks_of
from casnap.format.manifest import Manifest
from casnap.format.names import digest_of
from casnap.format.parse import MAX_MANIFEST_BYTES, manifest_part_refs
from casnap.ops.repair_sources import ChunkSource, FromDeltas, RepoCopies
from casnap.ops.verify import Holder, Owners, StandIns, VerifyReport, roots, verify
from casnap.repo.damage import DamagedCopy, clear_damage, list_damage
from casnap.repo.leases import hold_lease
from casnap.repo.repository import RepoStorage, chunk_key, manifest_key
from casnap.settings import Settings

Progress = Callable[[int, int], None]  # progress(done_bytes, total_bytes)
Buffer = codec.Buffer


@dataclass(frozen=True)
class BadChunk:
    """A chunk some root needs whose referenced copies include a bad one."""

    chunk: str
    size: int
    copies: tuple[str, ...]  # the bad copies: object keys, "missing" or "damaged"
    holders: frozenset[Holder]
    elem_size: int  # what a take groups the chunk's bytes by: a float's size, else 0
    fixable_here: bool = True  # False: a copy inside a missing pack (reads cannot fall back)


@dataclass(frozen=True)
class Fix:
    chunk: str
    source: str  # the source's label, or "" if none supplies it


@dataclass
class RepairFindings:
    bad: list[BadChunk] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    already: list[str] = field(default_factory=list)  # chunks whose chunks/<h> is good already
    broken_roots: dict[Holder, str] = field(default_factory=dict)  # ref/tag/manifest problems
    parts: set[str] = field(default_factory=set)  # the parts of unreadable manifests
    holders: set[Holder] = field(default_factory=set)

    def render(self) -> str:
        by = {f.chunk: f.source for f in self.fixes}
        lines = [f"{len(self.bad)} bad chunk(s)"]
        for b in self.bad:
            src = by.get(b.chunk) or ("(no source)" if b.chunk not in self.already else "")
            what = "already replaced" if b.chunk in self.already else f"from {src}"
            lines.append(f"  {b.chunk[:16]} ({', '.join(b.copies)}): {what}")
        return "\n".join(lines)


@dataclass(frozen=True)
class RootStatus:
    """One snapshot or tag after repair: ``ok``, ``repaired`` or ``unrecoverable``."""

    kind: str  # "snapshot" or "tag"
    name: str
    status: str
    missing: tuple[str, ...] = ()  # chunks (or the manifest/ref problem) still unreadable


@dataclass
class RepairResult:
    plan: RepairFindings
    dry_run: bool
    written: list[str] = field(default_factory=list)  # chunks written to chunks/<h>
    roots: list[RootStatus] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every snapshot and tag is restorable (after the repair, or a dry run's)."""
        return all(r.status != "unrecoverable" for r in self.roots)

    @property
    def unrecoverable(self) -> list[str]:
        return [r.name for r in self.roots if r.status == "unrecoverable" and r.kind == "snapshot"]

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "dry_run": self.dry_run,
            "bad_chunks": len(self.plan.bad),
            "written": self.written,
            "already_replaced": self.plan.already,
            "roots": [asdict(r) for r in self.roots],
        }

    def render(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        shown = self.plan.fixes if self.dry_run else [Fix(c, "") for c in self.written]
        lines = [
            f"{verb} chunks/{f.chunk[:16]}…" + (f" from {f.source}" if f.source else "")
            for f in shown
        ]
        for r in self.roots:
            if r.status == "ok":
                continue
            status = "repairable" if self.dry_run and r.status == "repaired" else r.status
            tail = f": missing {', '.join(m[:16] for m in r.missing)}" if r.missing else ""
            lines.append(f"{r.kind} {r.name}: {status}{tail}")
        bad = len(self.unrecoverable) + sum(
            r.status == "unrecoverable" and r.kind == "tag" for r in self.roots
        )
        lines.append(
            f"{len(self.plan.bad)} bad chunk(s), {len(shown)} {verb.split()[-1]}; "
            + (
                "every snapshot restorable"
                if self.ok
                else f"{bad} snapshot(s)/tag(s) unrecoverable"
            )
            + (" (dry run)" if self.dry_run else "")
        )
        return "\n".join(lines)


def find_bad(
    repo: RepoStorage, *, read_data: bool = False, progress: Progress | None = None
) -> RepairFindings:
    """The bad referenced chunks (recorded damaged or missing) and the unreadable roots.

    With ``read_data``, ``progress`` follows the re-hash (bytes, as in verify)."""
    plan = RepairFindings()
    if read_data:
        verify(repo, read_data=True, progress=progress)  # records every damaged copy it re-hashes
    report = VerifyReport()
    owners = Owners()  # who needs each copy: directly, or through a delta on it
    elems: dict[str, int] = {}
    for mhash, holders in sorted(roots(repo, report).items()):
        plan.holders |= holders
        try:
            manifest = repo.read_manifest(mhash)
        except CasnapError as exc:
            for holder in holders:
                plan.broken_roots[holder] = f"manifest {mhash}: {exc}"
            parts = _part_refs(repo, mhash)  # a lost part is repaired as a chunk is
            owners.add(parts, holders)
            plan.parts.update(p.hash for p in parts)
            continue
        owners.add([*manifest.parts, *manifest.distinct_refs()], holders)
        elems.update(element_sizes(manifest))
    for p in report.problems:  # unreadable refs and tags
        plan.holders.add((p.kind if p.kind == "tag" else "snapshot", p.subject))
        plan.broken_roots[(p.kind if p.kind == "tag" else "snapshot", p.subject)] = p.detail
    recorded = set(list_damage(repo))
    present = set(repo.store.list("chunks")) | set(repo.store.list("packs"))
    stands_in = StandIns(repo, present, record=False)
    refs: dict[str, list[ChunkRef]] = {}
    for ref in owners.refs.values():
        refs.setdefault(ref.hash, []).append(ref)
    for h, uses in sorted(refs.items()):
        copies: list[str] = []
        needs: set[Holder] = set()
        in_lost_pack = False
        for ref in uses:
            key = object_name(ref)
            if key not in present:
                copies.append(f"{key} (missing)")
                in_lost_pack = in_lost_pack or ref.pack is not None
            elif DamagedCopy.of(ref) in recorded:
                copies.append(f"{key} (damaged)")
            else:
                continue
            needs |= owners.affected((ref.pack, ref.hash), stands_in)
        if copies:
            bad = BadChunk(
                h,
                uses[0].size,
                tuple(sorted(set(copies))),
                frozenset(needs),
                elems.get(h, 0),
                not in_lost_pack,
            )
            plan.bad.append(bad)
    return plan


def _part_refs(repo: RepoStorage, mhash: str) -> list[ChunkRef]:
    try:
        return manifest_part_refs(
            repo.store.get(manifest_key(mhash), limit=MAX_MANIFEST_BYTES), mhash
        )
    except CasnapError:
        return []


def element_sizes(manifest: Manifest) -> dict[str, int]:
    """The element size a take groups each float tensor's chunks by (codec ``elem_size``),
    by chunk hash; chunks of other values are absent (grouped by nothing)."""
    out: dict[str, int] = {}
    for entry in manifest.entries.values():
        if not isinstance(entry, TensorEntry | ShardedEntry):
            continue
        if not entry.dtype.startswith(("float", "bfloat")):
            continue  # torch groups floats only (casnap.take.scheduler.tensor_request)
        elem = DTYPE_ITEMSIZE.get(entry.dtype, 0)
        out.update((c.hash, elem) for ref in chunks_of(entry) for c in ref.chain())
    return out


def find_repairs(
    repo: RepoStorage,
    sources: Sequence[ChunkSource] = (),
    *,
    read_data: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RepairFindings:
    """Find the bad chunks and, for each, the first source whose bytes hash to its name."""
    plan = find_bad(repo, read_data=read_data, progress=progress)
    recorded = set(list_damage(repo))
    total = sum(bad.size for bad in plan.bad)
    deltas = FromDeltas(repo, sources)
    done = 0
    for bad in plan.bad:
        digest = bytes.fromhex(bad.chunk)
        done += bad.size
        # A frame of a pack that is gone cannot fall back (its read fails first).
        if (
            bad.fixable_here
            and DamagedCopy(bad.chunk, None) not in recorded
            and (loose_copy(repo, bad.chunk, bad.size, record=not dry_run) is not None)
        ):
            plan.already.append(bad.chunk)  # a good chunks/<h> stands in for a pack frame
            if progress is not None:
                progress(done, total)
            continue
        found = ""
        if bad.fixable_here:
            for source in _sources(repo, bad, dry_run, sources, deltas):
                data = source.fetch(bad.chunk, bad.size)
                if data is not None and len(data) == bad.size and digest_of(data) == digest:
                    found = source.label
                    break
        plan.fixes.append(Fix(bad.chunk, found))
        if progress is not None:
            progress(done, total)
    return plan


def _sources(
    repo: RepoStorage,
    bad: BadChunk,
    dry_run: bool,
    given: Sequence[ChunkSource],
    deltas: FromDeltas,
) -> list[ChunkSource]:
    """Where a bad chunk's bytes may come from, in the order they are asked."""
    return [RepoCopies(repo, bad.copies, dry_run), *given, deltas]


def execute_repair(
    repo: RepoStorage,
    plan: RepairFindings,
    sources: Sequence[ChunkSource] = (),
    *,
    progress: Progress | None = None,
) -> RepairResult:
    """Write every chunk the plan found a source for; then report per snapshot and tag.

    Held under a lease (kind ``repair``), so no gc sweeps while replacements
    are written. Each chunk is fetched again, verified against its hash, put
    atomically at ``chunks/<h>``, made durable and read back before a loose
    damage record is deleted.
    """
    result = RepairResult(plan, dry_run=False)
    todo = [f for f in plan.fixes if f.source]
    by_chunk = {b.chunk: b for b in plan.bad}
    deltas = FromDeltas(repo, sources)
    total = sum(by_chunk[f.chunk].size for f in todo)
    done = 0
    with hold_lease(repo, kind="repair") as lease:
        for fix in todo:
            bad = by_chunk[fix.chunk]
            done += bad.size
            data = _fetch(repo, bad, fix.source, sources, deltas)
            if data is not None:  # else the source changed since the plan: the chunk stays bad
                lease.check()
                _write(repo, bad, data)
                result.written.append(fix.chunk)
            if progress is not None:
                progress(done, total)
    result.roots = statuses(plan, set(result.written) | set(plan.already))
    return result


def _fetch(
    repo: RepoStorage,
    bad: BadChunk,
    label: str,
    sources: Sequence[ChunkSource],
    deltas: FromDeltas,
) -> Buffer | None:
    for source in _sources(repo, bad, True, sources, deltas):
        if source.label != label:
            continue
        data = source.fetch(bad.chunk, bad.size)
        if (
            data is not None
            and len(data) == bad.size
            and digest_of(data) == bytes.fromhex(bad.chunk)
        ):
            return data
    return None


def _write(repo: RepoStorage, bad: BadChunk, data: Buffer) -> None:
    """Put the verified bytes at chunks/<h>, durably; read them back; drop a loose record."""
    digest = bytes.fromhex(bad.chunk)
    # What a take with this repository's settings writes: any valid frame of the
    # chunk serves every reference to chunks/<h> (docs/format.md, "Loose objects").
    head, payload = encode_chunk(data, digest, Settings.from_env(), bad.elem_size)
    key = chunk_key(bad.chunk)
    repo.store.put(key, [head, payload])  # atomic replace, durable
    if loose_copy(repo, bad.chunk, bad.size) is None:
        raise IntegrityError(f"{key}: the repaired copy does not read back", key)
    clear_damage(repo, [DamagedCopy(bad.chunk, None)] if _recorded_loose(repo, bad) else [])


def _recorded_loose(repo: RepoStorage, bad: BadChunk) -> bool:
    return repo.store.exists(DamagedCopy(bad.chunk, None).key)


def statuses(plan: RepairFindings, fixed: set[str]) -> list[RootStatus]:
    """Per snapshot and tag: ok, repaired (every bad chunk fixed) or unrecoverable."""
    out = []
    for holder in sorted(plan.holders):
        kind, name = holder
        if holder in plan.broken_roots:
            out.append(RootStatus(kind, name, "unrecoverable", (plan.broken_roots[holder],)))
            continue
        mine = [b for b in plan.bad if holder in b.holders]
        left = tuple(b.chunk for b in mine if b.chunk not in fixed)
        status = "unrecoverable" if left else ("repaired" if mine else "ok")
        out.append(RootStatus(kind, name, status, left))
    return out


def repair(
    repo: RepoStorage,
    sources: Sequence[ChunkSource] = (),
    *,
    read_data: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RepairResult:
    """Plan, then (unless ``dry_run``) execute; see the module docstring."""
    plan = find_repairs(repo, sources, read_data=read_data, dry_run=dry_run, progress=progress)
    if dry_run:
        fixable = {f.chunk for f in plan.fixes if f.source} | set(plan.already)
        return RepairResult(plan, dry_run=True, roots=statuses(plan, fixable))
    result = execute_repair(repo, plan, sources, progress=progress)
    if plan.parts & set(result.written):  # a manifest readable again: its chunks next
        again = repair(repo, sources, progress=progress)
        again.plan.fixes[:0] = plan.fixes
        again.written[:0] = result.written
        return again
    return result
