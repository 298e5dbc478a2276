"""Options and output shared by several `tpupipe` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any


def add_overrides(cmd: argparse.ArgumentParser, example: str, of: str = "a config field") -> None:
    """Add the repeatable `--set KEY=VALUE` option (collected in `args.overrides`)."""
    cmd.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {of}, e.g. --set {example} (repeatable)",
    )


def _to_devnull(stream: Any) -> None:
    """Point `stream`'s file descriptor at /dev/null, as Python's docs advise after a
    broken pipe: no later write, nor the interpreter's last flush, fails again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def standard_streams_open() -> None:
    """Open /dev/null on whichever of fd 0-2 the caller closed (`tpupipe run >&-`).

    Why: Python then sets `sys.stdout` to None, and the command's first write ended it
    with a traceback and exit 120, after a run that completed and landed. And the next
    file the process opened would have taken fd 1, where its children's output goes.
    """
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, buffering=1, closefd=False))  # noqa: SIM115


class _Unbroken:
    """A stream whose broken pipe ends its output, not the program (see
    `readers_may_leave`)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _to_devnull(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _to_devnull(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _quiet_console(console: Any) -> None:
    # rich's own reaction exits (SystemExit(1)), from whichever thread was logging.
    console.quiet = True
    _to_devnull(console.file)


@contextlib.contextmanager
def readers_may_leave() -> Iterator[None]:
    """For a command's run: a reader of its output that goes away (`| head`, `2>&1 | grep
    -m1 ...`) ends that output, not the command, nor changes its exit code.

    Why: with an unbuffered stdout (PYTHONUNBUFFERED=1, common in containers and CI),
    `tpupipe report RUN | head -1` ended in a BrokenPipeError traceback and exit 1, its
    plot unwritten. Prefect logs through rich, and rich exits (SystemExit(1)) on a broken
    pipe, from inside the task that was logging: `tpupipe run ... 2>&1 | grep -m1
    compiling` failed the training run at its next log line. And the command's own
    message to a closed stderr changed its exit code (validate's refusal: 1, not 2).
    """
    from rich.console import Console

    Console.on_broken_pipe = _quiet_console  # every console, Prefect's handlers' included
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Unbroken(before[0]), _Unbroken(before[1])
    try:
        yield
    finally:
        sys.stdout.flush()  # what is buffered, while a broken pipe still ends it quietly
        sys.stdout, sys.stderr = before
