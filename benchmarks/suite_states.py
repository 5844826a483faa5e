"""The state dicts of benchmarks/suite.py and the training patterns that change them.

Every scenario starts from one fp32 transformer-shaped state (``build``: a
32k-row embedding and many thin layers, so whole layers come close to 10% of
the bytes) and derives the next snapshot's state with a *pattern*: nothing
changes, a frozen backbone with the top layers trained, LoRA adapters on a
frozen base, 1% of the embedding's rows, or every parameter. A pattern
returns a new dict that shares the unchanged tensors with the previous one
(no copies), so every system saves exactly the same tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from harness import VOCAB, _layer_shapes

State = dict[str, torch.Tensor]

PATTERNS = ("unchanged", "frozen", "lora", "sparse", "all")
LORA_RANK = 16
FROZEN_FRACTION = 0.10  # the share of bytes a frozen-backbone fine-tune trains
SPARSE_ROWS = 0.01  # the share of embedding rows a sparse update touches


def _fill(t: torch.Tensor, gen: torch.Generator, scale: float, offset: float = 0.0) -> None:
    """Weight-like values in place (no temporary the size of the tensor)."""
    t.normal_(generator=gen).mul_(scale)
    if offset:
        t.add_(offset)


def pick_hidden(target_bytes: int, min_layers: int = 16) -> int:
    """The widest hidden size (a multiple of 128) that leaves room for ``min_layers`` layers.

    Many thin layers, so a frozen-backbone fine-tune can train close to 10% of
    the bytes as whole layers.
    """
    for hidden in range(4096, 128, -128):
        if len(model_shapes(target_bytes, hidden)) >= 12 * min_layers + 3:
            return hidden
    return 128


def model_shapes(target_bytes: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A 32k-vocab fp32 transformer with hidden size ``hidden`` and as many layers as fit."""
    emb = VOCAB * hidden * 4
    per_layer = sum(math.prod(s) for s in _layer_shapes(hidden, 0).values()) * 4
    layers = max(1, round((target_bytes - emb) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, hidden)}
    for i in range(layers):
        shapes.update(_layer_shapes(hidden, i))
    shapes["ln_f.weight"] = (hidden,)
    shapes["ln_f.bias"] = (hidden,)
    return shapes


def build(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> State:
    """Distinct weight-like values: 0.02·N(0,1), layernorm weights 1 + 0.01·N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    state: State = {}
    for key, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.float32)
        if key.endswith((".ln1.weight", ".ln2.weight")) or key == "ln_f.weight":
            _fill(t, gen, 0.01, 1.0)
        else:
            _fill(t, gen, 0.02)
        state[key] = t
    return state


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def layer_count(state: State) -> int:
    return 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))


def trainable_keys(state: State) -> list[str]:
    """The top layers and the final layernorm: the layer count closest to 10% of the bytes."""
    layers = layer_count(state)
    total = nbytes(state)
    best: tuple[float, list[str]] = (2.0, [])
    for k in range(1, layers + 1):
        top = tuple(f"layers.{i}." for i in range(layers - k, layers))
        keys = [n for n in state if n.startswith("ln_f.") or n.startswith(top)]
        share = sum(state[n].numel() * state[n].element_size() for n in keys) / total
        if abs(share - FROZEN_FRACTION) < best[0]:
            best = (abs(share - FROZEN_FRACTION), keys)
    return best[1]


def with_adapters(state: State, seed: int = 7) -> State:
    """The base plus LoRA adapters (rank 16) on every attention projection."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for key in [k for k in state if k.endswith(("attn.qkv.weight", "attn.out.weight"))]:
        d_out, d_in = state[key].shape
        stem = key[: -len(".weight")]
        a = torch.empty((LORA_RANK, d_in))
        _fill(a, gen, 0.02)
        b = torch.empty((d_out, LORA_RANK))
        _fill(b, gen, 0.02)
        out[stem + ".lora_A"] = a
        out[stem + ".lora_B"] = b
    return out


@dataclass(frozen=True)
class Step:
    """One derived state and how many of its bytes differ from the state it came from."""

    state: State
    changed_bytes: int


def _scaled(t: torch.Tensor, step: int) -> torch.Tensor:
    # A different factor per step changes every element (and every chunk) each time.
    return t * (1.0 + 1e-3 * (step + 1))


def derive(pattern: str, prev: State, step: int) -> Step:
    """The state after training step ``step`` (0, 1, ...) under ``pattern``, from ``prev``.

    ``prev`` is the previous snapshot's state (for ``lora``, one with
    adapters: see ``start_state``); the result shares its unchanged tensors.
    """
    maker: Callable[[State, int], Step] = {
        "unchanged": lambda b, s: Step(dict(b), 0),
        "frozen": lambda b, s: _replace(b, trainable_keys(b), s),
        "lora": lambda b, s: _replace(b, [k for k in b if ".lora_" in k], s),
        "sparse": _sparse,
        "all": lambda b, s: _replace(b, list(b), s),
    }[pattern]
    return maker(prev, step)


def _replace(base: State, keys: list[str], step: int) -> Step:
    out = dict(base)
    changed = 0
    for k in keys:
        out[k] = _scaled(base[k], step)
        changed += out[k].numel() * out[k].element_size()
    return Step(out, changed)


def _sparse(base: State, step: int) -> Step:
    emb = base["embed.weight"].clone()
    rows = max(1, round(SPARSE_ROWS * emb.shape[0]))
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randperm(emb.shape[0], generator=gen)[:rows]
    emb[idx] = emb[idx] * (1.0 + 1e-3 * (step + 1))
    out = dict(base)
    out["embed.weight"] = emb
    return Step(out, rows * emb.shape[1] * emb.element_size())


def start_state(pattern: str, base: State) -> State:
    """The state a pattern's first snapshot holds (adapters added for ``lora``)."""
    return with_adapters(base) if pattern == "lora" else base


def target_like(state: State) -> State:
    """Zero-filled, resident tensors of the same shapes: a live model to restore into."""
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def bf16_weight(nbytes_target: int, seed: int = 3) -> State:
    """One real-looking bf16 weight matrix (0.02·N(0,1) cast to bf16), 4096 columns wide."""
    cols = 4096
    rows = max(1, nbytes_target // (cols * 2))
    gen = torch.Generator().manual_seed(seed)
    t = torch.empty((rows, cols))
    _fill(t, gen, 0.02)
    return {"mlp.weight": t.to(torch.bfloat16)}


PROBE_KEY = "probe.weight"
PROBE_COLS = 1024


def probe_tensor(rows: int, cols: int = PROBE_COLS) -> torch.Tensor:
    """The tensor read_object fetches (regenerated by the reading process to check it)."""
    t = torch.empty((rows, cols))
    _fill(t, torch.Generator().manual_seed(12), 0.02)
    return t


def read_state(total_bytes: int, tensor_bytes: int) -> State:
    """A large state with ``PROBE_KEY`` (``tensor_bytes`` of fp32) among its middle entries."""
    size = total_bytes - tensor_bytes
    state = build(model_shapes(size, pick_hidden(size)), seed=11)
    keys = list(state)
    mid = len(keys) // 2
    # In the middle, so neither the first nor the last bytes of a file are the answer.
    ordered = {k: state[k] for k in keys[:mid]}
    ordered[PROBE_KEY] = probe_tensor(tensor_bytes // (4 * PROBE_COLS))
    ordered.update({k: state[k] for k in keys[mid:]})
    return ordered
