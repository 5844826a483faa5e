"""Tensors as raw bytes, without copies where the layout allows it."""

from __future__ import annotations

import ctypes

import torch

from casnap.chunks.target import Chunked
from casnap.errors import ShapeMismatchError, UnsupportedValueError
from casnap.format.entries import DTYPE_ITEMSIZE

_BY_NAME: dict[str, torch.dtype] = {}
for _name in DTYPE_ITEMSIZE:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _BY_NAME[_name] = _dt
_NAME_OF = {dt: name for name, dt in _BY_NAME.items()}
# Integer dtypes by element size: copying through them moves raw bits, and works for
# dtypes torch has no copy kernel for (int1..int7, uint1..uint7 raise NotImplementedError).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    name = _NAME_OF.get(dtype)
    if name is None:
        raise UnsupportedValueError(f"{key}: tensors of dtype {dtype} cannot be stored", key)
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError as exc:
        raise UnsupportedValueError(f"dtype {name!r} is not available in this torch") from exc


def check_storable(tensor: torch.Tensor, key: str = "") -> None:
    """Raise :class:`UnsupportedValueError` (naming ``key``) for a tensor casnap cannot store."""
    if tensor.layout != torch.strided:  # sparse ones too
        raise UnsupportedValueError(f"{key}: {tensor.layout} tensors cannot be stored", key)
    if tensor.is_quantized:
        raise UnsupportedValueError(f"{key}: quantized tensors cannot be stored", key)
    if tensor.is_meta:
        raise UnsupportedValueError(f"{key}: a meta tensor has no data to store", key)
    dtype_name(tensor.dtype, key)


def host_view(tensor: torch.Tensor, key: str = "") -> tuple[memoryview, torch.Tensor]:
    """The bytes of ``tensor`` in row-major order, and the CPU tensor that owns them.

    Contiguous CPU tensors are viewed in place (no copy); anything else
    (non-contiguous, conjugated, on an accelerator) is staged into a
    contiguous CPU tensor first. Keep the returned tensor alive while the
    memoryview is used.
    """
    check_storable(tensor, key)
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        # Device-to-host staging is synchronous, so the bytes are final on return.
        t = contiguous_cpu_copy(t)
    return byte_view(t), t


def _bits_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The integer dtype ``t`` can be reinterpreted as for a raw copy, if any."""
    if t.is_conj() or t.is_neg():
        return None  # the lazy conjugation/negation must be applied, not copied around
    return _SAME_SIZE_INT.get(t.element_size())


def contiguous_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous CPU tensor holding ``tensor``'s values, bit for bit, for every
    storable dtype (what an async take stages, so later in-place changes cannot leak in).

    Conjugate and negative views are materialized. Sub-byte dtypes (``torch.int4`` …)
    have no copy kernel, so the copy goes through an integer view of the same size.
    """
    t = tensor.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # already a fresh tensor
        if t.device.type == "cpu" and t.is_contiguous():
            return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    copy_bits(out, t)
    return out


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-dtype tensors, bit-exact and for every storable dtype."""
    dst, src = dst.detach(), src.detach()
    bits = _bits_dtype(dst)
    if bits is not None and bits == _bits_dtype(src) and dst.dtype == src.dtype:
        dst, src = dst.view(bits), src.view(bits)
    with torch.no_grad():
        dst.copy_(src)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (zero-copy); the view
    keeps ``t`` alive, so it stays valid when ``t`` was a temporary."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    buf = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    buf._owner = t  # type: ignore[attr-defined]  # from_address holds no reference
    return memoryview(buf).cast("B")


def check_target(key: str, target: torch.Tensor, dtype: str, shape: list[int]) -> None:
    """Raise if a restore target cannot receive the stored tensor in place."""
    want_dtype = torch_dtype(dtype)
    if target.dtype != want_dtype or list(target.shape) != list(shape):
        raise ShapeMismatchError(
            f"{key}: snapshot holds {dtype}{list(shape)}, the target is "
            f"{dtype_name(target.dtype, key) if target.dtype in _NAME_OF else target.dtype}"
            f"{list(target.shape)}",
            key,
        )
    if target.is_quantized or target.layout != torch.strided:
        raise ShapeMismatchError(f"{key}: the target is not a dense tensor", key)


def fills_in_place(target: torch.Tensor) -> bool:
    """Whether a restore writes chunks straight into ``target`` (else it stages a copy)."""
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


class TensorSink(Chunked):
    """The read target (:class:`~casnap.chunks.target.ReadTarget`) of one stored
    tensor's chunks, landed in ``target``.

    Contiguous CPU targets are filled in place chunk by chunk (the reader may
    read a chunk straight into :meth:`place`); other targets (non-contiguous
    views, accelerator tensors) get a contiguous CPU staging tensor that is
    copied in once complete (``finish``).
    """

    def __init__(
        self, dtype: str, shape: list[int], chunk_size: int, target: torch.Tensor | None
    ) -> None:
        self.target = target
        if target is not None and fills_in_place(target):
            self.buffer = target
        else:
            self.buffer = torch.empty(shape, dtype=torch_dtype(dtype))
        super().__init__(byte_view(self.buffer), chunk_size)

    def place(self, i: int, size: int) -> memoryview | None:
        """Where chunk ``i`` lands: read straight into it, unless it does not fit."""
        view = self.view_for(i, size)
        return view if len(view) == size else None

    def finish(self) -> torch.Tensor:
        if self.target is None:
            return self.buffer
        if self.buffer is not self.target:
            copy_bits(self.target, self.buffer)
        return self.target
