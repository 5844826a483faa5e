"""torch.distributed.checkpoint (DCP) over casnap: each ``dcp.save`` becomes a casnap snapshot.

Swap DCP's ``FileSystemWriter``/``FileSystemReader`` for these and a save is
deduplicated against earlier saves (only changed chunks are written), every
read is verified, and ``casnap log/du/diff/verify/gc`` and retention work on
the checkpoints (docs/dcp.md)::

    import torch.distributed.checkpoint as dcp
    from casnap.integrations.dcp import CasnapReader, CasnapWriter

    dcp.save({"model": model.state_dict()}, storage_writer=CasnapWriter("/ckpt/run1/step_100"))
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=CasnapReader("/ckpt/run1/step_100"))

Importing this module imports torch.
"""

from __future__ import annotations

from casnap.integrations.dcp_reader import CasnapReader
from casnap.integrations.dcp_writer import HISTORY_SEP, CasnapWriter

__all__ = ["HISTORY_SEP", "CasnapReader", "CasnapWriter"]
