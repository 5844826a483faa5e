"""A setting and how its value is read, by kind (size, int, float, bool, choice, path).

:class:`Variable` is one row of :data:`casnap.settings.VARIABLES`: a value from the
environment (text) or from ``override(...)`` (a Python value) is parsed by its kind
and checked against its bounds, else :class:`casnap.ConfigError` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casnap.display import parse_size
from casnap.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    """One setting: its name, its ``CASNAP_*`` variable, how it parses and what it means."""

    name: str
    kind: str  # "size", "int", "float", "bool", "choice", "path"
    default: Any  # a value, or None: "computed when read" (see doc)
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return "CASNAP_" + self.name.upper()

    def parse(self, raw: object, source: str) -> Any:
        """The value of ``raw`` (text from the environment, or a Python value from override)."""
        label = self.env if source == "env" else self.name
        where = f"{label}={raw!r}"
        value = _PARSERS[self.kind](self, raw, where, label)
        if self.kind in ("size", "int", "float"):
            if self.minimum is not None and value < self.minimum:
                bound = _show(self, self.minimum)
                raise ConfigError(f"{where}: must be at least {bound}", label)
            if self.maximum is not None and value > self.maximum:
                bound = _show(self, self.maximum)
                raise ConfigError(f"{where}: must be at most {bound}", label)
        return value


def _show(var: Variable, bound: float) -> str:
    return f"{int(bound)} bytes" if var.kind == "size" else f"{bound:g}"


def _parse_size(var: Variable, raw: object, where: str, label: str) -> int:
    wrong = f"{where}: expected a size in bytes, like 4194304 or 4MiB"
    try:
        return parse_size(raw)  # type: ignore[arg-type]  # anything else is refused
    except ValueError as exc:
        raise ConfigError(wrong, label) from exc


def _parse_int(var: Variable, raw: object, where: str, label: str) -> int:
    if isinstance(raw, bool):
        raise ConfigError(f"{where}: expected an integer", label)
    if isinstance(raw, int):
        return raw
    try:
        return int(str(raw).strip(), 10)
    except ValueError as exc:
        raise ConfigError(f"{where}: expected an integer", label) from exc


def _parse_float(var: Variable, raw: object, where: str, label: str) -> float:
    if isinstance(raw, bool):
        raise ConfigError(f"{where}: expected a number of seconds", label)
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected a number of seconds", label) from exc
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{where}: expected a finite number of seconds", label)
    return value


def _parse_bool(var: Variable, raw: object, where: str, label: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{where}: expected one of {', '.join(_TRUE + _FALSE)}", label)


def _parse_choice(var: Variable, raw: object, where: str, label: str) -> str:
    text = str(raw).strip().lower()
    if text not in var.choices:
        raise ConfigError(f"{where}: expected one of {', '.join(var.choices)}", label)
    return text


def _parse_path(var: Variable, raw: object, where: str, label: str) -> Path:
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ConfigError(f"{where}: expected a directory path", label)
    return Path(raw).expanduser()


_PARSERS: dict[str, Callable[[Variable, object, str, str], Any]] = {
    "size": _parse_size,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "choice": _parse_choice,
    "path": _parse_path,
}
