"""Land a run's metrics in the sink and publish its summary artifact."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from infra.metrics import EvalMetricRow, RunRow, StepMetricRow, build_sink
from tasks.goodput import read_events
from tasks.ledger import Ledger, compute_ledger, tokens_per_step
from tasks.plan import RunPlan
from tasks.pricing import price_or_unpriced
from tasks.progress import loss_curve_link, write_loss_curve
from workloads.checkpoint import VerifiedCheckpoint
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.evaluate import EvalResult
from workloads.events import EVENTS
from workloads.rundir import RunDir


def _ts(seconds: float | None) -> datetime:
    return datetime.fromtimestamp(seconds, UTC) if seconds else datetime.now(UTC)


def build_rows(
    config: PipelineConfig,
    plan: RunPlan,
    started_at: datetime,
    verified: VerifiedCheckpoint | None,
    result: EvalResult | None,
    error: str | None = None,
) -> tuple[RunRow, list[StepMetricRow], list[EvalMetricRow]]:
    """Rows for the `runs`, `step_metrics` and `eval_metrics` tables from the run directory."""
    metrics = RunDir(plan.run_dir).read_metrics()
    steps = [
        StepMetricRow(
            run_id=plan.run_id,
            step=m["step"],
            loss=m.get("loss"),
            learning_rate=m.get("learning_rate"),
            grad_norm=m.get("grad_norm"),
            step_time_s=m.get("step_time_s"),
            tokens_per_s=m.get("tokens_per_s"),
            recorded_at=_ts(m.get("time")),
        )
        for m in metrics
    ]
    evals = []
    if result is not None:
        evals.append(
            EvalMetricRow(
                run_id=plan.run_id,
                step=result.step,
                loss=result.loss,
                bits_per_byte=result.bits_per_byte,
                tokens=result.tokens,
                recorded_at=datetime.now(UTC),
            )
        )
    ordered = sorted(metrics, key=lambda m: m["step"])
    ledger = run_ledger(config, plan.run_dir)
    run = RunRow(
        run_id=plan.run_id,
        run_name=plan.run_name,
        flow_run_id=plan.flow_run_id,
        status="failed" if error else "completed",
        error=error,
        config_hash=plan.config_hash,
        config_json=config.model_dump_json(),
        dataset_fingerprint=_fingerprint(plan),
        started_at=_first_start(started_at, ledger),
        finished_at=datetime.now(UTC),
        final_step=verified.step if verified else (ordered[-1]["step"] if ordered else None),
        train_loss_first=ordered[0].get("loss") if ordered else None,
        train_loss_last=ordered[-1].get("loss") if ordered else None,
        eval_loss=result.loss if result else None,
        eval_bits_per_byte=result.bits_per_byte if result else None,
        params_sha256=verified.params_sha256 if verified else None,
        num_params=verified.num_params if verified else None,
        run_dir=plan.run_dir,
        **ledger_fields(ledger),
    )
    return run, steps, evals


def run_ledger(config: PipelineConfig, run_dir: str) -> Ledger:
    """The run's cost ledger from its events.jsonl: each attempt priced as it recorded,
    one recorded by an older version by the run's config."""
    # The validate stage checked the table; one broken since must not lose the row.
    price = price_or_unpriced(config)
    events = read_events(f"{run_dir}/{EVENTS}")
    return compute_ledger(events, price, tokens_per_step(config))


def ledger_fields(ledger: Ledger) -> dict:
    """The `runs` columns of the goodput-and-cost ledger: `chip_hours` and `cost_usd` sum
    every attempt at its own price; `chips` and the price are the last attempt's."""
    good, price = ledger.goodput, ledger.price
    return {
        "attempts": good.attempts,
        "preemptions": good.preemptions,
        "goodput": good.goodput,
        "wall_s": good.wall_s,
        **{f"{bucket}_s": seconds for bucket, seconds in good.seconds.items()},
        "chips": price.chips,
        "chip_hours": ledger.chip_hours,
        "usd_per_chip_hour": price.usd_per_chip_hour,
        "price_source": price.source,
        "price_as_of": price.as_of,
        "cost_usd": ledger.cost_usd,
        "tokens_trained": ledger.tokens,
        "cost_per_million_tokens": ledger.cost_per_million_tokens,
    }


