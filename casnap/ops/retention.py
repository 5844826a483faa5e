"""Retention: which snapshots to keep, planned first, then executed (docs/retention.md).

A :class:`RetentionPolicy` is a union of rules: a snapshot is kept when any
rule keeps it, and every rule that keeps it is recorded as a reason.
:func:`decide_retention` returns a :class:`RetentionDecision`, a value to print,
test or dry-run; :func:`execute_retention` deletes the refs the plan deletes
and nothing else (:func:`casnap.gc.reclaim.reclaim` and ``gc`` free the space).
Example::

    policy = RetentionPolicy(KeepLast(3), KeepEveryStep(1000), KeepBest(1, "loss"))
    plan = decide_retention(repo, policy)
    print(plan.render())  # the dry run
    execute_retention(repo, plan)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from casnap.display import format_time
from casnap.errors import (
    CasnapError,
    ConfigError,
    RetentionError,
    SnapshotNotFoundError,
    expect_type,
)
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import TagInfo, list_tags, metadata_tags

if TYPE_CHECKING:  # gc sits beside ops: the result is only carried here, never made
    from casnap.gc.reclaim import ReclaimResult


# -- what retention knows about a snapshot ---------------------------------
@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot as retention sees it: its ref, its manifest's metadata, its tags."""

    name: str
    manifest: str
    created_at: str  # the manifest's
    step: int | None  # metadata["step"] when it is an int
    metadata: Mapping[str, Any]
    tags: tuple[str, ...]  # repository tags on this snapshot, then metadata["tags"]

    @property
    def created(self) -> datetime | None:
        return parse_time(self.created_at)

    def metric(self, metric: str) -> float | None:
        """``metadata["metrics"][metric]``, else ``metadata[metric]``, as a float; ``None``
        when absent or not a number. A non-finite value stored by :func:`encode_metric`
        (``"NaN"``, ``"Infinity"``, ``"-Infinity"``) reads back as that float."""
        metrics = self.metadata.get("metrics")
        value = metrics.get(metric) if isinstance(metrics, dict) else None
        if value is None:
            value = self.metadata.get(metric)
        return decode_metric(value)


# JSON has no NaN or infinity (manifests refuse them), so a metric that is not
# finite is stored as one of these strings and read back as the float.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_metric(value: Any, key: Any = None) -> Any:
    """A metric value (of ``metrics[key]``) as manifest JSON: a 0-d tensor or numpy
    scalar becomes its Python number, a NaN or infinite float ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"`` (a diverged loss must not stop training);
    anything else is returned unchanged.

    Example: ``encode_metric(float("nan")) == "NaN"``.
    """
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (RuntimeError, ValueError) as exc:  # a tensor of several elements
            raise ConfigError(
                f"metrics[{key!r}] must be a number or a one-element tensor: {exc}", "metrics"
            ) from exc
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def decode_metric(value: Any) -> float | None:
    """The float a stored metric value means (see :func:`encode_metric`), else ``None``
    (absent, a bool, another string, a list, ...)."""
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def parse_time(text: str) -> datetime | None:
    """An ISO 8601 time as an aware datetime (naive means UTC); ``None`` if unreadable."""
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def step_of(metadata: Mapping[str, Any]) -> int | None:
    step = metadata.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def order_key(info: SnapshotInfo) -> tuple[int, int, str, str]:
    """Oldest first: by step, then by the manifest's creation time, then by name.
    Snapshots without a step sort before every snapshot with one."""
    if info.step is None:
        return (0, 0, info.created_at, info.name)
    return (1, info.step, info.created_at, info.name)


# Manifest hash -> (created_at, metadata). Manifests are immutable, so a caller
# that plans repeatedly (the Checkpointer) can keep one of these across plans.
SummaryCache = MutableMapping[str, tuple[str, Mapping[str, Any]]]


