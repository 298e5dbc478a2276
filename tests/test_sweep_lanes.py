"""Sweep lanes (`max_parallel`): at most that many trials at once, each lane keeping its
chips from one trial to the next, and trials that fail or cannot be admitted recorded
while the others run. A fake launcher stands in for the pipeline; the chip limit is real."""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager

import pytest

import tasks.sweep as sweep_tasks
from tasks.sweep import SweepPlan, TrialOutcome
from tasks.sweep_space import Trial
from tests.helpers import tiny_config
from tests.test_sweep import max_overlap


def launch(trial: Trial, plan: SweepPlan) -> TrialOutcome:
    time.sleep(0.3)
    if trial.params["fail"]:
        raise RuntimeError("launcher bug")
    return TrialOutcome(status="completed")


def plan_of(tmp_path, chips: list[int], lanes: int, limit: str) -> SweepPlan:
    base = tiny_config(tmp_path)
    trials = [
        Trial(index=i, run_name=f"l-t{i:02d}", params={"fail": i == 2}, config=base, chips=c)
        for i, c in enumerate(chips)
    ]
    return SweepPlan(
        sweep_id="l", trials=trials, via="subflow", trial_deployment="x/y", chip_limit=limit,
        chips=16, objective="eval_loss", max_parallel=lanes, base=base,
    )  # fmt: skip


@pytest.fixture
def acquisitions(monkeypatch) -> list[int]:
    """The chip counts acquired from the limit, in order."""
    seen: list[int] = []
    real = sweep_tasks.concurrency

    @contextmanager
    def counted(name, occupy, strict):
        seen.append(occupy)
        with real(name, occupy=occupy, strict=strict):
            yield

    monkeypatch.setattr(sweep_tasks, "concurrency", counted)
    return seen


def run(plan: SweepPlan) -> list:
    from prefect import flow

    @flow
    def lanes() -> list:
        return sweep_tasks.run_trials(plan, launch)

    return lanes()


def test_lanes_run_max_parallel_trials_at_once_and_keep_their_chips(
    tmp_path, prefect_harness, acquisitions
):
    from prefect.client.orchestration import get_client

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 16, 8, client)

    results = run(plan_of(tmp_path, [8] * 5, lanes=2, limit=limit))
    assert [r.index for r in results] == list(range(5))
    assert [r.status for r in results] == ["completed"] * 2 + ["crashed"] + ["completed"] * 2
    assert "launcher bug" in results[2].error  # its lane went on to the next trial
    # Never more than two at once (whether both lanes overlap depends on how fast the API
    # admits them: on SQLite a contended acquisition is retried 2 s later).
    assert max_overlap([(r.started_at, r.finished_at) for r in results]) <= 2
    assert acquisitions == [8, 8]  # once per lane, not per trial

    # One lane: chips are acquired again only for a trial that needs another count.
    acquisitions.clear()
    results = run(plan_of(tmp_path, [8, 4, 4, 8], lanes=1, limit=limit))
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert acquisitions == [8, 4, 8]
    assert max_overlap([(r.started_at, r.finished_at) for r in results]) == 1


def test_trials_a_lane_cannot_admit_are_recorded_as_never_run(tmp_path, prefect_harness):
    # A limit deleted since planning: strict admission refuses each trial, none runs
    # unlimited, and every trial still gets its result.
    results = run(plan_of(tmp_path, [8] * 3, lanes=2, limit=f"gone-{uuid.uuid4().hex[:8]}"))
    assert [r.status for r in results] == ["crashed"] * 3
    assert all(r.started_at == r.finished_at for r in results)
