"""The run directory's append-only files after a writer was killed mid-line."""

from __future__ import annotations

import errno
import json
import logging
import os
import re

import pytest

from tasks.goodput import read_events
from tasks.ledger import compute_ledger
from tasks.pricing import Price
from workloads.events import EventLog, LeaseLost
from workloads.rundir import RunDir, UnreadableFile, read_json, write_json_atomic


def test_a_torn_metrics_line_does_not_swallow_the_next_attempts_first_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # killed here
    RunDir(tmp_path).append_metrics([{"step": 2, "resumed_from": 0}, {"step": 3}])
    assert RunDir(tmp_path).read_metrics() == [
        {"step": 1},
        {"step": 2, "resumed_from": 0},
        {"step": 3},
    ]


def test_a_torn_event_line_does_not_swallow_the_next_event(tmp_path):
    # Every event EventLog writes has a time; one without is skipped (see below).
    (tmp_path / "events.jsonl").write_text('{"event": "started", "time": 1}\n{"event": "checkp')
    EventLog(str(tmp_path), attempt=2).emit("started")
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e.get("attempt")) for e in events] == [("started", None), ("started", 2)]


@pytest.mark.parametrize(
    "line",
    [
        '{"event": 5}',
        '{"loss": 1.0}',
        '{"event": "started"}',
        "[1, 2]",
        '"text"',
        "7",
        '{"event": "started", "time": "soon"}',
        '{"event": "started", "time": 3, "attempt": "2"}',
    ],
)
def test_an_event_line_that_is_not_an_event_is_skipped_like_a_torn_one(tmp_path, line):
    # A line without "time" (hand-edited, another tool's) failed every landing of the run
    # with a bare KeyError: 'time', its runs row not landed.
    log = EventLog(str(tmp_path), attempt=1, clock=lambda: 10.0)
    log.emit("provision_requested")
    (tmp_path / "events.jsonl").open("a").write(line + "\n")
    log.emit("attempt_ended", outcome="completed")
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["provision_requested", "attempt_ended"]
    compute_ledger(events, Price(0, "on-demand", None, None, None, "n/a"), 0)


@pytest.mark.parametrize("line", ['{"loss": 1.0}', '{"step": "3"}', '{"step": true}', "[3]", "3"])
def test_a_metrics_line_without_a_step_is_skipped_like_a_torn_one(tmp_path, line):
    # Landing keys rows by their step: such a line failed it with a bare KeyError: 'step'.
    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 2.0}}\n{line}\n')
    RunDir(tmp_path).append_metrics([{"step": 2}])
    assert RunDir(tmp_path).read_metrics() == [{"step": 1, "loss": 2.0}, {"step": 2}]


def test_a_metrics_line_that_is_not_utf8_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": 2}\n')
    assert RunDir(tmp_path).read_metrics() == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("content", [b"garbage{", b"", b"\xff\xfe", b"[1]"])
def test_an_unreadable_heartbeat_reads_as_none_with_one_warning_naming_it(
    tmp_path, caplog, content
):
    # The heartbeat is rewritten as the workload starts: raising here failed every resume
    # after a slice was provisioned, with a JSONDecodeError naming no file.
    (tmp_path / "status.json").write_bytes(content)
    run_dir = RunDir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="workloads.rundir"):
        assert run_dir.read_status() is None
        assert run_dir.read_status() is None  # polled again: no second warning
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "status.json") in warning
    run_dir.write_status("training", step=3)
    assert run_dir.read_status()["step"] == 3


@pytest.mark.parametrize("content", [b"garbage{", b"", b"\xff\xfe", b"[1]"])
def test_an_unreadable_json_file_raises_naming_it_unless_read_as_missing(tmp_path, caplog, content):
    path = tmp_path / "peak.json"
    path.write_bytes(content)
    with pytest.raises(UnreadableFile, match=re.escape(str(path))):
        read_json(path)
    with caplog.at_level(logging.WARNING, logger="workloads.rundir"):
        assert read_json(path, unreadable_as_missing=True) is None
    assert str(path) in caplog.text
    assert read_json(tmp_path / "absent.json") is None


def test_an_unreadable_lease_stops_the_workload_naming_the_file(tmp_path):
    # The lease fences off zombie attempts: its content matters, so it is never read as
    # absent (no lease: no fencing).
    (tmp_path / "lease.json").write_text("garbage{")
    with pytest.raises(UnreadableFile, match=re.escape(str(tmp_path / "lease.json"))):
        EventLog(str(tmp_path), attempt=2, lease="abc").check_lease()
    (tmp_path / "lease.json").write_text(json.dumps({"attempt": 3, "lease": "new"}))
    with pytest.raises(LeaseLost):
        EventLog(str(tmp_path), attempt=2, lease="abc").check_lease()


@pytest.mark.parametrize("flops", [None, "fast", -1.0, float("nan")])
def test_a_remembered_peak_that_is_not_a_number_is_measured_again(monkeypatch, flops):
    # peak.json is a cache: a bad figure in it must not fail the attempt (a KeyError or
    # ValueError after the slice was provisioned), it is measured again.
    from workloads import perf

    monkeypatch.setattr(perf, "measure_matmul_peak", lambda dtype: perf.Peak(5.0, "measured"))
    remembered = {"source": "measured:float32 matmul", "flops_per_s": flops}
    assert perf.slice_peak("float32", remembered).flops_per_s == 5.0


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A full disk (here the rename failing) must leave the old status readable and no
    `.status.json.<pid>.tmp` beside it."""
    from etils import epath

    path = epath.Path(tmp_path) / "status.json"
    write_json_atomic(path, {"state": "training"})

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(path, {"state": "finished"})
    monkeypatch.undo()
    assert read_json(path) == {"state": "training"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_an_atomic_write_to_a_fifo_or_through_a_symlink_keeps_what_is_there(tmp_path):
    """`tpupipe report --out /dev/null` replaced the device with a regular file holding the
    plot (run as root: for every process on the machine). A FIFO stands in for the device
    here; a symlink stays a symlink and its file gets the bytes (probe Z, session 39)."""
    import stat
    import threading

    from etils import epath

    from workloads.rundir import write_bytes_atomic

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_bytes_atomic(epath.Path(fifo), b"png")
    reader.join(10)
    assert got == [b"png"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)

    (tmp_path / "real.png").write_bytes(b"old")
    (tmp_path / "link.png").symlink_to(tmp_path / "real.png")
    write_bytes_atomic(epath.Path(tmp_path / "link.png"), b"new")
    assert (tmp_path / "link.png").is_symlink() and (tmp_path / "real.png").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.png", "real.png"]


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch):
    # A write or flush that finds the disk full raises "[Errno 28] No space left on
    # device" and nothing more: the run failed naming no file (metrics.jsonl, eval.json).
    from workloads.rundir import append_lines

    with pytest.raises(OSError, match=r"No space left on device: '/dev/full'") as raised:
        append_lines("/dev/full", '{"step": 1}\n')  # a device that is always full
    assert raised.value.errno == errno.ENOSPC

    from etils import epath

    path = epath.Path(tmp_path) / "eval.json"

    def full(self, data, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(path), "write_bytes", full)  # what the atomic writes use
    with pytest.raises(OSError, match=f"No space left on device: '{path}'"):
        write_json_atomic(path, {"loss": 2.0})
    assert list(tmp_path.iterdir()) == []  # no temporary left beside it
