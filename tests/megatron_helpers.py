"""A small Megatron-core GPT model and its sharded state dict, for tests/test_megatron*.py.

Every function runs inside a rank process started by ``dist_harness.run_ranks``
(gloo, CPU): Megatron-core keeps its parallel layout in module globals, so each
layout lives in its own processes. Nothing is downloaded: the model is built
from a config with Megatron's local (no Transformer Engine) layer spec.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

VOCAB = 128
SEQ = 32


def megatron_missing() -> str | None:
    """Why megatron-core cannot be used here, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.dist_checkpointing  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"megatron-core is not importable ({type(exc).__name__}: {exc}); extra 'megatron'"
    return None


def build(tp: int, seed: int = 1234) -> Any:
    """(every rank) Megatron's parallel state for TP=tp (DP = world / tp) and a 2-layer GPT."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(seed + ps.get_tensor_model_parallel_rank())
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    if ps.get_data_parallel_world_size() > 1:  # replicas start equal, as after DDP's broadcast
        for p in model.parameters():
            torch.distributed.broadcast(p.data, src=ps.get_tensor_model_parallel_rank())
    return model


def sharded_state(model: Any, step: int, rng: bool = True) -> dict[str, Any]:
    """The model's sharded state dict plus common state (the step) and a ShardedObject.

    The ShardedObject (an RNG state per TP rank) belongs to its layout, as in
    Megatron: a load into another layout leaves it out (``rng=False``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    sd: dict[str, Any] = {"model": model.sharded_state_dict(prefix="model.")}
    sd["step"] = step  # common state: Megatron writes it to common.pt
    if not rng:
        return sd
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    sd["rng"] = ShardedObject(
        "rng_state", {"tp_rank": tp_rank, "seed": 7 + tp_rank}, (tp,), (tp_rank,), (0, dp_rank)
    )
    return sd


def main_boxes(sd: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """(key, global offset with prepended axes, data) of every main-replica ShardedTensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    out = []
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            out.append((sh.key, tuple(sh.global_offset), sh.data.detach().clone()))
    return out


def check_loaded(loaded: dict[str, Any], template: dict[str, Any], full: dict[str, Any]) -> int:
    """Assert each loaded ShardedTensor equals its box of the reference ``full``; count them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    flat_loaded = dict(_flat(loaded))
    n = 0
    for path, sh in _flat(template):
        if not isinstance(sh, ShardedTensor):
            continue
        got = flat_loaded[path]
        want = full[sh.key]
        index = []
        pre = sh.prepend_axis_num
        for axis, off in enumerate(sh.global_offset):
            size = 1 if axis < pre else sh.local_shape[axis - pre]
            index.append(slice(off, off + size))
        box = want[tuple(index)].reshape(sh.local_shape)
        assert got.dtype == box.dtype, (sh.key, got.dtype, box.dtype)
        assert torch.equal(got.view(torch.uint8), box.contiguous().view(torch.uint8)), sh.key
        n += 1
    assert n and n == sum(1 for v in nested_values(template) if isinstance(v, ShardedTensor))
    return n


def _flat(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _flat(v, f"{prefix}{k}/")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _flat(v, f"{prefix}{i}/")
    else:
        out.append((prefix.rstrip("/"), d))
    return out


def full_tensors(per_rank: list[list[tuple[str, tuple[int, ...], torch.Tensor]]]) -> dict:
    """Assemble whole tensors from every rank's main-replica boxes."""
    shapes: dict[str, list[int]] = {}
    for boxes in per_rank:
        for key, off, data in boxes:
            pre = len(off) - data.dim()
            ends = [o + 1 for o in off[:pre]] + [o + s for o, s in zip(off[pre:], data.shape)]
            cur = shapes.setdefault(key, [0] * len(off))
            shapes[key] = [max(a, b) for a, b in zip(cur, ends)]
    full = {}
    for key, shape in shapes.items():
        dtype = next(d.dtype for b in per_rank for k, _, d in b if k == key)
        full[key] = torch.full(shape, float("nan"), dtype=dtype)
    for boxes in per_rank:
        for key, off, data in boxes:
            pre = len(off) - data.dim()
            idx = tuple(
                [slice(o, o + 1) for o in off[:pre]]
                + [slice(o, o + s) for o, s in zip(off[pre:], data.shape)]
            )
            full[key][idx] = data.reshape(full[key][idx].shape)
    for key, t in full.items():
        assert not torch.isnan(t).any(), f"{key}: the boxes do not cover the tensor"
    return full


def env_quiet() -> None:
    os.environ.setdefault("CASNAP_DIST_TIMEOUT", "60")
    warnings.filterwarnings("ignore")


def two_rank_scenarios(rank: int, world: int, layouts_root: str, async_root: str) -> dict[str, Any]:
    """(every rank) test_megatron_dist.py's scenario, then test_megatron_async.py's."""
    from megatron.core import parallel_state as ps
    from test_megatron_async import _async
    from test_megatron_dist import _layouts

    out = {"layouts": _layouts(rank, world, layouts_root)}
    ps.destroy_model_parallel()
    out["async"] = _async(rank, world, async_root)
    return out
