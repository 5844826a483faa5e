"""FSDP2 models and optimizers of a ``CasnapAccelerator``, through casnap's DCP writer.

Accelerate's own FSDP ``save_state`` saves each model's and optimizer's
sharded state dict with ``dcp.save(..., FileSystemWriter(<folder>/pytorch_model_fsdp_<i>))``;
here they go, together, into one DCP snapshot ``<S>.fsdp`` beside the
folder's snapshot ``S`` (``checkpoint_3.fsdp``; ``best@1.fsdp`` for a re-save
into ``best``), taken after it and before the folder's pointer names ``S``,
written by :class:`~casnap.integrations.dcp.CasnapWriter`
and read back (resharded by DCP onto the loading world) by
:class:`~casnap.integrations.dcp.CasnapReader`. Only FSDP2 with
``SHARDED_STATE_DICT`` (Accelerate's default) is handled; docs/accelerate.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from casnap.integrations.dcp import CasnapReader, CasnapWriter
from casnap.take.session import Session

SUFFIX = ".fsdp"  # snapshot <S>.fsdp: the sharded models and optimizers of snapshot S


def handled(acc: Any) -> bool:
    """Whether ``acc`` runs FSDP2 with sharded state dicts (what this module saves)."""
    if acc.distributed_type != DistributedType.FSDP:
        return False
    plugin = acc.state.fsdp_plugin
    kind = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    return plugin.fsdp_version == 2 and kind == "SHARDED_STATE_DICT"


def fsdp_path(folder: str, snapshot: str) -> str:
    """The path of the sharded state of ``folder``'s snapshot ``snapshot`` (beside it)."""
    return os.path.join(os.path.dirname(folder.rstrip("/\\")), snapshot.split("/")[-1] + SUFFIX)


def _options(acc: Any) -> StateDictOptions:
    config = acc.state.fsdp_plugin.state_dict_config
    return StateDictOptions(cpu_offload=bool(getattr(config, "offload_to_cpu", False)))


def _state(acc: Any, models: list[Any]) -> dict[str, Any]:
    """Each model's sharded state dict, and each optimizer's (optimizer i goes with model i)."""
    options = _options(acc)
    state: dict[str, Any] = {
        f"model_{i}": get_model_state_dict(m, options=options) for i, m in enumerate(models)
    }
    for i, opt in enumerate(acc._optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(acc._models[i], opt, options=options)
    return state


def save(acc: Any, path: str, metadata: dict[str, Any], session: Session) -> None:
    """Save the sharded models and optimizers as the snapshot at ``path`` (every rank)."""
    writer = CasnapWriter(path, metadata=metadata, session=session)
    dcp.save(_state(acc, acc._models), storage_writer=writer)


def load(acc: Any, path: str, models: list[Any]) -> None:
    """Load the snapshot at ``path`` into the prepared models and optimizers (every rank)."""
    state = _state(acc, models)
    dcp.load(state, storage_reader=CasnapReader(path))
    options = _options(acc)
    for i, m in enumerate(models):
        set_model_state_dict(m, state[f"model_{i}"], options=options)
    for i, opt in enumerate(acc._optimizers):
        set_optimizer_state_dict(acc._models[i], opt, state[f"optimizer_{i}"], options=options)
