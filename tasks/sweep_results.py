"""A sweep's results: ranked trials, the leaderboard artifact and the `sweeps` table rows."""

from __future__ import annotations

import json
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE
from pydantic import BaseModel

from infra.metrics import RunRow, SweepRow, build_sink
from tasks.landing import INTERRUPTED_WAIT_S
from tasks.plan import metrics_path
from tasks.sweep_models import NOT_STARTED, SweepPlan, TrialResult, read_run


class SweepFailed(RuntimeError):
    """No trial of the sweep completed."""


class SweepSummary(BaseModel):
    """What the sweep flow returns: the best trial and the counts."""

    sweep_id: str
    objective: str
    best_trial: int
    best_run_id: str
    best_value: float
    best_params: dict[str, Any]
    trials: int
    completed: int
    chip_hours: float = 0.0  # every trial with a landed run, failed ones included
    cost_usd: float | None = None  # the priced trials' total; None: none was priced


def objective_value(result: TrialResult, objective: str) -> float | None:
    """The trial's objective (lower is better), or None if it has none to rank by."""
    if result.status != "completed" or result.run is None:
        return None
    return getattr(result.run, objective)


def ranks(results: list[TrialResult], objective: str) -> dict[int, int]:
    """Trial index -> rank (1 = best) of every trial with an objective value; ties go to
    the earlier trial."""
    scored = [(v, r.index) for r in results if (v := objective_value(r, objective)) is not None]
    return {index: rank for rank, (_, index) in enumerate(sorted(scored), 1)}


def leaderboard(results: list[TrialResult], objective: str) -> list[dict[str, Any]]:
    """The leaderboard's rows: ranked trials best first, then the unranked in trial order.

    Each row: rank, trial, run, status, the objective, every searched field, minutes the
    trial held its chips, seconds it waited for them, and the error of a failed trial.
    """
    rank = ranks(results, objective)
    ordered = sorted(results, key=lambda r: (rank.get(r.index, len(results) + 1), r.index))
    rows = []
    for r in ordered:
        value = objective_value(r, objective)
        rows.append(
            {
                "rank": rank.get(r.index, ""),
                "trial": r.index,
                "run": r.run_id,
                "status": r.status,
                objective: "" if value is None else round(value, 5),
                **r.params,
                "minutes": round((r.finished_at - r.started_at).total_seconds() / 60, 2),
                "cost_usd": _rounded(r.run.cost_usd if r.run else None, 4),
                "goodput": _rounded(r.run.goodput if r.run else None, 3),
                "waited_s": round(r.waited_s, 1),
                "error": (r.error or "")[:200],
            }
        )
    return rows


def _reason(r: TrialResult) -> str | None:
    """Why the trial did not complete, as its `sweeps` row says it. A cancelled trial's run
    row, when it landed one, says what stopped it: the flow run's own message for a
    deployed trial cancelled by its stopped sweep was Prefect's "Flow run was cancelled
    successfully." (probe X)."""
    if r.status == "cancelled" and r.run is not None and r.run.error:
        return r.run.error
    return r.error


def sweep_rows(plan: SweepPlan, results: list[TrialResult]) -> list[SweepRow]:
    """One `sweeps` row per trial, linking it to its run and flow run."""
    rank = ranks(results, plan.objective)
    return [
        SweepRow(
            sweep_id=plan.sweep_id,
            trial=r.index,
            run_id=r.run_id,
            sweep_flow_run_id=plan.flow_run_id,
            flow_run_id=r.flow_run_id,
            status=r.status,
            error=_reason(r),
            params_json=json.dumps(r.params, sort_keys=True),
            chips=r.chips,
            objective=plan.objective,
            objective_value=objective_value(r, plan.objective),
            rank=rank.get(r.index),
            is_best=rank.get(r.index) == 1,
            eval_loss=r.run.eval_loss if r.run else None,
            eval_bits_per_byte=r.run.eval_bits_per_byte if r.run else None,
            train_loss_last=r.run.train_loss_last if r.run else None,
            **_cost_fields(r.run),
            started_at=r.started_at,
            finished_at=r.finished_at,
        )
        for r in results
    ]


def _cost_fields(run: RunRow | None) -> dict[str, Any]:
    names = ("goodput", "chip_hours", "cost_usd", "tokens_trained", "cost_per_million_tokens")
    return {name: getattr(run, name) if run else None for name in names}


def _rounded(value: float | None, digits: int) -> float | str:
    return "" if value is None else round(value, digits)


def totals(results: list[TrialResult]) -> tuple[float, float | None]:
    """(chip-hours, USD) of the sweep: the sums over trials with a landed run; the cost
    is None when no trial was priced."""
    runs = [r.run for r in results if r.run is not None]
    costs = [run.cost_usd for run in runs if run.cost_usd is not None]
    return sum(run.chip_hours or 0.0 for run in runs), (sum(costs) if costs else None)


