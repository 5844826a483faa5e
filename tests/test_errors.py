"""One error hierarchy: every class in casnap/errors.py, exported there, and the builtin it
means."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import casnap
from casnap import errors

PACKAGE = Path(casnap.__file__).parent


def _error_classes() -> list[type[BaseException]]:
    return [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == errors.__name__
    ]


def test_every_error_class_is_defined_in_errors_py():
    elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                elsewhere.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert elsewhere == []


def test_every_error_is_exported_from_casnap_errors_and_a_casnap_error():
    classes = _error_classes()
    assert sorted(errors.__all__) == sorted(c.__name__ for c in classes)  # and nothing else
    for cls in classes:
        root = errors.CasnapWarning if issubclass(cls, Warning) else errors.CasnapError
        assert issubclass(cls, root), cls
        namespace: dict[str, object] = {}
        exec(f"from casnap.errors import {cls.__name__}", namespace)
        assert namespace[cls.__name__] is cls, cls
    # The few caught every day are at the top level too, as the same classes.
    at_top = [n for n in casnap.__all__ if n in errors.__all__]
    assert 0 < len(at_top) <= 8
    for name in at_top:
        assert getattr(casnap, name) is getattr(errors, name)


def test_each_error_is_also_the_builtin_it_means():
    assert issubclass(casnap.ConfigError, ValueError)
    assert not issubclass(casnap.errors.PickleNotAllowedError, OSError)
    assert issubclass(casnap.errors.PickleNotAllowedError, TypeError)
    assert issubclass(casnap.SnapshotNotFoundError, FileNotFoundError)
    assert issubclass(casnap.errors.GcBusyError, TimeoutError)


def test_a_bad_memory_budget_is_a_config_error_naming_the_argument(tmp_path):
    state = {"m": casnap.StateDict(w=torch.ones(1))}
    with pytest.raises(casnap.ConfigError, match="memory_budget_bytes") as info:
        casnap.Snapshot.take(str(tmp_path / "repo" / "s1"), state, memory_budget_bytes=0)
    assert info.value.name == "memory_budget_bytes"
    assert not (tmp_path / "repo").exists()  # refused before anything was created


def test_a_bad_checkpointer_interval_is_a_config_error(tmp_path):
    with pytest.raises(casnap.ConfigError, match="every_n_steps"):
        casnap.Checkpointer(str(tmp_path / "repo"), every_n_steps=0)
    # A wrong type is an ArgumentTypeError: a CasnapError and a TypeError.
    with pytest.raises(casnap.errors.ArgumentTypeError, match="every_n_steps") as info:
        casnap.Checkpointer(str(tmp_path / "repo"), every_n_steps="10")  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
