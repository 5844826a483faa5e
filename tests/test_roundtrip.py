"""Take then restore gives back exactly what was taken: bits, types, structure, identity.

Every comparison of tensors is by raw bytes (NaN payloads, -0.0 and the unused bits of
sub-byte dtypes included), never by value.
"""

from __future__ import annotations

import collections
import math
import random
import struct
from typing import Any

import pytest
import torch

from casnap import RNGState, Snapshot, StateDict
from casnap.format.entries import DTYPE_ITEMSIZE, ContainerEntry, PrimitiveEntry, TensorEntry

ALL_DTYPES = [
    getattr(torch, n) for n in DTYPE_ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)
]
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

SUB_BYTE = {getattr(torch, f"{p}int{n}") for p in ("", "u") for n in range(1, 8)}
ARITH_FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Float bit patterns a value comparison would not tell apart (quiet NaN with payload,
# negative NaN, signalling NaN, -0.0, the smallest subnormal).
SPECIAL_BITS = {
    torch.float64: [
        0x7FF8000000000001,
        0xFFF8000000000000,
        0x7FF0000000000001,
        0x8000000000000000,
        0x0000000000000001,
    ],
    torch.float32: [0x7FC01234, 0xFFC00000, 0x7F800001, 0x80000000, 0x00000001],
    torch.float16: [0x7E01, 0xFE00, 0x7C01, 0x8000, 0x0001],
    torch.bfloat16: [0x7FC1, 0xFFC0, 0x7F81, 0x8000, 0x0001],
}
NAN_WITH_PAYLOAD = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]


# -- helpers ----------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in row-major order as a flat uint8 tensor, bit for bit."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    bits = _INT_OF_SIZE.get(t.element_size())
    # Through an integer view: sub-byte dtypes have no copy kernel of their own.
    u = (t.view(bits) if bits is not None else t).contiguous()
    return u.reshape(-1).view(torch.uint8)


