"""The one command-line scaffold every entry point uses: flags, usage errors, fixes, exit codes.

Why: every command must mean the same by a bad flag (one line, exit 2, before any work), by a
``--json PATH`` it cannot write (found before the work, not after it) and by an error a user can
mend (one line naming the fix). Each ``main`` declares its flags and does its job; this module
turns what goes wrong into those lines. Standard library only.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ep_image.files.records import not_a_file

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

Options = TypeVar("Options")


class UsageError(Exception):
    """A bad flag, flag combination or argument: one line, exit 2, nothing was done."""


class FixableError(Exception):
    """An error the user can mend: ``message`` says what happened, ``fix`` what to do."""

    def __init__(self, message: str, fix: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message, self.fix, self.exit_code = message, fix, exit_code


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one :class:`UsageError` line instead of a usage dump and a
    ``SystemExit(2)`` that callers cannot tell from other exits; ``--help`` is unchanged."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see --help)")

    def add_json(self, help_text: str = "write the machine-readable report here") -> None:
        """``--json PATH``, checked when parsed (see :func:`report_path`)."""
        self.add_argument("--json", metavar="PATH", type=report_path, help=help_text)

    def add_require(self, help_text: str) -> None:
        """``--require``: a check that cannot run here fails instead of being skipped."""
        self.add_argument("--require", action="store_true", help=help_text)


def report_path(text: str) -> Path:
    """An argparse ``type`` for a report file, checked before any work and changing nothing:
    nothing but a regular file may be at the path (a report replaces what is there: a device
    node, as root, for every process); the directory it goes in must exist or be makeable
    there by this user (it is made when the report is written, so a run refused before then
    leaves none); and a missing top directory (``/out`` in ``/out/x.json``: in a container, a
    volume that was not mounted) is refused rather than made, since the report would
    vanish with it. So a finished run never loses its verdict to a path that was wrong."""
    path = Path(text)
    if (why := not_a_file(path)) is not None:
        raise argparse.ArgumentTypeError(f"{why}: give the path of a regular file or a new one")
    parent = Path(os.path.abspath(path)).parent
    existing = parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot make the directory of {text} ({existing} is not a directory): give a path "
            "in a directory you can write"
        )
    if existing != parent and existing == existing.parent:
        top = parent.parents[-2] if len(parent.parents) > 1 else parent
        raise argparse.ArgumentTypeError(
            f"{top} does not exist (in a container: a volume not mounted, whose report would "
            f"be lost with the container): create {top} or mount it, or give a path in an "
            "existing directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK) or (
        path.exists() and not os.access(path, os.W_OK)
    ):
        raise argparse.ArgumentTypeError(
            f"{text} is not writable here: give a path in a directory you can write"
        )
    return path


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a CI timeout, ``kill``, a closed terminal), raised where the process
    is, so that its cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def run(
    prog: str,
    parse: Callable[[Sequence[str] | None], Options],
    body: Callable[[Options], int],
    argv: Sequence[str] | None = None,
    *,
    terminate_cleanly: bool = False,
) -> int:
    """Parse ``argv`` with ``parse``, then run ``body``; what goes wrong becomes the lines
    ``PROG: error: ...`` and ``PROG: fix: ...`` on stderr and its exit code (usage 2,
    interrupted 130, a fixable error its own, 1 by default). ``terminate_cleanly``: SIGTERM
    and SIGHUP unwind like Ctrl-C (the build steps' cleanup runs), exit 128 + the signal."""
    if terminate_cleanly:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _raise_terminated)
    try:
        options = parse(argv)
        return body(options)
    except Terminated as exc:
        print(f"{prog}: interrupted: terminated by signal {exc.signum}", file=sys.stderr)
        return 128 + exc.signum
    except UsageError as exc:
        print(f"{prog}: usage error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FixableError as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        print(f"{prog}: fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def os_error_fix(exc: OSError, where: object, otherwise: str) -> str:
    """The fix for a system error that stopped a step, by its cause: a full disk or a read-only
    file system, else ``otherwise`` (the step's own advice, e.g. for a permission)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {where} is full: free space there (df -h {where}), then run again"
    if exc.errno == errno.EROFS:
        return f"{where} is on a read-only file system: use a writable place"
    return otherwise