def summarize(plan: SweepPlan, results: list[TrialResult]) -> SweepSummary:
    """The sweep's summary, naming its best trial.

    Raises:
        SweepFailed: no trial completed with an objective value, with each trial's error.
    """
    rank = ranks(results, plan.objective)
    best = next((r for r in results if rank.get(r.index) == 1), None)
    if best is None:
        errors = "; ".join(f"trial {r.index}: {r.error or r.status}" for r in results)
        raise SweepFailed(f"sweep {plan.sweep_id}: no trial completed ({errors})")
    chip_hours, cost = totals(results)
    return SweepSummary(
        sweep_id=plan.sweep_id,
        objective=plan.objective,
        best_trial=best.index,
        best_run_id=best.run_id,
        best_value=objective_value(best, plan.objective),
        best_params=best.params,
        trials=len(results),
        completed=sum(r.status == "completed" for r in results),
        chip_hours=chip_hours,
        cost_usd=cost,
    )


def leaderboard_description(plan: SweepPlan, results: list[TrialResult]) -> str:
    """The leaderboard artifact's markdown description: the best trial, then the counts."""
    done = sum(r.status == "completed" for r in results)
    try:
        best = summarize(plan, results)
    except SweepFailed:
        head = f"Sweep `{plan.sweep_id}`: no trial completed."
    else:
        params = ", ".join(f"{k}={v!r}" for k, v in best.best_params.items())
        head = (
            f"Sweep `{plan.sweep_id}`: best trial **{best.best_trial}** "
            f"(run `{best.best_run_id}`), {plan.objective} {best.best_value:.5f} ({params})."
        )
    chip_hours, cost = totals(results)
    spent = "not priced" if cost is None else f"${cost:.2f}"
    return (
        f"{head} {done} of {len(results)} trials completed; {chip_hours:.3f} chip-hours, {spent}."
    )


def artifact_key(sweep_id: str) -> str:
    """The leaderboard's artifact key (lowercase letters, digits and dashes)."""
    return f"leaderboard-{sweep_id}"


@task(name="collect-trial-runs", cache_policy=NONE)
def attach_landed_runs(
    plan: SweepPlan, results: list[TrialResult], wait_s: float | None = None
) -> list[TrialResult]:
    """The results with each trial's `runs` row, read from the sink for the trials whose
    launcher had none (a failed run lands its row too: its chip-hours were spent).

    Only a row the trial's own flow run landed counts: a trial refused before landing
    anything would otherwise be credited with the row an earlier run of its name left
    (an earlier sweep of the same name), its eval loss and chip-hours. Once a read fails
    (after its retries, within `wait_s`: see `build_sink`), the other trials' are not
    tried: with BigQuery unreachable, each waited its 300 s in turn, after a SIGTERM."""
    out, readable = [], True
    for r in results:
        if r.run is None and r.flow_run_id and readable:
            try:
                run = read_run(plan.base, r.run_id, wait_s)
            except Exception as exc:  # a missing cost must not lose the sweep's results
                get_run_logger().warning(
                    "trial %d: no runs row read, nor any later trial's: %s", r.index, exc
                )
                run, readable = None, False
            if run is not None and run.flow_run_id == r.flow_run_id:
                r = r.model_copy(update={"run": run})
        out.append(r)
    return out


@task(name="publish-leaderboard", cache_policy=NONE)
def publish_leaderboard(plan: SweepPlan, results: list[TrialResult]) -> str:
    """Attach the leaderboard to the sweep's flow run as a table artifact."""
    description = leaderboard_description(plan, results)
    create_table_artifact(
        table=leaderboard(results, plan.objective),
        key=artifact_key(plan.sweep_id),
        description=description,
    )
    get_run_logger().info(description)
    return description


@task(name="land-sweep", cache_policy=NONE)
def land_sweep(plan: SweepPlan, results: list[TrialResult], wait_s: float | None = None) -> int:
    """Land the sweep's trials in the `sweeps` table; landing again replaces them, unless
    no trial started in this invocation (stopped while it waited for chips): its rows
    would all read "not started" over what earlier invocations of the sweep landed, their
    trials' statuses, errors and spend (probe V). `wait_s`: how long the sink may wait for
    its backend (`build_sink`). Returns the rows landed."""
    never = NOT_STARTED.model_dump(include={"status", "error", "flow_run_id"})
    if results and all(r.model_dump(include=never.keys()) == never for r in results):
        get_run_logger().warning(
            "no trial of sweep %s started before it was stopped: no sweeps row landed (any "
            "an earlier run of the sweep landed stays as it was)",
            plan.sweep_id,
        )
        return 0
    sink = build_sink(plan.base.metrics.sink, metrics_path(plan.base), plan.base.metrics, wait_s)
    landed = sink.land_sweep(sweep_rows(plan, results))
    get_run_logger().info("landed %d trials of sweep %s", landed, plan.sweep_id)
    return landed


def land_early(plan: SweepPlan, results: list[TrialResult]) -> None:
    """Land the trials as an interrupted sweep knows them, before it waits for those under
    way to stop; the landing once they have stopped replaces these rows. Never raises:
    the sweep still has its trials to stop."""
    try:
        land_sweep(plan, results, INTERRUPTED_WAIT_S)
    except Exception as exc:
        get_run_logger().warning("could not land the interrupted sweep's trials yet: %s", exc)
