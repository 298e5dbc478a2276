"""Training progress artifact and loss-curve plot, from a run directory's own files."""

from __future__ import annotations

import json
import struct
import uuid

import pytest

from tasks.progress import (
    TrainingProgress,
    loss_curve_link,
    progress_key,
    write_loss_curve,
)
from workloads.rundir import RunDir


class FakeArtifacts:
    """Records the create/update calls `TrainingProgress` makes."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[tuple[str, float, str]] = []
        self.fail_after = fail_after

    def create(self, progress, key, description):
        self.calls.append(("create", progress, description))
        return uuid.uuid4()

    def update(self, artifact_id, progress, description):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise ConnectionError("API gone")
        self.calls.append(("update", progress, description))


def test_progress_follows_the_heartbeat_and_skips_small_moves():
    fake = FakeArtifacts()
    bar = TrainingProgress(
        200,
        progress_key("r1"),
        min_step=5.0,
        create=fake.create,
        update=fake.update,
        min_interval_s=0.0,
    )
    assert bar.update(None) is None and bar.update({"phase": "starting"}) is None
    beats = [
        {"step": 0, "phase": "compiling"},
        {"step": 4, "loss": 5.1, "phase": "training"},  # 2%: phase changed, sent
        {"step": 8, "loss": 4.9, "phase": "training"},  # 4%: under min_step from 2%
        {"step": 20, "loss": 4.1, "phase": "training"},  # 10%
        {"step": 20, "loss": 4.1, "phase": "saving"},  # same step, new phase
        {"step": 200, "loss": 2.0, "phase": "training"},
        {"step": 200, "loss": 2.0, "phase": "finished"},
    ]
    shown = [bar.update(b) for b in beats]
    assert shown == [0.0, 2.0, None, 10.0, 10.0, 100.0, 100.0]
    assert [c[0] for c in fake.calls] == ["create"] + ["update"] * 5
    assert fake.calls[2][2] == "step 20 of 200, loss 4.1000 (training)"


def test_progress_moves_at_most_every_min_interval_unless_the_phase_changes():
    fake, now = FakeArtifacts(), [0.0]
    bar = TrainingProgress(
        100, "k", create=fake.create, update=fake.update, min_interval_s=5.0, clock=lambda: now[0]
    )
    shown = []
    for step, at, phase in [
        (1, 0.0, "training"),  # created
        (10, 1.0, "training"),  # 1 s later: held back
        (20, 5.0, "training"),  # 5 s after the last call: sent
        (30, 6.0, "saving"),  # a new phase always goes
        (99, 7.0, "saving"),  # held back
        (100, 7.5, "finished"),  # the end always goes
    ]:
        now[0] = at
        shown.append(bar.update({"step": step, "phase": phase}))
    assert shown == [1.0, None, 20.0, 30.0, None, 100.0]
    assert len(fake.calls) == 4


def test_progress_errors_never_reach_the_watch_loop():
    fake = FakeArtifacts(fail_after=1)
    bar = TrainingProgress(10, "k", create=fake.create, update=fake.update, min_interval_s=0.0)
    assert bar.update({"step": 1, "phase": "training"}) == 10.0
    assert bar.update({"step": 5, "phase": "training"}) is None  # the API failed: logged
    assert bar.update({"step": 9, "phase": "training"}) is None  # and no longer tried
    assert len(fake.calls) == 1


def test_loss_curve_is_a_png_of_the_logged_steps(tmp_path):
    run = RunDir(tmp_path / "runs" / "r1")
    run.path.mkdir(parents=True)
    assert write_loss_curve(str(run.path)) is None  # nothing logged yet
    run.append_metrics([{"step": s, "loss": 5.0 / s, "time": 0.0} for s in range(1, 41)])
    (run.path / "eval.json").write_text(json.dumps({"step": 40, "loss": 0.2}))

    path = write_loss_curve(str(run.path))

    data = (run.path / "loss_curve.png").read_bytes()
    assert path == str(run.path / "loss_curve.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (640, 360)
    link = loss_curve_link(path)
    assert link.startswith("[loss_curve.png](file:///") and path in link


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (None, "n/a"),
        (
            "gs://b/runs/r1/loss_curve.png",
            "[loss_curve.png](https://storage.cloud.google.com/b/runs/r1/loss_curve.png)",
        ),
    ],
)
def test_loss_curve_link(path, expected):
    assert loss_curve_link(path).startswith(expected)


def test_an_unreadable_eval_json_leaves_the_eval_point_off_the_loss_curve(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics([{"step": s, "loss": 5.0 / s} for s in range(1, 5)])
    (tmp_path / "eval.json").write_text('{"step": 4, "lo')  # a failed run's, torn
    assert write_loss_curve(str(tmp_path)) == str(tmp_path / "loss_curve.png")


def test_a_loss_curve_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, caplog):
    # A full disk under a run that trained and landed turned it into a failed run.
    run = RunDir(tmp_path)
    run.append_metrics([{"step": s, "loss": 5.0 / s} for s in range(1, 5)])
    (tmp_path / "loss_curve.png").mkdir()  # cannot be written as a file
    assert write_loss_curve(str(tmp_path)) is None
    assert "could not write the loss curve" in caplog.text and "loss_curve.png" in caplog.text
    assert loss_curve_link(None) == "n/a"


class Beats:
    """A run directory whose heartbeat is `beats` in turn (the last one for good)."""

    def __init__(self, beats: list[dict]) -> None:
        self.beats = beats

    def read_status(self) -> dict:
        return self.beats.pop(0) if len(self.beats) > 1 else self.beats[0]

    def host_failures(self) -> dict:
        return {}


class Ends:
    """A slice READY for `polls` looks, then TERMINATED with `code`."""

    def __init__(self, polls: int, code: int) -> None:
        self.polls, self.code = polls, code

    def status(self, name: str):
        from infra.slices import SliceState, SliceStatus

        self.polls -= 1
        if self.polls >= 0:
            return SliceStatus(name, SliceState.READY, None)
        return SliceStatus(name, SliceState.TERMINATED, self.code)


@pytest.mark.parametrize(
    ("code", "last", "said"),
    [
        (
            0,
            {"phase": "finished", "step": 12, "loss": 2.5},
            "step 12 of 12, loss 2.5000 (finished)",
        ),
        (
            1,
            {"phase": "failed", "error": "NonFiniteError: loss is nan"},
            "step 12 of 12, loss 2.5000 (failed)",
        ),
    ],
)
def test_the_bar_ends_saying_how_the_workload_ended(code, last, said):
    # Passed on only when the step moved, the end ("finished" at the last step shown,
    # "failed" with no step) never reached the bar: the UI said "(training)" for good.
    from tasks.watch import WatchSettings, WorkloadFailed, watch_slice
    from tests.helpers import FakeClock

    fake = FakeArtifacts()
    bar = TrainingProgress(12, "k", create=fake.create, update=fake.update, min_interval_s=0.0)
    training = {"phase": "training", "step": 12, "loss": 2.5, "time": 1.0}
    beats = Beats([training, {**last, "time": 2.0}])
    clock = FakeClock(0.0, limit=1e5)
    settings = WatchSettings(poll_s=1, heartbeat_timeout_s=600, confirm_s=60)
    args = (Ends(1, code), "s", beats, settings, lambda m: None, bar.update, clock, clock.sleep)
    if code:
        with pytest.raises(WorkloadFailed):
            watch_slice(*args, wall=lambda: 0.0)
    else:
        assert watch_slice(*args, wall=lambda: 0.0).final_step == 12
    assert fake.calls[0][2] == "step 12 of 12, loss 2.5000 (training)"
    assert fake.calls[-1][2] == said


def test_the_bar_ends_with_the_attempts_outcome_whatever_its_last_heartbeat_said():
    # A workload killed outright leaves a "training" heartbeat, and a stopped orchestrator
    # reads none: the bar said "(training)" for good. The attempt's outcome ends it.
    fake = FakeArtifacts()
    bar = TrainingProgress(12, "k", create=fake.create, update=fake.update, min_interval_s=60.0)
    bar.end("stopped")  # no bar yet (the attempt never trained): nothing made
    assert fake.calls == []
    bar.update({"step": 4, "loss": 5.0, "phase": "training"})
    bar.update({"step": 7, "loss": 4.5, "phase": "training"})  # held back: 60 s not passed
    bar.end("preempted")
    # At the last step heard, not the last shown: a stopped run's bar read "step 10 of
    # 120 (stopped)" where it had saved step 47 (probe R, session 39).
    assert fake.calls[-1] == ("update", 100 * 7 / 12, "step 7 of 12, loss 4.5000 (preempted)")
    bar.end("preempted")  # said already: not sent again
    bar.end("finished", 12)
    assert fake.calls[-1] == ("update", 100.0, "step 12 of 12 (finished)")
    assert len(fake.calls) == 3
