"""Naming a snapshot on the command line: by its name, by a tag, or as ``latest``.

The resolver, and the order it looks names up in, is :mod:`casnap.ops.naming`:
the Python API (:meth:`casnap.Repository.snapshot`) shares it, so a name means
the same snapshot in both.

Example::

    repo, name = Repository.locate("/ckpt/run1/latest", must_exist=False)
    resolve_name(repo, name)  # "step_1000"
"""

from casnap.ops.naming import LATEST, resolve_name, suggest

__all__ = ["LATEST", "resolve_name", "suggest"]
