"""`tpupipe report RUN_ID`: a run's timeline, goodput and cost, read from its run directory.

Everything comes from the files the run left (`config.json`, `events.jsonl`,
`metrics.jsonl`, `eval.json`), so a report works for a finished, failed or running run,
on a local or gs:// storage root, with no Prefect and no metrics sink.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from etils import epath

from tasks.goodput import BUCKETS, AttemptTimeline, ledger_events
from tasks.ledger import Ledger, compute_ledger, tokens_per_step
from tasks.pricing import Price, price_for, recorded_price, reprice
from workloads.config import CostConfig, PipelineConfig
from workloads.config_file import ConfigError, load_workload_config
from workloads.rundir import CONFIG, EVAL, RunDir, read_json

log = logging.getLogger(__name__)

REPORT_PNG = "report.png"
# Columns of the timeline table: the buckets an attempt has (idle is between attempts).
ATTEMPT_BUCKETS = tuple(b for b in BUCKETS if b != "idle")


class RunNotFound(LookupError):
    """No run directory of that id under the storage root."""


@dataclass
class RunReport:
    """What the report shows of one run."""

    run_id: str
    run_dir: str
    config: PipelineConfig | None  # None: the run never got as far as its config.json
    ledger: Ledger
    price: Price  # the config's: what its slice costs now (an attempt may have run on another)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None


def find_run_dir(root: str, run_id: str) -> str:
    """`{root}/runs/{run_id}`, which must exist.

    Raises:
        RunNotFound: with the runs that do exist there (up to 10), to pick from, or why
            the runs directory could not be read.
    """
    runs = epath.Path(root) / "runs"
    run_dir = runs / run_id
    # "." and ".." are directories too: the runs directory and the storage root.
    if run_id not in ("", ".", "..") and "/" not in run_id and run_dir.is_dir():
        return str(run_dir)
    try:
        # In gs:// a listing is the only way to tell "not there" from "could not look":
        # is_dir answers False for any error (no credentials, no network).
        remote = "://" in root
        known = (
            sorted(p.name for p in runs.iterdir() if p.is_dir()) if remote or runs.is_dir() else []
        )
    except FileNotFoundError:
        known = []
    except Exception as exc:
        where = f"{root.rstrip('/')}/runs"
        raise RunNotFound(f"cannot read {where}: {type(exc).__name__}: {exc}") from None
    listed = ", ".join(known[:10]) + (", …" if len(known) > 10 else "")
    there = f"runs there: {listed}" if known else "no runs there"
    raise RunNotFound(f"no run {run_id!r} under {runs} ({there})")


def load_report(root: str, run_id: str, cost: CostConfig | None = None) -> RunReport:
    """Read one run's report from its run directory.

    Args:
        root: the storage root (a directory or gs://bucket/prefix).
        run_id: the run's id (its name).
        cost: price with this cost section instead of the run's own (to re-price a run):
            each attempt on the slice it ran on, at this section's prices.

    Raises:
        RunNotFound: no such run under `root`.
        PriceTableError: the price table to use cannot be read.
    """
    run_dir = find_run_dir(root, run_id)
    unpriced = "the run has no config.json"
    try:
        config = _run_config(run_dir)
    except ConfigError as exc:
        # Written by another version (a field since renamed) or damaged: the timeline
        # needs only events.jsonl, so the report goes on, unpriced, saying why.
        config, unpriced = None, str(exc)
    if config is not None and cost is not None:
        config = config.model_copy(update={"cost": cost})
    # Each attempt is priced as it recorded (its slice and price); `price` is for an
    # attempt recorded by an older version, which recorded neither.
    price_of = recorded_price
    if config is None:
        price = Price(0, "on-demand", None, None, None, f"not priced: {unpriced}")
        per_step = 0
    else:
        price, per_step = price_for(config), tokens_per_step(config)
        if cost is not None:
            price_of = functools.partial(reprice, config)

    ledger = compute_ledger(ledger_events(run_dir), price, per_step, price_of)
    return RunReport(
        run_id=run_id,
        run_dir=run_dir,
        config=config,
        ledger=ledger,
        price=price,
        metrics=RunDir(run_dir).step_metrics(),  # a step trained again: its last row
        evaluation=_evaluation(epath.Path(run_dir) / EVAL),
    )


def _evaluation(path: epath.Path) -> dict | None:
    """`eval.json`, or None. Damaged, it is left out with a warning naming it, as a
    damaged config.json is; so is one whose loss or step is not a number (a loss "x"
    failed the report with a format error)."""
    ev = read_json(path, unreadable_as_missing=True)
    if ev is None:
        return None
    loss, step = ev.get("loss"), ev.get("step")
    if isinstance(loss, int | float) and isinstance(step, int) and not isinstance(step, bool):
        return ev
    log.warning("%s holds loss %r at step %r, not an evaluation: left out", path, loss, step)
    return None


def _run_config(run_dir: str) -> PipelineConfig | None:
    path = epath.Path(run_dir) / CONFIG
    if not path.exists():
        return None
    return load_workload_config(str(path)).pipeline


def _short(reason: str, most: int = 300) -> str:
    """A reason on one line, at most `most` characters."""
    line = " ".join(str(reason).split())
    return line if len(line) <= most else line[: most - 1] + "…"


def format_report(report: RunReport) -> str:
    """The timeline as plain text: one line per attempt, then the run's totals."""
    ledger = report.ledger
    good = ledger.goodput
    lines = [f"run {report.run_id}: {report.run_dir}", _slice_line(report), ""]
    if not ledger.attempts:
        return "\n".join(
            [*lines, "no attempts recorded yet (events.jsonl holds no event of an attempt)"]
        )
    t0 = origin(ledger)
    started = datetime.fromtimestamp(t0, UTC).isoformat(timespec="seconds")
    lines.append(f"times in seconds from the first provisioning request, {started}")
    header = ["attempt", "start", "end", "outcome", *ATTEMPT_BUCKETS]
    header += ["chips", "billed", "chip-h", "cost"]
    rows = [header]
    for a in ledger.attempts:
        line = a.timeline
        seconds = dict.fromkeys(ATTEMPT_BUCKETS, 0.0)
        for segment in line.segments:
            seconds[segment.bucket] += segment.seconds
        end = line.deleted if line.deleted is not None else line.ended
        rows.append(
            [
                str(line.attempt),
                f"+{_start(line) - t0:.1f}",
                f"+{end - t0:.1f}",
                "stalled" if line.stalled else line.outcome or "running?",
                *(f"{seconds[b]:.1f}" for b in ATTEMPT_BUCKETS),
                str(a.price.chips),
                f"{a.billed_s:.1f}",
                f"{a.chip_hours:.4f}",
                _usd(a.cost_usd),
            ]
        )
    lines += _table(rows)
    # Why an attempt that did not complete ended (a preemption, the error, the signal): the
    # ledger had it, and the report showed only the outcome.
    lines += [
        f"attempt {t.attempt} {'stalled' if t.stalled else t.outcome}: {_short(t.reason)}"
        for t in (a.timeline for a in ledger.attempts)
        if t.reason and t.outcome != "completed"
    ]
    # A rerun may change the slice: an attempt that ran on another is billed as it ran.
    lines += [
        f"attempt {a.timeline.attempt} ran on {_ran_on(a.price)}"
        for a in ledger.attempts
        if a.price != report.price
    ]
    badput = ", ".join(f"{b} {good.seconds[b]:.1f}s" for b in BUCKETS if b != "productive")
    ratio = "n/a" if good.goodput is None else f"{good.goodput:.1%}"
    # A rerun of the run name appends to the ledger; the wall leaves out the gaps between.
    over = f" over {good.invocations} invocations" if good.invocations > 1 else ""
    # Counted with the preemptions (their budget), and told apart: each was lost without
    # a notice before saving anything new, which a run failed by the stall guard ends with.
    stalled = f" (stalled {good.stalled})" if good.stalled else ""
    lines += [
        "",
        f"attempts {good.attempts}, preempted {good.preemptions}{stalled}; "
        f"wall {good.wall_s:.1f}s{over}; "
        f"goodput {ratio} (productive {good.seconds['productive']:.1f}s)",
        f"badput: {badput}",
        _tokens_line(ledger, report.config is not None),
        f"cost: {_usd(ledger.cost_usd)} for {ledger.chip_hours:.4f} chip-hours "
        f"({_chips(ledger)}); per 1M training tokens: {_per_million(ledger)}",
    ]
    loss = _loss_line(report)
    return "\n".join([*lines, *([loss] if loss else [])])


def _tokens_line(ledger: Ledger, sized: bool) -> str:
    """The steps that count and their tokens; without a config (unreadable), a step's
    tokens are unknown, not 0 (it read "= 0 training tokens" beside a cost)."""
    if not sized:
        return f"steps that count: {ledger.steps} (tokens unknown: no readable config.json)"
    return (
        f"steps that count: {ledger.steps} x {ledger.tokens_per_step:,} tokens "
        f"= {ledger.tokens:,} training tokens"
    )


def origin(ledger: Ledger) -> float:
    """The report's time zero: the run's first provisioning request (epoch seconds)."""
    return min(_start(a.timeline) for a in ledger.attempts)


def _start(line: AttemptTimeline) -> float:
    """An attempt's first milestone: its provisioning request (else its end)."""
    return line.ended if line.requested is None else line.requested


def _chips(ledger: Ledger) -> str:
    """`8 chips`, or each attempt's chips when a rerun ran on another slice."""
    counts = [a.price.chips for a in ledger.attempts] or [ledger.price.chips]
    if len(set(counts)) == 1:
        return f"{counts[0]} chips"
    return "chips per attempt: " + ", ".join(map(str, counts))


def _ran_on(price: Price) -> str:
    where = f" ({price.capacity})" + (f" in {price.region}" if price.accelerator else "")
    return f"{price.chips} chips, {price.accelerator or 'local'}{where}: {price.describe()}"


def _slice_line(report: RunReport) -> str:
    price = report.price
    if report.config is None:
        return f"slice: unknown; {price.describe()}"
    sl = report.config.slice
    if sl.provider == "gcp":
        return f"slice: {sl.accelerator_type} ({price.capacity}) in {price.region}; " + (
            price.describe()
        )
    priced = f"priced as {price.accelerator} ({price.capacity}) in {price.region}: "
    return f"slice: local, {sl.devices} devices; {priced if price.accelerator else ''}" + (
        price.describe()
    )


def _loss_line(report: RunReport) -> str | None:
    rows = sorted((m for m in report.metrics if m.get("loss") is not None), key=_step)
    if not rows:
        return None
    text = f"train loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} (step {_step(rows[-1])})"
    ev = report.evaluation or {}
    if ev.get("loss") is not None:
        text += f"; eval loss {ev['loss']:.4f} at step {ev.get('step')}"
    return text


def _step(row: dict[str, Any]) -> int:
    return row["step"]


def _usd(value: float | None) -> str:
    return "not priced" if value is None else f"${value:.4f}"


def _per_million(ledger: Ledger) -> str:
    """The cost per 1M tokens kept; a priced run that kept none says so, not 'not priced'."""
    if ledger.cost_usd is not None and not ledger.steps:
        return "none (no step kept)"
    return _usd(ledger.cost_per_million_tokens)


def _table(rows: list[list[str]]) -> list[str]:
    """Right-aligned columns (the outcome, a word, left-aligned)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i == 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