def assert_bit_exact(actual: Any, expected: torch.Tensor, what: str = "") -> None:
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    assert torch.equal(raw_bytes(actual), raw_bytes(expected)), f"{what}: bytes differ"


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes of ``dtype`` (any NaN payload may occur), plus special floats up front."""
    n = math.prod(shape) * dtype.itemsize
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    t = data.view(dtype).reshape(shape)
    flat = t.reshape(-1)
    if dtype in SPECIAL_BITS and flat.numel() >= 9:
        specials = torch.tensor([math.nan, -math.inf, math.inf, -0.0], dtype=torch.float64)
        flat[:4] = specials.to(dtype)
        patterns = [
            p - (1 << 8 * dtype.itemsize) if p >> (8 * dtype.itemsize - 1) else p
            for p in SPECIAL_BITS[dtype]
        ]
        flat[4:9].view(_INT_OF_SIZE[dtype.itemsize]).copy_(torch.tensor(patterns))
    if dtype.is_complex and dtype != torch.complex32 and flat.numel() >= 3:
        flat[:3] = torch.tensor([complex(math.nan, -0.0), complex(-math.inf, math.nan), -0.0j])
    return t


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(_INT_OF_SIZE.get(dtype.itemsize, torch.uint8) if dtype.itemsize <= 8 else dtype).zero_()
    return t


def layouts(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    base = random_tensor((6, 10), dtype, gen)
    return {
        "contiguous": base,
        "transposed": random_tensor((10, 6), dtype, gen).t(),
        "strided": base[::2, 1::3],
        "scalar": random_tensor((), dtype, gen),
        "empty": random_tensor((0,), dtype, gen),
        "empty3d": random_tensor((3, 0, 2), dtype, gen),
    }


def bits_of(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same_structure(actual: Any, expected: Any, where: str = "") -> None:
    """Equal values of exactly the same types, floats bit for bit, key order kept."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, float):
        assert bits_of(actual) == bits_of(expected), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, complex):
        assert bits_of(actual.real) == bits_of(expected.real), where
        assert bits_of(actual.imag) == bits_of(expected.imag), where
    elif isinstance(expected, torch.Tensor):
        assert_bit_exact(actual, expected, where)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for (ka, va), (ke, ve) in zip(actual.items(), expected.items(), strict=True):
            assert type(ka) is type(ke), f"{where}: key {ka!r} has type {type(ka)}"
            assert_same_structure(va, ve, f"{where}/{ke}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_structure(a, e, f"{where}/{i}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def clone_state(value: Any) -> Any:
    """A deep copy whose tensors own their bytes (contiguous where the layout allows)."""
    if isinstance(value, torch.Tensor):
        bits = _INT_OF_SIZE.get(value.element_size())
        v = value.detach().resolve_conj().resolve_neg()
        return (v.view(bits).clone().view(v.dtype)) if bits is not None else v.clone()
    if isinstance(value, dict):
        return type(value)((k, clone_state(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(clone_state(v) for v in value)
    return value


# -- tensors of every dtype and layout ----------------------------------------


def test_every_manifest_dtype_exists_in_torch() -> None:
    # Otherwise the parametrized tests below would silently skip a dtype.
    assert len(ALL_DTYPES) == len(DTYPE_ITEMSIZE)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_and_layout_round_trip(tmp_path: Any, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    original = layouts(dtype, gen)
    expected = clone_state(original)
    path = f"{tmp_path}/repo/snap1"
    snap = Snapshot.take(path, {"t": StateDict(original)})

    entries = snap.get_manifest()
    for name, t in expected.items():
        entry = entries[f"0/t/{name}"]
        assert isinstance(entry, TensorEntry)
        assert entry.dtype == str(dtype).removeprefix("torch.")
        assert entry.shape == list(t.shape)

    fresh = StateDict()
    Snapshot(path).restore({"t": fresh})
    assert fresh.keys() == expected.keys()
    for name, t in expected.items():
        assert_bit_exact(fresh[name], t, name)

    # In place into targets of the same layouts (two of them non-contiguous).
    targets = {
        "contiguous": zeros((6, 10), dtype),
        "transposed": zeros((10, 6), dtype).t(),
        "strided": zeros((6, 10), dtype)[::2, 1::3],
        "scalar": zeros((), dtype),
        "empty": zeros((0,), dtype),
        "empty3d": zeros((3, 0, 2), dtype),
    }
    ids = {k: id(v) for k, v in targets.items()}
    in_place = StateDict(targets)
    Snapshot(path).restore({"t": in_place})
    for name, t in expected.items():
        assert id(in_place[name]) == ids[name], f"{name} was replaced, not filled"
        assert_bit_exact(in_place[name], t, name)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_and_layout_round_trip_async(tmp_path: Any, dtype: torch.dtype) -> None:
    original = layouts(dtype, torch.Generator().manual_seed(7))
    expected = clone_state(original)
    path = f"{tmp_path}/repo/snap1"
    Snapshot.async_take(path, {"t": StateDict(original)}).wait(timeout=60)
    fresh = StateDict()
    Snapshot(path).restore({"t": fresh})
    for name, t in expected.items():
        assert_bit_exact(fresh[name], t, name)


def test_views_sharing_storage(tmp_path: Any) -> None:
    base = torch.arange(40, dtype=torch.float32)
    state = StateDict(
        base=base,
        head=base[:5],
        evens=base[::2],
        matrix=base.view(5, 8),
        column=base.view(5, 8)[:, 3],
    )
    expected = clone_state(dict(state))
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": state})

    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    for name, t in expected.items():
        assert_bit_exact(fresh[name], t, name)

    # In place: every view writes into the one storage, which ends up as it was at take time.
    base.mul_(-3).add_(1)
    Snapshot(path).restore({"s": state})
    assert state["base"] is base
    assert state["column"].data_ptr() == base.data_ptr() + 3 * 4
    for name, t in expected.items():
        assert_bit_exact(state[name], t, name)


def test_conj_views_of_complex_tensors(tmp_path: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    c64 = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    c128 = torch.randn(5, dtype=torch.complex128, generator=gen)
    state = StateDict(
        conj=c64.conj(), conj_t=c64.t().conj(), conj128=c128.conj(), neg=torch._neg_view(c128)
    )
    assert all(state[k].is_conj() for k in ("conj", "conj_t", "conj128"))
    assert state["neg"].is_neg()
    expected = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    assert not torch.equal(expected["conj"], c64)  # the conjugation is visible
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": state})

    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    for name, t in expected.items():
        assert_bit_exact(fresh[name], t, name)

    # In place into conjugate views: reading them back gives the stored values.
    target = StateDict(
        conj=torch.zeros(4, 3, dtype=torch.complex64).conj(),
        conj_t=torch.zeros(4, 3, dtype=torch.complex64).t().conj(),
        conj128=torch.zeros(5, dtype=torch.complex128).conj(),
        neg=torch.zeros(5, dtype=torch.complex128),
    )
    Snapshot(path).restore({"s": target})
    for name, t in expected.items():
        assert_bit_exact(target[name], t, name)


def test_large_tensor_spans_chunks_with_partial_last(tmp_path: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(10_001, generator=gen)  # 40004 bytes: 9 full chunks and 3140 bytes
    big_t = torch.randn(70, 90, dtype=torch.float64, generator=gen).t()  # non-contiguous
    state = StateDict(big=big, big_t=big_t)
    expected = clone_state(dict(state))
    path = f"{tmp_path}/repo/snap1"
    snap = Snapshot.take(path, {"s": state}, settings={"chunk_size": 4096})

    entry = snap.get_manifest()["0/s/big"]
    assert isinstance(entry, TensorEntry)
    assert entry.chunk_size == 4096
    assert [c.size for c in entry.chunks] == [4096] * 9 + [40004 - 9 * 4096]
    entry_t = snap.get_manifest()["0/s/big_t"]
    assert isinstance(entry_t, TensorEntry)
    assert len(entry_t.chunks) == math.ceil(70 * 90 * 8 / 4096)

    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    for name, t in expected.items():
        assert_bit_exact(fresh[name], t, name)
    big.zero_()
    big_t.zero_()
    Snapshot(path).restore({"s": state})
    assert state["big"] is big
    for name, t in expected.items():
        assert_bit_exact(state[name], t, name)
    assert_bit_exact(Snapshot(path).read_object("0/s/big"), expected["big"])


# -- containers and primitives -----------------------------------------------


def primitives() -> dict[str, Any]:
    nan = math.nan
    return {
        "ints": [0, -1, 2**63, 2**64 + 1, -(2**200), 10**300],
        "floats": [
            nan,
            -nan,
            math.inf - math.inf,
            -math.inf,
            math.inf,
            -0.0,
            0.0,
            5e-324,
            1.7976931348623157e308,
            0.1,
            NAN_WITH_PAYLOAD,
        ],
        "strs": ["", "héllo wörld ✓ 日本語 🎉", "a/b%c", "%2F/%25", "\x00nul", "line\nbreak"],
        "flags": (True, False),
        "none": None,
        "raw": b"\x00\xffbytes\n",
        "empty_bytes": b"",
        "cplx": [complex(1.5, -0.0), complex(nan, math.inf), -0.0j],
        "dtype": torch.bfloat16,
        "dtypes": [
            torch.float8_e4m3fn,
            torch.int4,  # type: ignore[attr-defined]  # in torch, missing from its stubs
            torch.complex32,
            torch.bool,
        ],
    }


def nested() -> dict[Any, Any]:
    return {
        "tuple": (1, (2, [3, {"deep": (4, None)}])),
        "od": collections.OrderedDict([("z", 1), ("a", (2,)), ("m", collections.OrderedDict())]),
        1: "int key",
        -7: ["negative int key"],
        2**70: "huge int key",
        "odd keys": {"a/b": 1, "100%": 2, "%2F": 3, "": 4, "ü/🎉": 5, "..": 6, "/": 7},
        "empties": {"dict": {}, "list": [], "tuple": (), "od": collections.OrderedDict()},
        "mixed": [1, "two", 3.0, None, b"5", (6,), [7], {"8": 8}, torch.int8],
        "tensor_inside": [torch.arange(3), {"t": torch.ones(2, 2)}],
    }


def test_primitives_and_containers_keep_types_and_bits(tmp_path: Any) -> None:
    expected = {"prims": primitives(), "nested": nested()}
    state = StateDict(clone_state(expected))
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": state})

    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    assert_same_structure(dict(fresh), expected, "s")

    # In place into the original object too: same content, nothing lost or converted.
    state["prims"] = {}
    Snapshot(path).restore({"s": state}, strict=False)
    assert_same_structure(dict(state), expected, "s")


def test_top_level_statedict_with_int_keys_and_ordered_dicts(tmp_path: Any) -> None:
    expected = StateDict({0: "zero", 7: collections.OrderedDict([(3, "c"), (1, "a")]), "s": (1.5,)})
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": StateDict(expected)})
    fresh = StateDict()
    Snapshot(path).restore({"s": fresh})
    assert_same_structure(dict(fresh), dict(expected))
    entry = Snapshot(path).get_manifest()["0/s/7"]
    assert isinstance(entry, ContainerEntry)
    assert entry.type == "OrderedDict" and entry.keys == [3, 1]


def test_special_python_floats_are_stored_exactly(tmp_path: Any) -> None:
    nan_neg = math.inf - math.inf  # negative NaN on common hardware
    payload = NAN_WITH_PAYLOAD
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": StateDict(a=nan_neg, b=payload, c=-0.0)})
    out = StateDict()
    Snapshot(path).restore({"s": out})
    assert bits_of(out["a"]) == bits_of(nan_neg)
    assert bits_of(out["b"]) == bits_of(payload)
    assert bits_of(out["c"]) == bits_of(-0.0)
    entry = Snapshot(path).get_manifest()["0/s/c"]
    assert isinstance(entry, PrimitiveEntry) and entry.type == "float"


# -- optimizers and schedulers ------------------------------------------------


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 4, generator=gen)
    y = torch.randn(16, 2, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()


def _half_life(epoch: int) -> float:
    return 0.5 ** (epoch / 3)


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}
SCHEDULERS = {
    "none": None,
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=20),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, _half_life),
}
COMBOS = [(o, "none") for o in OPTIMIZERS] + [
    ("sgd_momentum", "step"),
    ("adam", "cosine"),
    ("sgd_momentum", "onecycle"),
    ("adamw", "onecycle"),
    ("adagrad", "lambda"),
]


@pytest.mark.parametrize(("opt_name", "sched_name"), COMBOS)
def test_optimizer_and_scheduler_resume_bit_identical(
    tmp_path: Any, opt_name: str, sched_name: str
) -> None:
    def build(seed: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer, Any]:
        model = _model(seed)
        opt = OPTIMIZERS[opt_name](model.parameters())
        make_sched = SCHEDULERS[sched_name]
        return model, opt, make_sched(opt) if make_sched else None

    model, opt, sched = build(0)
    for step in range(4):
        _train_step(model, opt, sched, step)
    app_state: dict[str, Any] = {"model": model, "optim": opt}
    if sched is not None:
        app_state["sched"] = sched
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, app_state)

    model2, opt2, sched2 = build(1)  # fresh objects, different initial weights
    assert not torch.equal(model2.get_parameter("0.weight"), model.get_parameter("0.weight"))
    target: dict[str, Any] = {"model": model2, "optim": opt2}
    if sched2 is not None:
        target["sched"] = sched2
    Snapshot(path).restore(target)

    for step in range(4, 7):
        _train_step(model, opt, sched, step)
        _train_step(model2, opt2, sched2, step)
        for (name, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
            assert_bit_exact(p2, p, f"step {step} {name}")
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for key, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            assert_same_structure(opt2.state_dict()["state"][key][name], value, f"{key}/{name}")
    if sched is not None:
        assert sched2.get_last_lr() == sched.get_last_lr()
        assert sched2.last_epoch == sched.last_epoch == 7


# -- in-place restore ---------------------------------------------------------


def test_restore_fills_the_target_tensors_in_place(tmp_path: Any) -> None:
    model = _model(0)
    expected = clone_state(model.state_dict())
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": model})

    target = _model(5)
    weight = target[0].weight
    ptrs = {k: v.data_ptr() for k, v in target.state_dict().items()}
    Snapshot(path).restore({"model": target})
    assert target[0].weight is weight
    assert isinstance(target[0].weight, torch.nn.Parameter)
    assert target[0].weight.requires_grad
    assert {k: v.data_ptr() for k, v in target.state_dict().items()} == ptrs
    for name, t in expected.items():
        assert_bit_exact(target.state_dict()[name], t, name)


def test_non_contiguous_target_in_statedict_gets_values(tmp_path: Any) -> None:
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"s": StateDict(w=src, col=src[:, 1])})

    storage = torch.zeros(4, 3)
    target = StateDict(w=storage.t(), col=torch.zeros(3, 5)[:, 2])
    w, col = target["w"], target["col"]
    assert not w.is_contiguous() and not col.is_contiguous()
    Snapshot(path).restore({"s": target})
    assert target["w"] is w and target["col"] is col
    assert_bit_exact(w, src)
    assert_bit_exact(storage, src.t())  # the values landed in the underlying storage
    assert_bit_exact(col, src[:, 1].contiguous())


# -- RNG state ------------------------------------------------------------------


def test_rng_state_round_trip(tmp_path: Any) -> None:
    torch.manual_seed(123)
    random.seed(456)
    random.gauss(0, 1)  # leaves a cached gauss value in Python's state
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"rng": RNGState(), "s": StateDict(x=torch.ones(2))})
    after_take = torch.rand(5)
    py_after_take = [random.random() for _ in range(3)] + [random.gauss(0, 1)]

    torch.manual_seed(0)
    random.seed(0)
    Snapshot(path).restore({"rng": RNGState(), "s": StateDict(x=torch.zeros(2))})
    assert torch.equal(torch.rand(5), after_take)
    assert [random.random() for _ in range(3)] + [random.gauss(0, 1)] == py_after_take


