"""What every command promises: exit codes, one line per error, logging, a closed pipe.

The exit codes (0 success, 1 problems found, 2 bad usage, 3 not found,
4 integrity, 5 any other error, 130 interrupted, 141 standard output closed)
are the table in docs/repository.md, "The command line". An error is one
line on stderr, ``casnap: error: <what>``; ``-v`` (or ``--debug``) prints
the traceback before it. Logging goes through the ``casnap`` logger: warnings
by default, ``-q`` errors only, ``-v`` info, ``-vv``/``--debug`` debug.
Example::

    code = run_command(args, cmd_ls)   # what main() does after parsing
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from casnap.cli.common import EXIT_ERROR, EXIT_INTEGRITY, EXIT_NOT_FOUND, EXIT_USAGE, key_value
from casnap.errors import (
    CasnapError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
    MissingKeyError,
    ObjectNotFoundError,
    RepositoryNotFoundError,
    RetentionError,
    SnapshotNotFoundError,
)

EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 128 + 13  # what a shell reports for a process killed by SIGPIPE

# MissingKeyError: a key the snapshot does not hold (export, show and diff --key).
_NOT_FOUND = (SnapshotNotFoundError, RepositoryNotFoundError, ObjectNotFoundError, MissingKeyError)
_USAGE = (ConfigError, InvalidNameError, RetentionError)


def exit_code(exc: BaseException) -> int:
    """The documented exit code for an error that ended a command."""
    if isinstance(exc, _NOT_FOUND):
        return EXIT_NOT_FOUND
    if isinstance(exc, IntegrityError):
        return EXIT_INTEGRITY
    if isinstance(exc, _USAGE):
        return EXIT_USAGE
    return EXIT_ERROR


def describe(exc: BaseException) -> str:
    """One line saying what went wrong (the type is named for what casnap did not expect)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, (CasnapError, OSError)):  # casnap's own, or the file system's
        return text or type(exc).__name__
    return (
        f"internal error: {type(exc).__name__}: {text}; "
        "`casnap --debug ...` shows the traceback (please report it)"
    )


def run_command(args: argparse.Namespace, func: Callable[[argparse.Namespace], int]) -> int:
    """Run one parsed command under the contract: its exit code, or the one its error maps to."""
    verbosity = 2 if args.debug else int(args.verbose)
    with cli_logging(verbosity, quiet=args.quiet):
        try:
            code = int(func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return code
        except BrokenPipeError:
            return closed_pipe()
        except KeyboardInterrupt:
            print("casnap: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as exc:
            if verbosity:
                traceback.print_exc(file=sys.stderr)
            print(f"casnap: error: {describe(exc)}", file=sys.stderr)
            return exit_code(exc)


def closed_pipe() -> int:
    """The reader of stdout went away: drop the rest of the output and exit 141.

    stdout is pointed at /dev/null so the interpreter's final flush of what is
    still buffered does not fail again (the recipe in Python's ``signal`` docs).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file descriptor (a test's captured stdout): nothing to redirect
    return EXIT_CLOSED_PIPE


def check_output_path(out: str) -> None:
    """Refuse, before any work, an output file that cannot be written where it is named."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{out} is a directory; name the file to write in it", "out")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"cannot write {out}: {parent} {what}", "out")


# -- global options ---------------------------------------------------------------


def version() -> str:
    """casnap's version as installed (``casnap --version``)."""
    try:
        return importlib.metadata.version("casnap")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


# Global options are accepted before the command (parsed by the main parser) and
# after it (by the command's parser, into "after_<dest>"); merge_global_options joins them.
_GLOBAL_FLAGS = ("json", "quiet", "debug")


def add_global_options(parser: argparse.ArgumentParser, after: bool) -> None:
    """The options every command takes, on the main parser or (``after``) a command's."""

    def dest(name: str) -> str:
        return f"after_{name}" if after else name

    unset: dict[str, Any] = {"default": argparse.SUPPRESS} if after else {}
    g = parser.add_argument_group("global options (before or after the command)")
    g.add_argument(
        "--json", action="store_true", dest=dest("json"), help="machine-readable output", **unset
    )
    g.add_argument(
        "--storage-option",
        action="append",
        type=key_value,
        metavar="KEY=VALUE",
        dest=dest("storage_option"),
        help="an fsspec storage option (repeatable), e.g. token=anon",
        **unset,
    )
    g.add_argument(
        "-v",
        "--verbose",
        action="count",
        dest=dest("verbose"),
        help="log more (-v info, -vv debug) and show tracebacks of errors",
        **(unset or {"default": 0}),
    )
    g.add_argument(
        "-q", "--quiet", action="store_true", dest=dest("quiet"), help="log errors only", **unset
    )
    g.add_argument(
        "--debug",
        action="store_true",
        dest=dest("debug"),
        help="debug logging (all libraries) and tracebacks, like -vv",
        **unset,
    )


def merge_global_options(args: argparse.Namespace) -> None:
    """Join the global options given before the command with those given after it."""
    after = {k[len("after_") :]: v for k, v in vars(args).items() if k.startswith("after_")}
    for key in after:
        delattr(args, f"after_{key}")
    for flag in _GLOBAL_FLAGS:
        setattr(args, flag, getattr(args, flag) or after.get(flag, False))
    args.verbose += after.get("verbose", 0)
    options = (args.storage_option or []) + after.get("storage_option", [])
    args.storage_option = options or None


# -- logging -----------------------------------------------------------------


class _StderrLines(logging.Handler):
    """Each record as ``casnap: warning: ...`` on the current ``sys.stderr``.

    Other libraries' records pass only from ``other_level`` up: their failures
    reach the user as casnap's own error line, their chatter (gcsfs logs each
    failed retry with a traceback) would bury it.
    """

    def __init__(self, verbosity: int, other_level: int) -> None:
        super().__init__(logging.DEBUG)
        self.verbosity = verbosity
        self.other_level = other_level

    def emit(self, record: logging.LogRecord) -> None:
        ours = record.name == "casnap" or record.name.startswith("casnap.")
        if not ours and record.levelno < self.other_level:
            return
        try:
            message = record.getMessage()
            if message.startswith("casnap: "):  # some messages name casnap themselves
                message = message[len("casnap: ") :]
            who = "casnap" if ours else record.name
            line = f"{who}: {record.levelname.lower()}: {message}\n"
            if record.exc_info and self.verbosity:
                line += "".join(traceback.format_exception(*record.exc_info))
            sys.stderr.write(line)  # looked up now: a test may have swapped it
        except Exception:
            self.handleError(record)


@contextmanager
def cli_logging(verbosity: int, *, quiet: bool = False) -> Iterator[None]:
    """Log to stderr for the length of one command, then put logging back as it was."""
    if quiet:
        ours, others = logging.ERROR, logging.CRITICAL + 1
    elif verbosity >= 2:
        ours, others = logging.DEBUG, logging.DEBUG
    elif verbosity == 1:
        ours, others = logging.INFO, logging.WARNING
    else:
        ours, others = logging.WARNING, logging.CRITICAL + 1
    root, casnap = logging.getLogger(), logging.getLogger("casnap")
    saved = (root.level, casnap.level)
    handler = _StderrLines(verbosity, others)
    root.addHandler(handler)
    casnap.setLevel(ours)
    if others < root.level:
        root.setLevel(others)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        casnap.setLevel(saved[1])
