"""Where a take goes, with which settings, and what it takes: shared by every take.

Called by the single-process take and by every rank of a distributed take
(rank 0 resolves the target; every rank resolves its settings and collects
its own state), so the rules exist once: which repository, which name,
which settings override which (:func:`take_settings`), which parents, and
how an ``app_state`` becomes flat nodes (:func:`collect`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from casnap.errors import ShapeMismatchError, SnapshotExistsError, UnsupportedValueError
from casnap.format.json_text import canonical_json
from casnap.format.names import escape_key
from casnap.repo.locate import locate
from casnap.repo.repository import RepoStorage
from casnap.settings import (
    DEFAULT_CHUNK_SIZE,
    TAKE_SETTINGS,
    Settings,
    io_workers_for,
    is_set,
    take_overrides,
)
from casnap.take.parent import ParentRule, parent_rule
from casnap.take.plan import logical
from casnap.take.session import Session
from casnap.torch_io import quantized
from casnap.torch_io.flatten import Node, TensorLeaf, flatten, tensor_leaf
from casnap.torch_io.sharded import LocalShard, ShardLeaf
from casnap.torch_io.stateful import RNGState, rng_keeper
from casnap.torch_io.tensors import check_storable

TensorPrepareFunc = Callable[[str, torch.Tensor, bool], torch.Tensor]

# A snapshot's metadata lives in its manifest and in every ``log``; 1 MiB is
# far more than steps, metrics and tags need, and bounds what a take can add there.
MAX_METADATA_BYTES = 1 << 20


@dataclass(frozen=True)
class TakeOptions:
    """What a take is told besides its state, one meaning each: the store's (fsspec)
    ``storage``, the ``settings`` it overrides (:data:`casnap.settings.TAKE_SETTINGS`),
    and the ``repository`` named explicitly (a URL, a RepoStorage, a
    ``casnap.Repository``; None: the one the path finds)."""

    storage: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    repository: Any = None

    @classmethod
    def of(cls, storage_options: Any, settings: Any, repository: Any = None) -> TakeOptions:
        """The arguments of ``Snapshot.take`` checked (storage options, when opened)."""
        return cls(storage_options, take_overrides(settings), repository)

    @classmethod
    def split(cls, mixed: Mapping[str, Any]) -> TakeOptions:
        """The three from one dict that holds them all: an fsspec file system's
        constructor keywords (``casnap://`` in DCP), the store's options the rest."""
        options = dict(mixed)
        settings = {k: options.pop(k) for k in TAKE_SETTINGS if k in options}
        return cls(options, settings, options.pop("repository", None))

    def locate(
        self,
        path: str,
        *,
        create: bool,
        existing: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> tuple[RepoStorage, str]:
        """:func:`casnap.repo.locate.locate` of ``path`` with these options."""
        return locate(
            path,
            self.storage,
            create=create,
            existing=existing,
            chunk_size=chunk_size,
            repository=self.repository,
        )


def take_settings(
    repo: RepoStorage, overrides: Mapping[str, Any], chunk_size: int | None = None
) -> Settings:
    """The settings of a take into ``repo``: the one place overrides are resolved.

    Lowest to highest: built-in defaults, the repository's own chunk size and
    the store's kind of I/O concurrency, ``CASNAP_*`` variables, the take's
    ``storage_options`` overrides, and ``chunk_size`` (a distributed take's,
    chosen once by rank 0 for every rank).
    """
    wanted = dict(overrides)
    if "chunk_size" not in wanted and not is_set("chunk_size"):
        wanted["chunk_size"] = repo.config.chunk_size
    if chunk_size is not None:
        wanted["chunk_size"] = chunk_size
    if "io_workers" not in wanted and not is_set("io_workers"):
        wanted["io_workers"] = io_workers_for(repo.root.capabilities.local)
    return Settings.from_env().with_overrides(**wanted)


def _order(app_state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    # RNG state is captured first, before other state_dict() calls could consume randomness.
    items = list(app_state.items())
    return [kv for kv in items if isinstance(kv[1], RNGState)] + [
        kv for kv in items if not isinstance(kv[1], RNGState)
    ]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def collect(
    app_state: Mapping[str, Any], rank: int, allow_pickle: bool, prepare: TensorPrepareFunc | None
) -> dict[str, Node]:
    nodes: dict[str, Node] = {}
    put_back_rng = rng_keeper(app_state)  # state_dict() calls may draw random numbers
    try:  # a take that fails here leaves the RNG as it found it too
        for key, stateful in _order(app_state):
            if not isinstance(key, str) or not key or not _utf8(key):
                raise UnsupportedValueError(
                    f"app_state keys must be non-empty UTF-8 strings, got {key!r}"
                )
            if not callable(getattr(stateful, "state_dict", None)):
                raise UnsupportedValueError(
                    f"app_state[{key!r}] is a value of type {type(stateful).__name__} "
                    "without state_dict(); wrap plain values in casnap.StateDict",
                    key,
                )
            flatten(stateful.state_dict(), f"{rank}/{escape_key(key)}", allow_pickle, nodes)
    finally:
        put_back_rng()
    if prepare is not None:
        for key, node in nodes.items():
            if isinstance(node, TensorLeaf):
                original = node.tensor
                if node.quantized is not None:
                    original = quantized.rebuild(node.tensor, node.quantized)
                nodes[key] = tensor_leaf(_prepared(prepare, key, original), key)
            elif isinstance(node, ShardLeaf):
                nodes[key] = _prepared_shards(prepare, key, node)
    return nodes


def _prepared(prepare: TensorPrepareFunc, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """torchsnapshot's ``_custom_tensor_prepare_func(path, tensor, tracing)`` applied to one
    tensor: ``path`` is the key without its rank (``"model/0.weight"``), as torchsnapshot's
    logical path; the result is what is stored, and it must keep the shape.

    torchsnapshot calls it twice, ``tracing=True`` to learn the dtype and shape
    while planning, then ``tracing=False`` for the bytes. A casnap take hashes
    the bytes while planning, so it makes the one call that yields them.
    """
    out = prepare(logical(key), tensor, False)
    if not isinstance(out, torch.Tensor):
        raise UnsupportedValueError(
            f"{key}: _custom_tensor_prepare_func returned a {type(out).__name__}, not a tensor",
            key,
        )
    if out.shape != tensor.shape:
        raise ShapeMismatchError(
            f"{key}: _custom_tensor_prepare_func must not change the shape "
            f"(changed from {list(tensor.shape)} to {list(out.shape)})",
            key,
        )
    return out


def _prepared_shards(prepare: TensorPrepareFunc, key: str, leaf: ShardLeaf) -> ShardLeaf:
    """Every local shard of a sharded value through the prepare function, as torchsnapshot.

    A quantized shard is stored as its integers and parameters, as a quantized
    tensor is (docs/format.md, "Quantized tensors")."""
    shards = []
    for s in leaf.shards:
        out = _prepared(prepare, key, s.tensor)
        if out.is_quantized:
            ints, q = quantized.split(out, key)
            shards.append(LocalShard(s.offsets, s.sizes, ints, q))
        else:
            check_storable(out, key)
            shards.append(LocalShard(s.offsets, s.sizes, out))
    dtypes = {(s.tensor.dtype, s.quantized and s.quantized.qscheme) for s in shards}
    if len(dtypes) > 1:
        raise UnsupportedValueError(
            f"{key}: _custom_tensor_prepare_func gave the shards different dtypes "
            f"{sorted(str(d) for d in dtypes)}",
            key,
        )
    dtype = dtypes.pop()[0] if dtypes else leaf.dtype
    return ShardLeaf(leaf.layout, dtype, leaf.shape, tuple(shards))


@dataclass(frozen=True)
class Target:
    """Where a take goes and with what: shared by single-process and distributed takes."""

    repo: RepoStorage
    name: str
    settings: Settings
    metadata: dict[str, Any]
    parents: ParentRule  # chosen inside the take's lease
    # The repository was created for this take: no chunk, ref or damage record to look for.
    fresh: bool = False


def resolve_target(
    path: str,
    options: TakeOptions,
    metadata: dict[str, Any] | None,
    parents: list[str] | None,
    session: Session | None,
) -> Target:
    """Find or create the repository, check the name is free, validate metadata, pick parents."""
    # Bad input fails here, before a repository is created or anything written
    # (the name is checked by locate before it creates one).
    new_repo_chunk = Settings.from_env().with_overrides(**options.settings).chunk_size
    meta = check_metadata(metadata)
    repo, name = options.locate(path, create=True, chunk_size=new_repo_chunk)
    settings = take_settings(repo, options.settings)
    # A repository created just now holds nothing to find (another process writing
    # into it at once costs at most a chunk written twice, and its ref is written
    # create-only): the first take skips the ref check and every chunk probe.
    fresh, repo.created = repo.created, False
    if not fresh and repo.has_ref(name):
        raise SnapshotExistsError(
            f"snapshot {name!r} already exists in {repo.url}; snapshots are immutable", name
        )
    rule = parent_rule(repo, parents, session, settings, fresh)
    return Target(repo, name, settings, meta, rule, fresh)


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as the manifest will hold it, or :class:`casnap.UnsupportedValueError`.

    It must be JSON as it is: string keys; strings, numbers (finite), booleans,
    None, lists and dicts as values (a tuple or an int key would come back
    changed, so they are refused), at most 1 MiB encoded.
    """
    meta = dict(metadata or {})
    try:
        data = canonical_json(meta)
        same = json.loads(data) == meta
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"metadata must be JSON-serializable: {exc}") from exc
    if not same:
        raise UnsupportedValueError(
            "metadata must be JSON as it is: string keys, and str, int, float, bool, None, "
            "list or dict values (a tuple or a non-string key would not read back the same)"
        )
    if len(data) > MAX_METADATA_BYTES:
        raise UnsupportedValueError(
            f"metadata is {len(data)} bytes as JSON, more than {MAX_METADATA_BYTES}; "
            "store large values in the app_state instead"
        )
    return meta


def staging_limit(budget: int, settings: Settings) -> int:
    """Bytes an async take may stage: the budget less the writer's own working set.

    The writer holds encoded chunks and compression buffers of every I/O
    worker, the open pack, and copies of live tensors that are not contiguous
    CPU memory: a synchronous take of 1 GiB peaks 61 MiB above the live state
    with 4 workers and 4 MiB chunks (benchmarks/suite.py, rss). That reserve,
    4 chunks per worker plus a pack, is kept out of the staging share, but
    never more than half the budget.
    """
    reserve = 4 * settings.io_workers * settings.chunk_size + settings.pack_target
    return budget - min(reserve, budget // 2)
