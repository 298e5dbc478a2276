"""Sweep lanes (`max_parallel`): at most that many trials at once, each lane keeping its
chips from one trial to the next, and trials that fail or cannot be admitted recorded
while the others run. A fake launcher stands in for the pipeline; the chip limit is real."""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager

import pytest

import tasks.sweep as sweep_tasks
import tasks.sweep_chips as sweep_chips
import tasks.sweep_deployed as sweep_deployed
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
    """The chip counts acquired from the limit, in order (granted, not asked for)."""
    seen: list[int] = []
    real = sweep_chips.concurrency

    @contextmanager
    def counted(name, occupy, **options):
        with real(name, occupy=occupy, **options):
            seen.append(occupy)
            yield

    monkeypatch.setattr(sweep_chips, "concurrency", counted)
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


def watching(trial: Trial, plan: SweepPlan) -> TrialOutcome:
    """A trial that runs until its sweep stops it, as `watch_slice` is stopped: by the
    event the sweep sets in `tasks.watch.STOPPING`, seen from the trial's own thread."""
    from tasks.watch import STOPPING

    STARTED.append(trial.index)
    stopping = STOPPING.get()
    if stopping is None or not stopping.wait(60):
        return TrialOutcome(status="completed")  # never told: ran to its end
    return TrialOutcome(status="failed", error="stopped watching")


STARTED: list[int] = []


@pytest.mark.parametrize("lanes", [2, 5])
def test_an_interrupted_sweep_starts_no_more_trials_and_stops_those_running(
    tmp_path, prefect_harness, lanes
):
    import os
    import signal
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.watch import STOPPING

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 16, 8, client)
    plan = plan_of(tmp_path, [8] * 5, lanes=lanes, limit=limit)
    STARTED.clear()

    def interrupt_once_two_run() -> None:
        deadline = time.monotonic() + 60
        while len(STARTED) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: any thread may receive it

    @flow
    def interrupted() -> list:
        threading.Thread(target=interrupt_once_two_run, daemon=True).start()
        return sweep_tasks.run_trials(plan, watching)

    start = time.monotonic()
    with pytest.raises(sweep_tasks.SweepInterrupted) as caught:
        interrupted()
    assert time.monotonic() - start < 45  # not the 60 s the running trials would take
    assert isinstance(caught.value.cause, KeyboardInterrupt)
    results = caught.value.results
    assert [r.index for r in results] == list(range(5))  # every trial has its result
    ran = sorted(STARTED)
    assert len(ran) == 2  # the two running when it came; none started after
    for r in results:
        if r.index in ran:
            assert (r.status, r.error) == ("failed", "stopped watching")
        else:
            assert r.status == "cancelled" and r.error.startswith("not started")
    assert STOPPING.get() is None  # this thread's later watches are not stopped


def test_an_interrupted_sweep_lands_its_trials_before_it_waits_for_them(tmp_path, prefect_harness):
    # A worker cancelling a deployed sweep kills it 30 s after its SIGTERM. The sweep
    # landed its rows only once its trials had stopped: trials slower to stop than that
    # left it killed with nothing landed.
    import os
    import signal
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client

    from infra.metrics import DuckDBSink
    from tasks.sweep_results import land_early
    from tasks.watch import STOPPING

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 16, 8, client)
    plan = plan_of(tmp_path, [8] * 3, lanes=2, limit=limit)
    started, landed = [], threading.Event()

    def slow_to_stop(trial, plan) -> TrialOutcome:
        started.append(trial.index)
        STOPPING.get().wait(60)
        landed.wait(30)  # still stopping when the sweep lands its trials
        return TrialOutcome(status="failed", error="stopped watching")

    def land_then_go_on(results) -> None:
        land_early(plan, results)
        landed.set()

    def interrupt_once_two_run() -> None:
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    @flow
    def interrupted() -> list:
        threading.Thread(target=interrupt_once_two_run, daemon=True).start()
        return sweep_tasks.run_trials(plan, slow_to_stop, land_then_go_on)

    start = time.monotonic()
    with pytest.raises(sweep_tasks.SweepInterrupted):
        interrupted()
    assert time.monotonic() - start < 25  # the trials did not wait out their 30 s
    rows = DuckDBSink(str(tmp_path / "metrics.duckdb")).query(
        "SELECT trial, status, error FROM sweeps WHERE sweep_id = 'l' ORDER BY trial"
    )
    assert [(t, status) for t, status, _ in rows] == [
        (0, "cancelled"),
        (1, "cancelled"),
        (2, "cancelled"),
    ]
    assert [error.split(":")[0] for _, _, error in rows] == ["stopping", "stopping", "not started"]


