"""Land a run's metrics in the sink and publish its summary artifact."""

from __future__ import annotations

from datetime import datetime

from etils import epath
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from infra.metrics import RunRow, build_sink
from infra.metrics.duckdb_sink import MetricsLocked
from tasks.attempts import describe_error
from tasks.landing_rows import (  # build_rows and the ledger's: re-exported
    LEDGER_COLUMNS,
    build_rows,
    describe_steps,
    ledger_fields,
    missing_steps,
    run_ledger,
)
from tasks.plan import RunPlan, run_events
from tasks.progress import loss_curve_link, write_loss_curve
from tasks.run_owner import RunOwnerConflict, earlier_life, owner_problem
from workloads.checkpoint import VerifiedCheckpoint
from workloads.config import PipelineConfig
from workloads.evaluate import EvalResult
from workloads.events import trained_by_hand

__all__ = [
    "INTERRUPTED_WAIT_S",
    "build_rows",
    "cost_text",
    "describe_error",
    "land_failure",
    "land_metrics",
    "ledger_fields",
    "per_million_text",
    "publish_summary",
    "run_ledger",
    "summary_key",
    "summary_markdown",
]


# How long a stopped run's row waits for its sink before it gives up: for a DuckDB file
# another process holds (a notebook, another run's landing), or retrying each BigQuery call
# (an unreachable BigQuery held a SIGTERMed run for 300 s more). `docker stop` sends
# SIGKILL 10 s after its SIGTERM, and the crash hooks and the temporary API server's stop
# still come after it.
INTERRUPTED_WAIT_S = 5.0
# How long the row of a run whose landing failed waits: the sink was just waited for, to
# its full deadline, and a second full one doubled the run's end (570 s with BigQuery down).
AFTER_FAILED_LANDING_WAIT_S = 30.0


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
    not an `Exception`) waits at most `INTERRUPTED_WAIT_S` for its sink, so it still exits
    promptly. A run that failed with its evaluation done failed in its landing, the last
    step that can raise: its row waits `AFTER_FAILED_LANDING_WAIT_S`. Landing a failed run
    keeps what an earlier invocation landed and this one has no value for (its
    evaluation, its step rows): see `infra.metrics.rows`.
    """
    if isinstance(exc, MetricsLocked):
        # Its landing just waited for the file's holder: the row would wait as long again
        # for the same holder (60 s in all, probe V). Run again once it is closed.
        exc.add_note("(its runs row was not landed either: run again once the file is closed)")
        return
    if not isinstance(exc, Exception):
        wait = INTERRUPTED_WAIT_S
    else:
        wait = AFTER_FAILED_LANDING_WAIT_S if result is not None else None
    try:
        land_metrics(config, plan, started_at, verified, result, describe_error(exc), wait_s=wait)
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
    wait_s: float | None = None,
) -> RunRow:
    """Land the run idempotently: landing twice leaves one copy of every row.

    Args:
        config: the run's config.
        plan: its plan (run directory, metrics path).
        started_at: when this invocation started.
        verified: the verified final checkpoint, if this invocation got that far.
        result: its evaluation, if this invocation got that far.
        error: why the run failed; None lands it completed.
        wait_s: how long the sink may wait for its backend (`infra.metrics.build_sink`:
            a DuckDB file another process holds, each BigQuery call's retries); None: the
            sink's default.

    Returns:
        The `runs` row as the sink now holds it, with the results it kept from an earlier
        landing (a rerun over a damaged metrics.jsonl, a failed rerun); the row this
        invocation built if it cannot be read back.
    """
    run, steps, evals = build_rows(config, plan, started_at, verified, result, error)
    logger = get_run_logger()
    if missing := missing_steps(steps, run.final_step):
        logger.warning(
            "%s/metrics.jsonl has no row for step %s of 1-%d (the file was cut short or "
            "damaged): the rows landed before for those steps, and the run's stored first "
            "and final losses where it lacks them, are kept",
            plan.run_dir,
            describe_steps(missing),
            run.final_step,
        )
    sink = build_sink(config.metrics.sink, plan.metrics_path, config.metrics, wait_s)
    sink.ensure_tables()
    stored = sink.read_run(run.run_id)
    # Checked at the start too (`check_run_owner`), but another storage root's run of this
    # name may have landed since: two at once replaced and mixed each other's rows. A
    # moved or copied root was said at the start.
    if (problem := owner_problem(config, plan, stored, say=False)) is not None:
        raise RunOwnerConflict(f"not landed: {problem}; this run's results stay in its directory")
    if fresh := earlier_life(plan, stored):
        logger.info(
            "the rows of run %s in %s are of an earlier run of that name in %s (flow run %s, "
            "started %s), deleted since: this run's replace them all",
            run.run_id,
            plan.metrics_path,
            plan.run_dir,
            stored.flow_run_id,
            stored.started_at,
        )
        stored = None  # nothing of it is kept
    if error is not None and result is None and stored is not None and stored.eval_loss is not None:
        # A failed landing keeps the stored evaluation (landing_rule): it keeps the config
        # that evaluation was made with too. A rerun with other eval settings, stopped while
        # it evaluated, paired its own settings with the earlier evaluation's loss.
        run = run.model_copy(update={"config_json": stored.config_json})
    if error is None and run.final_step and not run.tokens_trained:
        # A finished run trained steps: a ledger that counts none read a damaged events.jsonl
        # (emptied, cut short), and would land zero goodput, wall time and cost over the
        # run's real ones. The columns landed before stay; with none, they are unknown.
        why = (
            "its steps were trained by a workload started by hand, whose events the ledger "
            "leaves out"
            if trained_by_hand(plan.run_dir)
            else "cut short or damaged"
        )
        logger.warning(
            "%s/events.jsonl records no step of an attempt of this finished run (%s): its "
            "goodput and cost columns are %s",
            plan.run_dir,
            why,
            "kept as landed before" if stored else "left NULL (unknown), not 0",
        )
        kept = {k: getattr(stored, k) if stored else None for k in LEDGER_COLUMNS}
        run = run.model_copy(update=kept)
    landed = sink.land(run, steps, evals, fresh=fresh)
    # The invocation whose row this is, recorded in the run directory (no attempt's: the
    # ledger counts no time for it): a moved storage root's runs are known by it
    # (`tasks.run_owner.owner_problem`), a rerun that only evaluated again included, and
    # so is a run stopped before its directory existed (while sharding), whose next
    # invocation is no new run of the name (`tasks.run_owner.earlier_life`).
    try:
        epath.Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
        run_events(plan, None).emit("landed", status=run.status)
    except Exception as exc:  # landed: the record only helps a later move of the root
        logger.warning("could not record the landing in %s/events.jsonl: %s", plan.run_dir, exc)
    logger.info(
        "landed run %s (%s): %d step rows, %d eval rows in %s%s",
        run.run_id,
        run.status,
        landed.steps,  # one per step: a step trained again after a resume counts once
        landed.evals,
        plan.metrics_path,
        ""
        if error is None
        else " (as a failed run)"
        if fresh
        else " (as a failed run: the rows landed before it are kept)",
    )
    try:
        return sink.read_run(run.run_id) or run
    except Exception as exc:  # landed: reading it back is for the summary only
        logger.warning("could not read back the landed runs row of %s: %s", run.run_id, exc)
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
def publish_summary(config: PipelineConfig, plan: RunPlan, run: RunRow) -> str | None:
    """Attach the run summary to the flow run as a markdown artifact; its id, or None if it
    could not be made (logged: the run has trained and landed, and a summary that fails,
    an API that refuses the artifact, must not turn it into a failed run)."""
    try:
        return str(
            create_markdown_artifact(
                markdown=summary_markdown(config, plan, run),
                key=summary_key(plan.run_id),
                description=f"Training run {plan.run_id}",
            )
        )
    except Exception as exc:
        get_run_logger().warning(
            "could not publish the run summary: %s: %s", type(exc).__name__, exc
        )
        return None
