"""Distributed take and restore (docs/distributed.md).

``group``: process-group and store helpers that turn a failure on any rank
into an error on every rank. ``sharded``: DTensor / ShardedTensor <-> shards
with global offsets. ``plan``: the save plan across ranks (who writes which
chunk). ``take``: the collective take. ``reshard``: reading the stored shards
that overlap a target's local shards.
"""

from casnap.errors import DistributedTakeError, ReplicaMismatchError

__all__ = ["DistributedTakeError", "ReplicaMismatchError"]
