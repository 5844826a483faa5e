"""A Checkpointer's options, in one checked value: when to take, how, what to keep, where to mirror.

:class:`CheckpointerOptions` is a frozen dataclass holding every option of
:class:`casnap.api.checkpointer.Checkpointer` but the repository, checked
when it is made. The Checkpointer takes its fields as keyword arguments
(``Checkpointer(url, every_n_steps=500, async_take=True)``, as the README
shows) or as one value, for a script that builds its options once::

    options = CheckpointerOptions(every_n_steps=500, async_take=True)
    ckpt = Checkpointer("/ckpt/run1", options=options)
    other = Checkpointer("/ckpt/run2", options=options, every_n_steps=100)  # one changed

:class:`CheckpointerKeywords` types those keyword arguments (PEP 692).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypedDict

from casnap.api.checkpointer_triggers import Clock
from casnap.api.repository import Repository
from casnap.errors import CasnapError, ConfigError, as_names, expect_type
from casnap.format.names import check_ref_name
from casnap.gc.reclaim import RECLAIM_WAIT_SECONDS
from casnap.ops.retention import RetentionPolicy, RetentionRule, encode_metric
from casnap.repo.repository import RepoStorage
from casnap.take.session import Session


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every option of a Checkpointer but its repository.

    The triggers (``every_n_steps``, ``every_seconds``, ``take_on_close``,
    ``take_on_preemption``, on the monotonic ``clock``) are described on
    :class:`~casnap.api.checkpointer.Checkpointer`. The others:

    - ``retention``: a :class:`~casnap.ops.retention.RetentionPolicy` applied to this
      checkpointer's snapshots after each commit (the newest is always kept; its
      first ``KeepBest`` rule is what :meth:`best` ranks by).
    - ``async_take``: write in the background; a new take first waits for the
      previous one. The state is copied before ``maybe_take`` returns.
    - ``name_format``: the snapshot name, formatted with ``step=``.
    - ``storage_options``: as for :meth:`Snapshot.take` (fsspec options,
      ``chunk_size``, ``compression``, or ``repository``: a
      :class:`~casnap.Repository` to use instead of opening ``repo_url``).
    - ``tags``: stored in every snapshot's ``metadata["tags"]``.
    - ``reclaim`` / ``reclaim_wait_seconds``: whether retention then frees what only
      the retired snapshots reached, and how long that waits for other processes'
      takes (default 1 s; docs/retention.md, "Retention").
    - ``mirror``: a second repository (``"gs://bucket/run1"``, or a
      :class:`~casnap.Repository`) each committed snapshot is copied to in the
      background, with ``mirror_storage_options``, ``mirror_retention`` (default:
      ``retention``) and ``mirror_queue`` (docs/copy.md, "The Checkpointer's mirror").
    - ``session``: the :class:`casnap.Session` the takes share (default: a new one).

    Checked when made: a wrong type or value raises :class:`ConfigError`
    naming the option. ``retention`` given as one rule becomes a
    :class:`RetentionPolicy` of it; ``tags`` become a tuple of checked names.
    """

    # When to take.
    every_n_steps: int | None = None
    every_seconds: float | timedelta | None = None
    take_on_close: bool = False
    take_on_preemption: bool | int | Iterable[int] = False
    clock: Clock = time.monotonic
    # How to take.
    async_take: bool = False
    name_format: str = "step_{step:09d}"
    storage_options: dict[str, Any] | None = None
    tags: Iterable[str] | None = None
    session: Session | None = None
    # What to keep.
    retention: RetentionPolicy | RetentionRule | None = None
    reclaim: bool = True
    reclaim_wait_seconds: float = RECLAIM_WAIT_SECONDS
    # A second repository each committed snapshot is copied to.
    mirror: str | Repository | RepoStorage | None = None
    mirror_storage_options: dict[str, Any] | None = None
    mirror_retention: RetentionPolicy | RetentionRule | None | Literal["same"] = "same"
    mirror_queue: int = 2

    def __post_init__(self) -> None:
        retention = self.retention
        if isinstance(retention, RetentionRule):
            retention = RetentionPolicy(retention)
        if retention is not None:
            expect_type(retention, RetentionPolicy, "retention", "a casnap.RetentionPolicy or None")
        object.__setattr__(self, "retention", retention)
        expect_type(self.name_format, str, "name_format", "a format string like 'step_{step:09d}'")
        expect_type(self.take_on_close, bool, "take_on_close", "True or False")
        expect_type(self.reclaim, bool, "reclaim", "True or False")
        expect_type(self.reclaim_wait_seconds, (int, float), "reclaim_wait_seconds", "seconds")
        if self.reclaim_wait_seconds < 0:
            raise ConfigError(
                f"reclaim_wait_seconds must not be negative, got {self.reclaim_wait_seconds}",
                "reclaim_wait_seconds",
            )
        tags = as_names(self.tags, "tags")
        object.__setattr__(self, "tags", tuple(check_ref_name(t) for t in (tags or [])))
        try:  # a bad format fails here, not at the first take
            check_ref_name(self.name_format.format(step=0))
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, CasnapError):
                raise
            raise ConfigError(
                f"name_format {self.name_format!r} must name snapshots from {{step}}: {exc!r}",
                "name_format",
            ) from exc


class CheckpointerKeywords(TypedDict, total=False):
    """The keyword arguments of ``Checkpointer(...)``: the fields of
    :class:`CheckpointerOptions` (tests/test_checkpointer_features.py checks they match)."""

    every_seconds: float | timedelta | None
    take_on_close: bool
    take_on_preemption: bool | int | Iterable[int]
    clock: Clock
    async_take: bool
    name_format: str
    storage_options: dict[str, Any] | None
    tags: Iterable[str] | None
    session: Session | None
    retention: RetentionPolicy | RetentionRule | None
    reclaim: bool
    reclaim_wait_seconds: float
    mirror: str | Repository | RepoStorage | None
    mirror_storage_options: dict[str, Any] | None
    mirror_retention: RetentionPolicy | RetentionRule | None | Literal["same"]
    mirror_queue: int


def plain_metric(key: Any, value: Any) -> Any:
    """Metric values as JSON: a 0-d tensor or numpy scalar becomes its Python number,
    and a NaN or infinite one the string ``"NaN"``/``"Infinity"``/``"-Infinity"``
    (JSON has no such numbers; a diverged loss must not stop training)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (RuntimeError, ValueError) as exc:  # a tensor of several elements
            raise ConfigError(
                f"metrics[{key!r}] must be a number or a one-element tensor: {exc}", "metrics"
            ) from exc
    return encode_metric(value)
