"""A run's files damaged by hand or by another tool: `tpupipe report` and the landing read
what the pipeline wrote and leave the rest out, instead of failing with a TypeError that
names no file (and, for landing, never landing the run's `runs` row)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.cli import main as cli_main
from tasks.landing import run_ledger
from tasks.landing_rows import build_rows
from tasks.plan import plan_run
from tests.helpers import priced, tiny_config
from tests.test_report import COST, fake_run
from workloads.checkpoint import VerifiedCheckpoint
from workloads.rundir import RunDir

FLAT = "cost.usd_per_chip_hour=2.0"


def _rewrite_events(run_dir: Path, change) -> None:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.dumps(change(json.loads(line))))
        except json.JSONDecodeError:  # the recording's torn line stays as it is
            out.append(line)
    (run_dir / "events.jsonl").write_text("".join(line + "\n" for line in out))


def _report(root: Path, capsys) -> tuple[int, str, str]:
    code = cli_main(["report", "three", "--root", str(root), "--no-png"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "damage",
    [
        lambda price: None,
        lambda price: "$3",
        lambda price: {**price, "chips": "8"},
        lambda price: {**price, "usd_per_chip_hour": float("nan")},
        lambda price: {k: v for k, v in price.items() if k != "source"},
        # Well typed, but no run records them: the cost was inf (RunRow refused it) and
        # 2**63 chips overflowed the sinks' INT64 column, so no runs row landed.
        lambda price: {**price, "chips": 1_000_000, "usd_per_chip_hour": 1e305},
        lambda price: {**price, "chips": 2**63},
    ],
)
def test_a_damaged_price_record_prices_its_attempt_by_the_config(tmp_path, capsys, damage):
    # Each of these failed the landing of the finished run's row and the report with a
    # TypeError from Price(**record), naming no file.
    run_dir = fake_run(tmp_path, FLAT)
    three = tiny_config(tmp_path, "run_name=three", "cost.usd_per_chip_hour=3.0")
    first = [True]

    def change(event):
        if event["event"] != "provision_requested":
            return event
        event = priced([event], three)[0]
        if first[0]:  # attempt 1's record is damaged; 2 and 3 recorded $3
            event["price"], first[0] = damage(event["price"]), False
        return event

    _rewrite_events(run_dir, change)
    ledger = run_ledger(tiny_config(tmp_path, "run_name=three", FLAT), str(run_dir))
    by_attempt = [a.price.usd_per_chip_hour for a in ledger.attempts]
    assert by_attempt == [2.0, 3.0, 3.0]  # attempt 1 as one that recorded no price
    code, out, _ = _report(tmp_path, capsys)
    assert code == 0 and "cost: $" in out
    config = tiny_config(tmp_path, "run_name=three", FLAT, "train.steps=60")
    verified = VerifiedCheckpoint(60, "h", "0" * 64, 1, 1)
    run, _, _ = build_rows(config, plan_run(config), datetime.now(UTC), verified, None)
    assert 0 < run.cost_usd < 1e6 and run.chips < 2**31


def test_a_price_record_with_a_newer_versions_field_is_read(tmp_path):
    run_dir = fake_run(tmp_path, FLAT)
    three = tiny_config(tmp_path, "run_name=three", "cost.usd_per_chip_hour=3.0")

    def change(event):
        if event["event"] != "provision_requested":
            return event
        event = priced([event], three)[0]
        event["price"]["discount"] = 0.1
        return event

    _rewrite_events(run_dir, change)
    ledger = run_ledger(tiny_config(tmp_path, "run_name=three", FLAT), str(run_dir))
    assert ledger.cost_usd == pytest.approx(COST * 1.5)


def test_fields_of_another_type_and_times_no_clock_gives_are_left_out(tmp_path, capsys):
    run_dir = fake_run(tmp_path, FLAT)
    code, clean, _ = _report(tmp_path, capsys)
    assert code == 0

    def change(event):
        if event["event"] == "first_step" and event["resumed_from"] == 0:
            return {**event, "resumed_from": "0"}  # read as not recorded: the same point
        return event

    _rewrite_events(run_dir, change)
    with (run_dir / "events.jsonl").open("a") as f:  # an idle time of 1e300 s
        f.write(json.dumps({"time": 1e300, "event": "note", "attempt": 3}) + "\n")
        f.write(json.dumps({"time": -5.0, "event": "note", "attempt": 3}) + "\n")
        for attempt in (10**30, -1):  # an attempt of its own, with a wall time to match
            f.write(json.dumps({"time": 200.0, "event": "note", "attempt": attempt}) + "\n")
    code, out, err = _report(tmp_path, capsys)
    assert (code, out) == (0, clean), err

    # An outcome of another type: a TypeError in the report's table; read as none recorded.
    _rewrite_events(run_dir, lambda e: {**e, "outcome": 7} if "outcome" in e else e)
    code, out, err = _report(tmp_path, capsys)
    assert code == 0 and "running?" in out, err

    # A TypeError in the restore bucket: read as an attempt that did not time its restore.
    _rewrite_events(run_dir, lambda e: {**e, "seconds": "3"} if "seconds" in e else e)
    code, out, err = _report(tmp_path, capsys)
    assert code == 0 and "steps that count: 60" in out, err


@pytest.mark.parametrize(
    "line",
    [
        '{"step": 12, "loss": "oops"}',
        '{"step": 12, "loss": 1.0, "grad_norm": [1]}',
        '{"step": 9223372036854775808, "loss": 1.0}',
        '{"step": -1, "loss": 1.0}',
        '{"step": 12, "loss": 1.0, "time": 1e300}',
        '{"step": 12, "loss": 1.0, "time": "noon"}',
        '{"step": 12, "loss": 1' + "0" * 400 + "}",
        '{"step": 12, "loss": 1.0, "grad_norm": -1' + "0" * 400 + "}",
    ],
)
def test_a_metrics_row_the_workload_never_writes_is_skipped(tmp_path, capsys, line):
    # A loss "oops" failed the landing with a pydantic error (no runs row at all) and the
    # report with a format error; a step past 64 bits failed DuckDB's insert.
    run_dir = fake_run(tmp_path, FLAT)
    before = RunDir(run_dir).read_metrics()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    assert RunDir(run_dir).read_metrics() == before
    code, out, err = _report(tmp_path, capsys)
    assert code == 0 and "train loss 4.9000 -> 2.0000 (step 60)" in out, err


def test_a_completed_landing_has_no_step_row_past_its_final_step(tmp_path):
    run_dir = fake_run(tmp_path, FLAT)
    config = tiny_config(tmp_path, "run_name=three", FLAT, "train.steps=60")
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 75, "loss": 0.5}) + "\n")  # another run's line
    verified = VerifiedCheckpoint(60, "h", "0" * 64, 1, 1)
    run, steps, _ = build_rows(config, plan_run(config), datetime.now(UTC), verified, None)
    assert max(s.step for s in steps) == 60 and run.final_step == 60
    # A failed run's final step is its highest logged step, never past train.steps.
    run, steps, _ = build_rows(config, plan_run(config), datetime.now(UTC), None, None, "x")
    assert max(s.step for s in steps) == 60 and run.final_step == 60


def test_an_eval_json_of_other_values_is_left_out_with_a_warning(tmp_path, capsys, caplog):
    run_dir = fake_run(tmp_path, FLAT)
    (run_dir / "eval.json").write_text(json.dumps({"step": 60, "loss": "x"}))
    code, out, err = _report(tmp_path, capsys)
    assert code == 0 and "eval loss" not in out, err
    said = "eval.json holds loss 'x' at step 60, not an evaluation: left out"
    assert said in caplog.text
    # And on the console of `tpupipe report`, a process without Prefect, whose root logger
    # has no handler: the warning had been lost (/tmp/s34/probeA/repro_report_warning.sh).
    argv = [sys.executable, "-m", "flows.cli", "report", "three", "--root", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([*argv, "--no-png"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and said in out.stderr, out.stderr


def test_a_run_file_that_cannot_be_read_exits_1_naming_it(tmp_path, capsys):
    run_dir = fake_run(tmp_path, FLAT)
    (run_dir / "events.jsonl").unlink()
    (run_dir / "events.jsonl").mkdir()
    code, _, err = _report(tmp_path, capsys)
    assert code == 1 and "Traceback" not in err
    assert f"cannot read run three's files: [Errno 21] Is a directory: '{run_dir}" in err


def test_a_report_without_a_readable_config_does_not_count_zero_tokens(tmp_path, capsys):
    run_dir = fake_run(tmp_path, FLAT)
    (run_dir / "config.json").write_text('{"x":')
    code, out, _ = _report(tmp_path, capsys)
    assert code == 0 and "0 training tokens" not in out
    assert "steps that count: 60 (tokens unknown: no readable config.json)" in out


def test_a_reader_that_goes_away_ends_the_output_not_the_report(tmp_path):
    # `tpupipe report RUN | head -1` with an unbuffered stdout (PYTHONUNBUFFERED=1, as in
    # many containers and CI runners) ended in a BrokenPipeError traceback, exit 1.
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    run_dir = fake_run(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "report", "three", "--root", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    child.stdout.close()  # the reader is gone before the first line
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert (run_dir / "report.png").stat().st_size > 0  # the rest of its work is done
