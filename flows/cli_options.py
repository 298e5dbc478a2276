"""Options and output shared by several `tpupipe` subcommands."""

from __future__ import annotations

import argparse
import os
import sys


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


def say(text: str) -> None:
    """Print `text` to stdout; a reader that went away (`| head`) ends the output, not the
    command: the rest of its work (the report's plot) is still done and its exit code kept.

    Why: with an unbuffered stdout (PYTHONUNBUFFERED=1, common in containers and CI),
    `tpupipe report RUN | head -1` ended in a BrokenPipeError traceback and exit 1.
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # As Python's docs advise: stdout to /dev/null, so no later write or the
        # interpreter's last flush raises again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
