"""`tpupipe`: run the pipeline locally from a config file.

tpupipe run --config configs/demo.yaml --set train.steps=50
tpupipe validate --config configs/demo.yaml
tpupipe shard --source corpus/ --out .tpupipe/datasets
tpupipe report demo
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from flows import report_cli, shard_cli
from flows.cli_options import add_overrides, readers_may_leave, standard_streams_open
from flows.local_run import SIGNAL_EXITS, exit_on_signals, orchestrate_here, quiet_interrupt
from workloads.config_file import ConfigError, load_config


def _prefect_defaults() -> None:
    # Prefect's ephemeral API needs longer than its default start-up timeout on a cold,
    # 2-core machine, and its analytics ping only adds noise offline.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpupipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "run the whole pipeline on this machine"),
        ("validate", "check a config without running anything"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--config", required=True, help="pipeline config YAML")
        add_overrides(cmd, "train.steps=200")
    shard_cli.add_parser(sub)
    report_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tpupipe` command; returns the process exit code."""
    standard_streams_open()
    args = _parser().parse_args(argv)
    exit_on_signals()
    with readers_may_leave():
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    if args.command == "shard":
        return shard_cli.run(args)
    if args.command == "report":
        return report_cli.run(args)
    from tasks.pricing import price_for
    from workloads.config_memory import host_memory_bytes

    try:
        # With the memory check: a model too big for the slice fails here, not after it
        # was provisioned (the flow's validate stage checks it again, for UI runs).
        config = load_config(args.config, args.overrides, host_memory=host_memory_bytes)
        price = price_for(config)  # a cost.price_table that does not read is a config error
    except ConfigError as exc:
        print(f"invalid config:\n{exc}", file=sys.stderr)
        return 2
    if args.command == "validate":
        return _validate(args.config, config, price)
    _prefect_defaults()
    from flows.pipeline import tpu_training_pipeline
    from tasks.plan import metrics_path, new_run_name
    from tasks.prepare import DatasetError, DatasetWriteError
    from tasks.run_lock import RunInUse
    from tasks.watch import WorkloadFailed

    # Named here, not in the flow, so the lines below can say how to resume an unnamed run:
    # it said "run None stopped by Ctrl-C; run it again", and again made a new run.
    again = "run it again"
    if config.run_name is None:
        config = config.model_copy(update={"run_name": new_run_name()})
        again = f"run it again with --set run_name={config.run_name}"
    try:
        with orchestrate_here():
            run = tpu_training_pipeline(config=config)
    except KeyboardInterrupt:
        # Torn down and landed `failed` on the way out; the process still ends killed by
        # SIGINT (130 in a shell), so a script running it stops too.
        _stopped(config.run_name, "Ctrl-C", again)
        sys.excepthook = quiet_interrupt  # not the ~45 lines of where the interrupt landed
        raise
    except SystemExit as exc:  # SIGTERM or SIGHUP (flows.local_run): said as Ctrl-C is
        if exc.code in SIGNAL_EXITS:
            _stopped(config.run_name, SIGNAL_EXITS[exc.code], again)
        raise
    except DatasetWriteError as exc:  # the machine's trouble (a full disk), not the input's
        print(f"pipeline failed: {exc}\n(run {config.run_name}: {again} to go on)", file=sys.stderr)
        return 1
    except (ConfigError, DatasetError) as exc:
        # The config or its input must change (the flow raises these before provisioning).
        print(f"invalid config or input:\n{exc}", file=sys.stderr)
        return 2
    except RunInUse as exc:  # also raised before anything is provisioned
        print(f"not started:\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # The workload's own failure (a crash, NaN, the stall guard) comes back on a rerun
        # as it is: "run it again" alone sent users round that loop.
        when = " once its cause is dealt with" if isinstance(exc, WorkloadFailed) else ""
        print(
            f"pipeline failed: {type(exc).__name__}: {exc}\n"
            f"(run {config.run_name}: {again} to resume it{when})",
            file=sys.stderr,
        )
        return 1
    print(
        f"\nrun {run.run_id} {run.status}: {run.final_step} steps, "
        f"train loss {_f(run.train_loss_first)} -> {_f(run.train_loss_last)}, "
        f"eval loss {_f(run.eval_loss)} ({_f(run.eval_bits_per_byte)} bits/byte)\n"
        f"  run directory: {run.run_dir}\n"
        f"  metrics:       {metrics_path(config)} (tables runs, step_metrics, eval_metrics)"
    )
    return 0


def _stopped(run_name: str, what: str, again: str) -> None:
    with contextlib.suppress(OSError):  # stderr went with the terminal
        print(f"run {run_name} stopped by {what}; {again} to resume it", file=sys.stderr)


def _f(value: float | None) -> str:
    """A summary figure, or n/a when the run has none (a non-finite loss lands as NULL)."""
    return "n/a" if value is None else f"{value:.3f}"


def _validate(path: str, config, price) -> int:
    """`tpupipe validate`: the config's fields, then what it points at that this machine can
    see (local sources, the tokenizer file, an existing local run); exit 0 or 2."""
    from tasks.plan import plan_run
    from tasks.prepare import DatasetError, check_inputs
    from tasks.run_lock import training_now
    from tasks.run_owner import check_run_owner

    remote = [s for s in config.dataset.sources if s.startswith("gs://")]
    try:
        plan, files = check_inputs(config, plan_run(config), remote=False)
        check_run_owner(config, plan, remote=False)
    except (ConfigError, DatasetError) as exc:
        print(f"invalid config or input:\n{exc}", file=sys.stderr)
        return 2
    unchecked = f" ({len(remote)} remote source(s) checked when the run starts)" if remote else ""
    print(
        f"{path}: valid\n  sources: {files} local file(s){unchecked}\n"
        f"  cost: {price.chips} chips, {price.describe()}"
    )
    if (note := training_now(plan, config)) is not None:
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