def read_snapshots(
    repo: RepoStorage,
    names: Collection[str] | None = None,
    *,
    cache: SummaryCache | None = None,
    tags: Mapping[str, TagInfo] | None = None,
) -> tuple[list[SnapshotInfo], dict[str, str]]:
    """The snapshots of ``repo`` (or only those in ``names``), oldest first, and the
    ones whose manifest cannot be read (name -> reason)."""
    if tags is None:
        tags = list_tags(repo)
    tagged: dict[tuple[str, str], list[str]] = {}
    for tag in tags.values():
        tagged.setdefault((tag.snapshot, tag.manifest), []).append(tag.tag)
    infos: list[SnapshotInfo] = []
    unreadable: dict[str, str] = {}
    for name in repo.list_snapshots():
        if names is not None and name not in names:
            continue
        try:
            manifest = repo.resolve(name)
        except SnapshotNotFoundError:
            continue  # deleted since the listing
        summary = cache.get(manifest) if cache is not None else None
        if summary is None:
            try:
                m = repo.read_manifest(manifest)
            except CasnapError as exc:
                unreadable[name] = f"manifest unreadable ({type(exc).__name__})"
                continue
            summary = (m.created_at, dict(m.metadata))
            if cache is not None:
                cache[manifest] = summary
        created_at, metadata = summary
        repo_tags = tuple(tagged.get((name, manifest), ()))
        extra = tuple(t for t in metadata_tags(metadata) if t not in repo_tags)
        infos.append(
            SnapshotInfo(name, manifest, created_at, step_of(metadata), metadata, repo_tags + extra)
        )
    infos.sort(key=order_key)
    return infos, unreadable


# -- rules ------------------------------------------------------------------
class RetentionRule(ABC):
    """One reason to keep snapshots."""

    @abstractmethod
    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        """The names this rule keeps among ``snapshots`` (oldest first), each with a reason."""