# -- manifest keys and read_object ------------------------------------------------


def test_manifest_keys_follow_torchsnapshot_logical_paths(tmp_path: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": model, "optim": opt, "extra/state": StateDict(step=3)})
    manifest = Snapshot(path).get_manifest()
    assert {
        "0/model",
        "0/model/0.weight",
        "0/model/0.bias",
        "0/model/1.weight",
        "0/model/1.running_mean",
        "0/model/1.num_batches_tracked",
        "0/optim",
        "0/optim/state",
        "0/optim/param_groups",
        "0/optim/param_groups/0/lr",
        "0/optim/param_groups/0/params/1",
        "0/extra%2Fstate/step",
    } <= set(manifest)
    weight = manifest["0/model/0.weight"]
    assert isinstance(weight, TensorEntry)
    assert (weight.dtype, weight.shape) == ("float32", [3, 2])
    step = manifest["0/extra%2Fstate/step"]
    assert isinstance(step, PrimitiveEntry) and step.value == 3


def test_read_object(tmp_path: Any) -> None:
    model = _model(0)
    state = StateDict(
        step=41, cfg={"name": "run", "sizes": (1, 2), "od": collections.OrderedDict(b=1)}
    )
    path = f"{tmp_path}/repo/snap1"
    Snapshot.take(path, {"model": model, "s": state})
    snap = Snapshot(path)

    weight = snap.read_object("0/model/0.weight")
    assert_bit_exact(weight, model.get_parameter("0.weight"))
    assert snap.read_object("0/s/step") == 41
    assert_same_structure(snap.read_object("0/s/cfg"), state["cfg"])
    assert_same_structure(snap.read_object("0/s/cfg/sizes"), (1, 2))
    assert_same_structure(dict(snap.read_object("0/model")), dict(model.state_dict()))

    out = torch.zeros(8, 4)
    result = snap.read_object("0/model/0.weight", obj_out=out)
    assert result is out
    assert_bit_exact(out, model.get_parameter("0.weight"))
    out_t = torch.zeros(4, 8).t()  # a non-contiguous obj_out
    assert snap.read_object("0/model/0.weight", obj_out=out_t) is out_t
    assert_bit_exact(out_t, model.get_parameter("0.weight"))

    sd_out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    w_out = sd_out["0.weight"]
    got = snap.read_object("0/model", obj_out=sd_out)
    assert got is sd_out and sd_out["0.weight"] is w_out
    assert_bit_exact(w_out, model.get_parameter("0.weight"))


# -- torchsnapshot-style calls and async ------------------------------------------


def test_torchsnapshot_keyword_calls(tmp_path: Any) -> None:
    model = _model(0)
    progress = StateDict(epoch=3, best=0.25)
    path = f"{tmp_path}/ckpt/epoch_3"
    snapshot = Snapshot.take(path=path, app_state={"model": model, "progress": progress})
    assert isinstance(snapshot, Snapshot)
    assert snapshot.path == path

    model2, progress2 = _model(1), StateDict(epoch=0, best=1.0)
    Snapshot(path=path).restore(app_state={"model": model2, "progress": progress2})
    assert progress2 == {"epoch": 3, "best": 0.25}
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert_bit_exact(p2, p)


def test_async_take_is_point_in_time(tmp_path: Any) -> None:
    model = _model(0)
    extra = StateDict(
        t=torch.arange(1000.0),
        nc=torch.arange(20.0).reshape(4, 5).t(),
        conj=torch.randn(6, dtype=torch.complex64).conj(),
        step=1,
    )
    expected_model = clone_state(model.state_dict())
    expected_extra = clone_state(dict(extra))
    path = f"{tmp_path}/repo/snap1"
    pending = Snapshot.async_take(path, {"model": model, "extra": extra})

    # The training loop carries on right away, in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    extra["t"].mul_(-1)
    extra["nc"].fill_(7)
    extra["conj"].zero_()
    extra["step"] = 2

    snap = pending.wait(timeout=60)
    assert pending.done()
    assert isinstance(snap, Snapshot)
    model2, extra2 = _model(1), StateDict()
    Snapshot(path).restore({"model": model2, "extra": extra2})
    for name, t in expected_model.items():
        assert_bit_exact(model2.state_dict()[name], t, name)
    assert_same_structure(dict(extra2), expected_extra)


class _SortedKeys(dict):
    """A dict whose keys() are sorted while values() keep insertion order."""

    def keys(self):
        return sorted(super().keys())


def test_a_mapping_whose_keys_are_ordered_unlike_its_values_keeps_each_member_under_its_key(
    tmp_path,
):
    inner = _SortedKeys(b=torch.zeros(3), a=torch.ones(3))
    snap = Snapshot.take(str(tmp_path / "run" / "s"), {"m": StateDict(inner=inner)})
    assert torch.equal(snap.read_object("0/m/inner/a"), torch.ones(3))
    assert torch.equal(snap.read_object("0/m/inner/b"), torch.zeros(3))
