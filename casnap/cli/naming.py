"""Naming a snapshot on the command line: by its name, by a tag, or as ``latest``.

The resolver, and the order it looks names up in, is :mod:`casnap.ops.naming`:
the Python API (:meth:`casnap.Repository.resolve`, :meth:`casnap.Repository.snapshot`)
shares it, so a name means the same snapshot in both.

Example::

    repo, name = Repository.locate("/ckpt/run1/latest", must_exist=False)
    resolve_name(repo, name)  # "step_1000"
"""

from __future__ import annotations

from casnap.api.repository import Repository
from casnap.ops import naming
from casnap.ops.naming import LATEST, suggest

__all__ = ["LATEST", "resolve_name", "suggest"]


def resolve_name(repo: Repository, name: str) -> str:
    """The snapshot ``name`` means in ``repo``: a snapshot, a tag or ``latest``."""
    return naming.resolve_name(repo.storage, name)
