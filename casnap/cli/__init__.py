"""The ``casnap`` command line (``casnap --help``)."""

from casnap.cli.app import main

__all__ = ["main"]
