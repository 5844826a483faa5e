"""Garbage collection: plan what no root reaches, then sweep it (docs/gc.md).

:mod:`casnap.gc.collect` holds the session and the one-call API,
:mod:`casnap.gc.plan` the mark phase and the plan, :mod:`casnap.gc.reclaim` the
grace-free sweep of what retention just retired. All use only the store
contract (:mod:`casnap.store.base`).
"""

from casnap.errors import GcRefusedError
from casnap.gc.collect import (
    GcResult,
    GcSession,
    execute_gc,
    gc,
    gc_in_progress,
    plan_gc,
    read_gc_epoch,
)
from casnap.gc.plan import GcPlan
from casnap.gc.reclaim import ReclaimResult, reclaim

__all__ = [
    "GcPlan",
    "GcRefusedError",
    "GcResult",
    "GcSession",
    "ReclaimResult",
    "execute_gc",
    "gc",
    "gc_in_progress",
    "plan_gc",
    "read_gc_epoch",
    "reclaim",
]
