"""`tpupipe report RUN_ID`: print a run's timeline (attempts, preemptions, goodput, cost)
and write a PNG of its loss curve and attempt timeline.

    tpupipe report demo                                   # under ./.tpupipe
    tpupipe report r1 --config configs/gcp.yaml           # that config's storage.root
    tpupipe report demo --config configs/demo.yaml \\
        --set cost.priced_as=v5litepod-8 --set cost.region=us-central1   # re-price it

Each attempt is priced as it recorded (older attempts: by the run's config.json), or by the
cost section of `--config` when that file (or a `--set cost.…`) sets one. Exits 0 with the
report, 1 when the run does not exist (naming the runs that do), a file of it or its price
table cannot be read or the plot cannot be written, 2 on an invalid config.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flows.cli_options import add_overrides
from workloads.config_file import ConfigError, load_config

DEFAULT_ROOT = ".tpupipe"  # StorageConfig's default storage root


def add_parser(sub: Any) -> None:
    """Add the `report` subcommand to the `tpupipe` subparsers."""
    cmd = sub.add_parser("report", help="print a run's timeline and cost, and plot it")
    cmd.add_argument("run_id", metavar="RUN_ID", help="the run's id (its run_name)")
    cmd.add_argument("--config", help="pipeline config YAML: its storage.root and cost section")
    add_overrides(cmd, "cost.region=us-east5", of="a field of --config")
    cmd.add_argument(
        "--root", help=f"storage root holding runs/ (default: --config's, else {DEFAULT_ROOT})"
    )
    cmd.add_argument("--out", metavar="PNG", help="where to write the PNG (default: in the run)")
    cmd.add_argument("--no-png", action="store_true", help="print the timeline only")


def run(args: argparse.Namespace) -> int:
    """Run `tpupipe report`; returns the exit code."""
    cost, root = None, args.root
    if args.config:
        try:
            config = load_config(args.config, args.overrides)
        except ConfigError as exc:
            print(f"invalid config:\n{exc}", file=sys.stderr)
            return 2
        # Its cost section re-prices the run only if it sets a price: used to find a gs://
        # root, a config without one (the default, "not priced") hid every recorded price.
        cost = config.cost if config.cost != type(config.cost)() else None
        root = root or config.storage.root
    elif args.overrides:
        print("--set needs --config (it overrides that file's fields)", file=sys.stderr)
        return 2
    root = root or DEFAULT_ROOT
    if root.startswith("gs://"):
        # Without them the report retried its reads for 80 s and failed with six
        # tracebacks that named no credentials.
        from tasks.access import check_adc

        try:
            check_adc(root)
        except ConfigError as exc:
            print(f"tpupipe report: {exc}", file=sys.stderr)
            return 2
    from tasks.pricing import PriceTableError
    from tasks.report import RunNotFound, format_report, load_report

    try:
        report = load_report(root, args.run_id, cost)
    except (RunNotFound, PriceTableError) as exc:
        print(f"tpupipe report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a run file that is a directory, or not readable
        print(f"tpupipe report: cannot read run {args.run_id}'s files: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if not args.no_png:
        from tasks.report_plot import write_report_png

        try:
            plot = write_report_png(report, args.out)
        except OSError as exc:  # --out in a missing directory, or naming one
            reason = exc.strerror or exc
            where = args.out or f"{report.run_dir}/report.png"
            print(f"tpupipe report: cannot write the plot to {where}: {reason}", file=sys.stderr)
            return 1
        # Outside the try: a closed stdout (`| head`) is not the plot's failure.
        print(f"plot: {plot}")
    return 0