def test_a_second_signal_stops_the_wait_for_trials_slow_to_stop(tmp_path, prefect_harness):
    # The second signal left the wait as a bare KeyboardInterrupt, not SweepInterrupted:
    # the sweep landed no final rows and no leaderboard, and still waited for its trials.
    import os
    import signal
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 16, 8, client)
    plan = plan_of(tmp_path, [8] * 3, lanes=2, limit=limit)
    started, release, second, caught = [], threading.Event(), [], []

    def deaf(trial, plan) -> TrialOutcome:
        started.append(trial.index)
        release.wait(60)  # does not look at the sweep's stop
        return TrialOutcome(status="completed")

    def interrupt_twice() -> None:
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
        second.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    @flow
    def interrupted() -> list:
        threading.Thread(target=interrupt_twice, daemon=True).start()
        try:
            return sweep_tasks.run_trials(plan, deaf)
        except BaseException as exc:
            caught.append((time.monotonic(), exc))
            raise
        finally:
            release.set()  # lets the trials' threads end with the flow

    with pytest.raises(BaseException):  # noqa: B017 (old code: a KeyboardInterrupt)
        interrupted()
    ((when, exc),) = caught
    assert isinstance(exc, sweep_tasks.SweepInterrupted)
    assert isinstance(exc.cause, KeyboardInterrupt)
    assert when - second[0] < 5  # not the 60 s the trials would take
    outcomes = [(r.index, r.status, r.error.split(":")[0]) for r in exc.results]
    assert outcomes == [
        (0, "cancelled", "stopping"),
        (1, "cancelled", "stopping"),
        (2, "cancelled", "not started"),
    ]


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_sweep_stopped_while_its_trials_wait_for_chips_ends(tmp_path, prefect_harness, lanes):
    # Another sweep holds every chip of the limit. A trial's request for chips waited
    # without end: the stopped sweep waited for it (a second signal raised, but the
    # waiting threads kept the process from exiting) until the chips came free.
    import os
    import signal
    import threading

    from prefect import flow
    from prefect.client.orchestration import get_client

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 8, 8, client)
    held, free = threading.Event(), threading.Event()

    def other_sweep() -> None:
        with sweep_chips.concurrency(limit, occupy=8, strict=True):
            held.set()
            free.wait(40)  # then the old code's trials get in, and see the stop

    holder = threading.Thread(target=other_sweep, daemon=True)
    holder.start()
    assert held.wait(30)
    plan = plan_of(tmp_path, [8] * 3, lanes=lanes, limit=limit)
    STARTED.clear()

    @flow
    def interrupted() -> list:
        threading.Timer(3, os.kill, (os.getpid(), signal.SIGINT)).start()
        return sweep_tasks.run_trials(plan, watching)

    start = time.monotonic()
    try:
        with pytest.raises(sweep_tasks.SweepInterrupted) as caught:
            interrupted()
        assert time.monotonic() - start < 20  # not until the other sweep frees its chips
    finally:
        free.set()
        holder.join(30)
    assert STARTED == []
    outcomes = [(r.index, r.status, r.error.split(":")[0]) for r in caught.value.results]
    assert outcomes == [(i, "cancelled", "not started") for i in range(3)]


def test_a_deployed_trial_is_found_again_by_its_sweeps_retries_not_by_a_new_sweep_run(
    tmp_path, monkeypatch
):
    # The idempotency key was the sweep's name and the trial's index: a sweep of the same
    # name run again got its old trial runs back, failed ones included, and ran nothing.
    from types import SimpleNamespace

    keys = []

    def run_deployment(name, **kwargs):
        keys.append(kwargs["idempotency_key"])
        state = SimpleNamespace(type=SimpleNamespace(value="FAILED"), message="no capacity")
        return SimpleNamespace(id=uuid.uuid4(), state=state)

    monkeypatch.setattr(sweep_deployed, "run_deployment", run_deployment)
    plan = plan_of(tmp_path, [8], lanes=1, limit="x")
    trial = plan.trials[0]
    for flow_run in ["run-1", "run-1", "run-2"]:
        outcome = sweep_deployed.launch_deployment(
            trial, plan.model_copy(update={"flow_run_id": flow_run})
        )
        assert (outcome.status, outcome.error) == ("failed", "no capacity")
    assert keys[0] == keys[1] != keys[2]


class SignalDuringSubmit:
    """A sweep task whose second submission meets a Ctrl-C, once the first trial runs: the
    signal lands in the sweep's thread while it is still submitting its trials."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def submit(self, *args):
        self.calls += 1
        if self.calls == 2:
            deadline = time.monotonic() + 60
            while not STARTED and time.monotonic() < deadline:
                time.sleep(0.05)
            raise KeyboardInterrupt
        return self.real.submit(*args)


@pytest.mark.parametrize("lanes", [2, 3], ids=["lanes", "a-task-per-trial"])
def test_a_signal_while_the_trials_are_submitted_stops_those_submitted(
    tmp_path, prefect_harness, monkeypatch, lanes
):
    # The signal left the sweep function before its wait for the trials: the flow's task
    # runner waited for the submitted trial to train to its end, then the sweep crashed
    # with no `sweeps` rows (a SIGTERM right after `plan-sweep`).
    from prefect import flow
    from prefect.client.orchestration import get_client

    limit = f"chips-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        sweep_tasks.ensure_chip_limit(limit, 16, 8, client)
    plan = plan_of(tmp_path, [8] * 3, lanes=lanes, limit=limit)
    submitted = "run_lane" if lanes < 3 else "run_trial"
    monkeypatch.setattr(sweep_tasks, submitted, SignalDuringSubmit(getattr(sweep_tasks, submitted)))
    STARTED.clear()

    @flow
    def interrupted() -> list:
        return sweep_tasks.run_trials(plan, watching)

    start = time.monotonic()
    with pytest.raises(sweep_tasks.SweepInterrupted) as caught:
        interrupted()
    assert time.monotonic() - start < 40  # not the 60 s the submitted trial would take
    assert isinstance(caught.value.cause, KeyboardInterrupt)
    assert STARTED == [0]
    outcomes = [(r.index, r.status, r.error.split(":")[0]) for r in caught.value.results]
    assert outcomes == [
        (0, "failed", "stopped watching"),
        (1, "cancelled", "not started"),
        (2, "cancelled", "not started"),
    ]
