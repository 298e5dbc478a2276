"""Options shared by several `tpupipe` subcommands."""

from __future__ import annotations

import argparse


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