def _first_start(started_at: datetime, ledger: Ledger) -> datetime:
    """When the run first started: this invocation's start, or the first event an earlier
    one recorded (one killed outright lands no row, so the sink cannot keep its start)."""
    if ledger.first_event is None:
        return started_at
    return min(started_at, datetime.fromtimestamp(ledger.first_event, UTC))


def _fingerprint(plan: RunPlan) -> str:
    from tasks.checks import load_workload_config

    try:
        return os.path.basename(load_workload_config(plan).dataset_dir.rstrip("/"))
    except ConfigError:  # not written yet (stopped while sharding, bad input) or unreadable
        return ""


def describe_error(exc: BaseException) -> str:
    """What a failed run's `runs.error` says: the exception's type and message, or for a
    termination signal (Prefect's `TerminationSignal`, which has no message) its name."""
    signum = getattr(exc, "signal", None)
    if isinstance(signum, int):
        return f"{type(exc).__name__}: the orchestrator received {signal.Signals(signum).name}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# How long a stopped run's row waits for a DuckDB file another process holds (a notebook,
# another run's landing) before it gives up: `docker stop` sends SIGKILL 10 s after its
# SIGTERM, and the crash hooks and the temporary API server's stop still come after it.
INTERRUPTED_LOCK_WAIT_S = 5.0


def land_failure(
    config: PipelineConfig,
    plan: RunPlan,
    started_at: datetime,
    verified: VerifiedCheckpoint | None,
    result: EvalResult | None,
    exc: BaseException,
) -> None:
    """Land the `runs` row of a run that `exc` stopped, before `exc` propagates.

    The row is best effort: if landing fails too, that is logged and noted on `exc`, and
    `exc` goes on, so a run's cause (a workload error, a preemption budget spent, Ctrl-C)
    is never replaced by its metrics' error. A run stopped by a signal (Ctrl-C, SIGTERM:
    not an `Exception`) waits at most `INTERRUPTED_LOCK_WAIT_S` for the metrics file, so
    it still exits promptly. Landing a failed run keeps what an earlier invocation landed
    and this one has no value for (its evaluation, its step rows): see
    `infra.metrics.rows`.
    """
    wait = None if isinstance(exc, Exception) else INTERRUPTED_LOCK_WAIT_S
    try:
        land_metrics(
            config, plan, started_at, verified, result, describe_error(exc), lock_wait_s=wait
        )
    except Exception as landing:
        get_run_logger().warning("could not land the failed run's row: %s", landing)
        exc.add_note(f"(its runs row was not landed: {type(landing).__name__}: {landing})")


@task(name="land-metrics", cache_policy=NONE)
def land_metrics(
    config: PipelineConfig,
    plan: RunPlan,
    started_at: datetime,
    verified: VerifiedCheckpoint | None,
    result: EvalResult | None,
    error: str | None = None,
    lock_wait_s: float | None = None,
) -> RunRow:
    """Land the run idempotently: landing twice leaves one copy of every row.

    Args:
        config: the run's config.
        plan: its plan (run directory, metrics path).
        started_at: when this invocation started.
        verified: the verified final checkpoint, if this invocation got that far.
        result: its evaluation, if this invocation got that far.
        error: why the run failed; None lands it completed.
        lock_wait_s: for DuckDB, how long to wait for a file another process holds
            (None: the sink's default).

    Returns:
        The `runs` row as this invocation built it (a failed row that kept results landed
        earlier has them in the sink, not here).
    """
    run, steps, evals = build_rows(config, plan, started_at, verified, result, error)
    sink = build_sink(config.metrics.sink, plan.metrics_path, config.metrics, lock_wait_s)
    sink.ensure_tables()
    landed = sink.land(run, steps, evals)
    get_run_logger().info(
        "landed run %s (%s): %d step rows, %d eval rows in %s%s",
        run.run_id,
        run.status,
        landed.steps,  # one per step: a step trained again after a resume counts once
        landed.evals,
        plan.metrics_path,
        "" if error is None else " (as a failed run: the rows landed before it are kept)",
    )
    return run