def _check_count(rule: str, n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise RetentionError(f"{rule} needs a non-negative integer count, got {n!r}")


@dataclass(frozen=True)
class KeepLast(RetentionRule):
    """Keep the ``n`` newest snapshots (by step, else by creation time)."""

    n: int

    def __post_init__(self) -> None:
        _check_count("KeepLast", self.n)

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        newest = snapshots[max(0, len(snapshots) - self.n) :] if self.n else []
        return {s.name: f"last {self.n}" for s in newest}


@dataclass(frozen=True)
class KeepEveryStep(RetentionRule):
    """Keep snapshots whose ``metadata["step"]`` is a multiple of ``k``."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise RetentionError(f"KeepEveryStep needs a positive step interval, got {self.k!r}")

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        return {
            s.name: f"every {self.k} steps"
            for s in snapshots
            if s.step is not None and s.step % self.k == 0
        }


@dataclass(frozen=True, init=False)
class KeepWithin(RetentionRule):
    """Keep snapshots created at most ``seconds`` before ``now`` (later ones too: clock skew)."""

    seconds: float

    def __init__(self, seconds: float | timedelta) -> None:
        value = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if not value >= 0:  # also refuses NaN
            raise RetentionError(f"KeepWithin needs a non-negative window, got {seconds!r}")
        object.__setattr__(self, "seconds", value)

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        since = now - timedelta(seconds=self.seconds)
        out = {}
        for s in snapshots:
            created = s.created
            if created is not None and created >= since:
                out[s.name] = f"within {self.seconds:g}s"
        return out


class KeepNames(RetentionRule):
    """Keep the snapshots ``names`` (a Checkpointer keeps its newest one)."""

    def __init__(self, names: Iterable[str], reason: str) -> None:
        self.names = frozenset(names)
        self.reason = reason

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        return {s.name: self.reason for s in snapshots if s.name in self.names}


@dataclass(frozen=True, init=False)
class KeepTagged(RetentionRule):
    """Keep snapshots with any tag, or with one of ``tags``. Repository tags on the
    snapshot (:mod:`casnap.repo.tags`) and its ``metadata["tags"]`` both count."""

    tags: frozenset[str] | None

    def __init__(self, tags: Iterable[str] | str | None = None) -> None:
        wanted = None if tags is None else frozenset([tags] if isinstance(tags, str) else tags)
        object.__setattr__(self, "tags", wanted)

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        out = {}
        for s in snapshots:
            hits = [t for t in s.tags if self.tags is None or t in self.tags]
            if hits:
                out[s.name] = "tagged " + ",".join(hits)
        return out


@dataclass(frozen=True)
class KeepBest(RetentionRule):
    """Keep the ``n`` best snapshots by ``metric`` (``metadata["metrics"][metric]``,
    else ``metadata[metric]``); ``mode="min"`` means lower is better. A snapshot
    without a finite numeric value (absent, NaN, infinite, not a number) is never
    best, in either mode; ties favour the newer one."""

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _check_count("KeepBest", self.n)
        if self.mode not in ("min", "max"):
            raise RetentionError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        scored = []
        for position, s in enumerate(snapshots):
            value = s.metric(self.metric)
            # A NaN loss is a diverged run, not a record; +inf is no best "max" either.
            if value is not None and math.isfinite(value):
                scored.append((value if self.mode == "min" else -value, -position, s.name))
        scored.sort()
        reason = f"best {self.n} by {self.metric} ({self.mode})"
        return {name: reason for _, _, name in scored[: self.n]}


@dataclass(frozen=True, init=False)
class RetentionPolicy:
    """A union of rules: ``RetentionPolicy(KeepLast(3), KeepEveryStep(1000))``."""

    rules: tuple[RetentionRule, ...]

    def __init__(self, *rules: RetentionRule) -> None:
        for rule in rules:
            if not isinstance(rule, RetentionRule):
                raise RetentionError(f"{rule!r} is not a retention rule")
        object.__setattr__(self, "rules", tuple(rules))

    def select(
        self, snapshots: Sequence[SnapshotInfo], now: datetime
    ) -> dict[str, tuple[str, ...]]:
        """Every kept name with the reasons of every rule that keeps it."""
        keep: dict[str, list[str]] = {}
        for rule in self.rules:
            for name, reason in rule.select(snapshots, now).items():
                keep.setdefault(name, []).append(reason)
        return {name: tuple(reasons) for name, reasons in keep.items()}


# -- plan and execute --------------------------------------------------------
@dataclass(frozen=True)
class RetentionDecision:
    """What retention would do; nothing has been deleted yet.

    ``keep`` maps each kept snapshot to its reasons; ``delete`` lists the
    refs to delete, oldest first; ``snapshots`` is everything considered.
    """

    keep: dict[str, tuple[str, ...]]
    delete: tuple[str, ...]
    snapshots: tuple[SnapshotInfo, ...]
    now: str
    tags_seen: frozenset[str]  # repository tags that existed when planning

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for ``--json`` output and scripts)."""
        doomed = set(self.delete)
        return {
            "now": self.now,
            "keep": {name: list(reasons) for name, reasons in sorted(self.keep.items())},
            "delete": list(self.delete),
            "snapshots": [
                {
                    "name": s.name,
                    "manifest": s.manifest,
                    "step": s.step,
                    "created_at": s.created_at,
                    "tags": list(s.tags),
                    "action": "delete" if s.name in doomed else "keep",
                    "reasons": list(self.keep.get(s.name, ())),
                }
                for s in self.snapshots
            ],
        }

    def render(self) -> str:
        """A table for humans, oldest first, then a one-line summary."""
        rows = [("ACTION", "SNAPSHOT", "STEP", "CREATED", "REASONS")]
        doomed = set(self.delete)
        seen = set()
        for s in self.snapshots:
            seen.add(s.name)
            action = "delete" if s.name in doomed else "keep"
            step = "-" if s.step is None else str(s.step)
            rows.append(
                (
                    action,
                    s.name,
                    step,
                    format_time(s.created_at),
                    ", ".join(self.keep.get(s.name, ())),
                )
            )
        for name, reasons in sorted(self.keep.items()):
            if name not in seen:  # unreadable manifests, kept to be safe
                rows.append(("keep", name, "?", "?", ", ".join(reasons)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        lines.append(
            f"{len(self.keep)} kept, {len(self.delete)} to delete "
            "(refs; prune or gc reclaims the space)"
        )
        return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class RetentionResult:
    """What :func:`execute_retention` did: refs deleted, and refs it left alone and why.

    ``plan`` is the plan that was executed; ``dry_run`` is true when it was
    only planned (``casnap.Repository.retain(..., dry_run=True)``), in which
    case nothing was deleted or skipped. ``reclaimed`` is what the reclaim
    after it freed (``Repository.retain(..., prune=True)``, the Checkpointer),
    None when none ran.
    """

    deleted: tuple[str, ...]
    skipped: dict[str, str]
    plan: RetentionDecision | None = None
    dry_run: bool = False
    reclaimed: ReclaimResult | None = None

    @property
    def retired_manifests(self) -> tuple[str, ...]:
        """The manifests of the deleted refs: what a reclaim may delete now."""
        if self.plan is None:
            return ()
        manifest = {s.name: s.manifest for s in self.plan.snapshots}
        return tuple(manifest[n] for n in self.deleted if n in manifest)


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    return now if now.tzinfo is not None else now.replace(tzinfo=UTC)


def decide_retention(
    repo: RepoStorage,
    policy: RetentionPolicy | RetentionRule,
    now: datetime | None = None,
    *,
    names: Collection[str] | None = None,
    allow_delete_all: bool = False,
    cache: SummaryCache | None = None,
) -> RetentionDecision:
    """Decide which snapshots ``policy`` keeps; reads manifests, deletes nothing.

    ``now`` (default: the current time; naive means UTC) anchors
    :class:`KeepWithin`. ``names`` restricts retention to those snapshots;
    the others are neither kept nor deleted. A snapshot whose manifest cannot
    be read is kept. A plan that would delete every snapshot, and any plan of
    an empty policy, raises :class:`RetentionError` unless ``allow_delete_all``.

    Example: ``print(decide_retention(repo, RetentionPolicy(KeepLast(2))).render())``.
    """
    expect_type(repo, RepoStorage, "repo", "a casnap repository")
    if isinstance(policy, RetentionRule):
        policy = RetentionPolicy(policy)
    expect_type(policy, RetentionPolicy, "policy", "a casnap.RetentionPolicy (or one rule)")
    if not policy.rules and not allow_delete_all:
        raise RetentionError(
            "an empty retention policy keeps nothing and would delete every snapshot; "
            "give it rules, or pass allow_delete_all=True to mean exactly that"
        )
    at = _now(now)
    tags = list_tags(repo)
    infos, unreadable = read_snapshots(repo, names, cache=cache, tags=tags)
    keep = policy.select(infos, at)
    keep.update({name: (reason,) for name, reason in unreadable.items()})
    delete = tuple(s.name for s in infos if s.name not in keep)
    if delete and not keep and not allow_delete_all:
        raise RetentionError(
            f"the policy keeps none of the {len(delete)} snapshots in {repo.url}; "
            "pass allow_delete_all=True to delete them all"
        )
    return RetentionDecision(keep, delete, tuple(infos), at.isoformat(), frozenset(tags))


def execute_retention(repo: RepoStorage, plan: RetentionDecision) -> RetentionResult:
    """Delete the refs ``plan`` deletes (only refs: a reclaim or gc deletes the rest).

    Each ref is re-read first and left alone if it changed since the plan:
    already gone, now naming another manifest, or tagged by a tag the plan
    did not see. Returns what was deleted and what was skipped, with reasons.
    """
    tagged_since: dict[str, list[str]] = {}
    for tag in list_tags(repo).values():
        if tag.tag not in plan.tags_seen:
            tagged_since.setdefault(tag.snapshot, []).append(tag.tag)
    planned = {s.name: s.manifest for s in plan.snapshots}
    deleted: list[str] = []
    skipped: dict[str, str] = {}
    for name in plan.delete:
        try:
            current = repo.resolve(name)
        except SnapshotNotFoundError:
            skipped[name] = "already deleted"
            continue
        if current != planned.get(name):
            skipped[name] = "ref changed since the plan"
        elif name in tagged_since:
            skipped[name] = "tagged since the plan: " + ",".join(tagged_since[name])
        else:
            repo.delete_ref(name)
            deleted.append(name)
    return RetentionResult(tuple(deleted), skipped, plan)
