"""The rows a run lands (`runs`, `step_metrics`, `eval_metrics`), built from its run
directory: `metrics.jsonl`, `events.jsonl` (the attempt and cost ledger), and this
invocation's verified checkpoint and evaluation."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime

from infra.metrics import EvalMetricRow, RunRow, StepMetricRow
from tasks.goodput import BUCKETS, ledger_events
from tasks.ledger import Ledger, compute_ledger, tokens_per_step
from tasks.plan import RunPlan
from tasks.pricing import price_or_unpriced
from workloads.checkpoint import VerifiedCheckpoint
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.evaluate import EvalResult
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
    # Only steps the run can have trained: a row past them (another run's lines, a hand
    # edit) landed in `step_metrics` beside a completed run's final step.
    last = verified.step if verified else config.train.steps
    metrics = [m for m in RunDir(plan.run_dir).step_metrics() if 1 <= m["step"] <= last]
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
    by_step = {m["step"]: m for m in metrics}
    final_step = verified.step if verified else (max(by_step) if by_step else None)
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
        final_step=final_step,
        # Only the rows of the first and final steps: a metrics.jsonl cut short or missing
        # its start has none, and the landing then keeps the stored losses
        # (`infra.metrics.landing_rule`) rather than another step's.
        train_loss_first=by_step.get(1, {}).get("loss"),
        train_loss_last=by_step.get(final_step, {}).get("loss"),
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
    events = ledger_events(run_dir)
    return compute_ledger(events, price, tokens_per_step(config))


# The `runs` columns `ledger_fields` fills.
LEDGER_COLUMNS = (
    "attempts",
    "preemptions",
    "goodput",
    "wall_s",
    *(f"{bucket}_s" for bucket in BUCKETS),
    "chips",
    "chip_hours",
    "usd_per_chip_hour",
    "price_source",
    "price_as_of",
    "cost_usd",
    "tokens_trained",
    "cost_per_million_tokens",
)


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


def missing_steps(steps: Sequence[StepMetricRow], final_step: int | None) -> list[int]:
    """The steps from 1 to `final_step` that have no row in `steps`: every one has a row
    in an undamaged metrics.jsonl."""
    have = {row.step for row in steps}
    return [s for s in range(1, (final_step or 0) + 1) if s not in have]


def describe_steps(steps: Sequence[int]) -> str:
    """`3-7, 9` for [3, 4, 5, 6, 7, 9]."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
