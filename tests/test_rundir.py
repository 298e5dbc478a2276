"""The run directory's append-only files after a writer was killed mid-line."""

from __future__ import annotations

from tasks.goodput import read_events
from workloads.events import EventLog
from workloads.rundir import RunDir


def test_a_torn_metrics_line_does_not_swallow_the_next_attempts_first_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # killed here
    RunDir(tmp_path).append_metrics([{"step": 2, "resumed_from": 0}, {"step": 3}])
    assert RunDir(tmp_path).read_metrics() == [
        {"step": 1},
        {"step": 2, "resumed_from": 0},
        {"step": 3},
    ]


def test_a_torn_event_line_does_not_swallow_the_next_event(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "started"}\n{"event": "checkp')
    EventLog(str(tmp_path), attempt=2).emit("started")
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e.get("attempt")) for e in events] == [("started", None), ("started", 2)]
