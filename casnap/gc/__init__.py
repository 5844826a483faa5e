"""Garbage collection: plan what no root reaches, then sweep it (docs/gc.md).

:mod:`casnap.gc.collect` holds the session (lock, epoch, sweep) and the
one-call API, :mod:`casnap.gc.plan` the plan, made from the mark phase of
:mod:`casnap.gc.mark`; :mod:`casnap.gc.reclaim` runs a gc narrowed to what
retention just retired, with no grace period. All use only the store contract
(:mod:`casnap.store.base`).
"""

from casnap.errors import GcRefusedError
from casnap.gc.collect import (
    GcResult,
    GcSession,
    execute_gc,
    gc,
    gc_in_progress,
    read_gc_epoch,
    sweep_list,
)
from casnap.gc.plan import GcSweep
from casnap.gc.reclaim import ReclaimResult, reclaim

__all__ = [
    "GcSweep",
    "GcRefusedError",
    "GcResult",
    "GcSession",
    "ReclaimResult",
    "execute_gc",
    "gc",
    "gc_in_progress",
    "sweep_list",
    "read_gc_epoch",
    "reclaim",
]
