"""Quantized tensors as their integer representation plus quantization parameters.

A ``qint8``/``quint8``/``qint32`` tensor is stored as ``int_repr()`` and a
:class:`~casnap.format.entries.Quantization` record (floats as exact
``float.hex``), so it rebuilds bit-identical. Restore fills a matching
quantized target in place, gives a floating-point target the dequantized
values, and replaces any other quantized target by the stored tensor
(docs/format.md, "Quantized tensors").
"""

from __future__ import annotations

import torch

from casnap.errors import ShapeMismatchError, UnsupportedValueError
from casnap.format.entries import QUANTIZED_STORAGE, Quantization, TensorEntry
from casnap.format.floats import hex_float

_QDTYPES = {"qint8": torch.qint8, "quint8": torch.quint8, "qint32": torch.qint32}
_QNAME = {dt: name for name, dt in _QDTYPES.items()}


def split(tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Quantization]:
    """The integers to store (a fresh CPU tensor) and the parameters of quantized ``tensor``."""
    name = _QNAME.get(tensor.dtype)
    scheme = tensor.qscheme()
    if name is None or scheme not in (torch.per_tensor_affine, torch.per_channel_affine):
        raise UnsupportedValueError(
            f"{key}: quantized tensors of dtype {tensor.dtype} and qscheme {scheme} cannot be "
            "stored (qint8, quint8 and qint32 with per_tensor_affine or per_channel_affine can)",
            key,
        )
    t = tensor.detach()
    ints = t.int_repr().cpu()  # a copy: the snapshot is point-in-time even for an async take
    if scheme == torch.per_tensor_affine:
        q = Quantization(
            dtype=name,  # type: ignore[arg-type]
            qscheme="per_tensor_affine",
            scale=float(t.q_scale()).hex(),
            zero_point=int(t.q_zero_point()),
        )
    else:
        q = Quantization(
            dtype=name,  # type: ignore[arg-type]
            qscheme="per_channel_affine",
            axis=int(t.q_per_channel_axis()),
            scales=tuple(float(s).hex() for s in t.q_per_channel_scales().tolist()),
            zero_points=tuple(int(z) for z in t.q_per_channel_zero_points().tolist()),
        )
    return ints.contiguous(), q


def rebuild(ints: torch.Tensor, q: Quantization) -> torch.Tensor:
    """The quantized tensor whose integer representation is ``ints``."""
    if q.qscheme == "per_tensor_affine":
        assert q.scale is not None and q.zero_point is not None  # the model checks it
        return torch._make_per_tensor_quantized_tensor(ints, hex_float(q.scale), q.zero_point)
    assert q.axis is not None  # the model checks it
    scales = torch.tensor([hex_float(s) for s in q.scales or ()], dtype=torch.float64)
    zero_points = torch.tensor(list(q.zero_points or ()), dtype=torch.int64)
    return torch._make_per_channel_quantized_tensor(ints, scales, zero_points, q.axis)


def _qscheme(q: Quantization) -> torch.qscheme:
    return torch.per_tensor_affine if q.qscheme == "per_tensor_affine" else torch.per_channel_affine


def fills_quantized(target: torch.Tensor, q: Quantization) -> bool:
    """Whether ``target`` takes the stored tensor in place, parameters included.

    ``copy_`` between quantized tensors of one qscheme and dtype copies the
    integers and replaces the target's parameters; on a view that would leave
    the rest of its base with other parameters (torchsnapshot's caveat), so a
    view is only filled when its parameters already are the stored ones.
    """
    if not target.is_quantized or target.dtype != _QDTYPES[q.dtype]:
        return False
    if target.qscheme() != _qscheme(q) or target.device.type != "cpu":
        return False
    if target._is_view():
        _ints, mine = split(target, "")
        return mine == q
    return True


def check_target(key: str, target: torch.Tensor, entry: TensorEntry) -> None:
    """Raise before anything is read if ``target`` cannot receive the stored quantized tensor."""
    q = entry.quantized
    assert q is not None
    if list(target.shape) != list(entry.shape):
        raise ShapeMismatchError(
            f"{key}: snapshot holds {q.dtype}{list(entry.shape)}, the target's shape is "
            f"{list(target.shape)}",
            key,
        )
    if not (target.is_quantized or target.dtype.is_floating_point):
        raise ShapeMismatchError(
            f"{key}: snapshot holds a {q.dtype} tensor; a {target.dtype} target can receive "
            "neither it nor its dequantized values",
            key,
        )


def land(entry: TensorEntry, ints: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """The restored value of a quantized entry read as ``ints`` (see the module docstring)."""
    q = entry.quantized
    assert q is not None and QUANTIZED_STORAGE[q.dtype] == entry.dtype
    return land_value(rebuild(ints, q), q, target)


def land_value(value: torch.Tensor, q: Quantization, target: torch.Tensor | None) -> torch.Tensor:
    """The restored value of quantized ``value`` (parameters ``q``) given ``target``."""
    if target is None:
        return value
    with torch.no_grad():
        if fills_quantized(target, q):
            # On ``target`` itself: the parameters live in its TensorImpl, and a
            # detached alias would take them while ``target`` kept the old ones.
            target.copy_(value)
            return target
        if not target.is_quantized:
            target.detach().copy_(value.dequantize())
            return target
    return value
