"""Distributed take and restore (docs/distributed.md).

``group``: process-group and store helpers that turn a failure on any rank
into an error on every rank. ``plan``: the save plan across ranks (who writes
which chunk). ``take``: the collective take. Sharded values and resharding
reads live in :mod:`casnap.torch_io.sharded` and :mod:`casnap.restore.reshard`.
"""

from casnap.errors import DistributedTakeError, ReplicaMismatchError

__all__ = ["DistributedTakeError", "ReplicaMismatchError"]