def summary_markdown(config: PipelineConfig, plan: RunPlan, run: RunRow) -> str:
    """The flow run's summary: config, steps, loss first to last, eval, where things are."""

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return "\n".join(
        [
            f"# Run `{run.run_id}`: {run.status}",
            "",
            "| what | value |",
            "|---|---|",
            f"| steps | {run.final_step} of {config.train.steps} |",
            f"| train loss | {fmt(run.train_loss_first)} → {fmt(run.train_loss_last)} |",
            f"| eval loss | {fmt(run.eval_loss)} |",
            f"| eval bits per byte | {fmt(run.eval_bits_per_byte)} |",
            f"| parameters | {run.num_params} (sha256 `{(run.params_sha256 or '')[:16]}`) |",
            f"| attempts | {run.attempts} ({run.preemptions} preempted) |",
            f"| goodput | {fmt(run.goodput)} of {fmt(run.wall_s)} s wall; badput: "
            f"provisioning {fmt(run.provisioning_s)} s, start-up {fmt(run.startup_s)} s, "
            f"restore {fmt(run.restore_s)} s, lost {fmt(run.lost_s)} s, "
            f"teardown {fmt(run.teardown_s)} s |",
            f"| cost | {cost_text(run)} |",
            f"| cost per 1M training tokens | {per_million_text(run)} |",
            f"| run directory | `{plan.run_dir}` |",
            f"| loss curve | {loss_curve_link(write_loss_curve(plan.run_dir))} |",
            f"| metrics | `{plan.metrics_path}` ({config.metrics.sink}) |",
            "",
            "## Config",
            "",
            "```json",
            config.model_dump_json(indent=2),
            "```",
        ]
    )


def cost_text(run: RunRow) -> str:
    """`$0.3573 for 0.2978 chip-hours at $1.2000/chip-hour (source, read 2026-11-22)`, or
    the chip-hours and why they are not priced."""
    hours = f"{run.chip_hours or 0.0:.4f} chip-hours ({run.chips} chips)"
    if run.cost_usd is None:
        return f"{run.price_source or 'not priced'}; {hours}"
    read = f", read {run.price_as_of}" if run.price_as_of else ""
    return (
        f"${run.cost_usd:.4f} for {hours} at ${run.usd_per_chip_hour:.4f}/chip-hour "
        f"({run.price_source}{read})"
    )


def per_million_text(run: RunRow) -> str:
    """`$1.4540 (245,760 tokens of the steps that count)`, or why there is none."""
    tokens = f"{run.tokens_trained or 0:,} tokens of the steps that count"
    if run.cost_per_million_tokens is None:
        return f"n/a ({tokens})"
    return f"${run.cost_per_million_tokens:.4f} ({tokens})"


def summary_key(run_id: str) -> str:
    """The run summary's artifact key. Not cut short: a run name has at most 63 characters,
    and names sharing their first 60 would share one artifact (cut to 64, they did)."""
    return f"run-{run_id}"


@task(name="publish-summary", cache_policy=NONE)
def publish_summary(config: PipelineConfig, plan: RunPlan, run: RunRow) -> str:
    """Attach the run summary to the flow run as a markdown artifact."""
    return str(
        create_markdown_artifact(
            markdown=summary_markdown(config, plan, run),
            key=summary_key(plan.run_id),
            description=f"Training run {plan.run_id}",
        )
    )
