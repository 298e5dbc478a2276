"""`tpupipe report` on a recorded run directory, and the ledger's landing in the `runs` row
and the run summary. Expected figures are worked out by hand from the recorded events."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.cli import main as cli_main
from infra.metrics import DuckDBSink, RunRow
from tasks.landing import ledger_fields, run_ledger, summary_markdown
from tasks.plan import plan_run
from tasks.report import format_report, load_report
from tests.helpers import REPO, TABLE, attempt_events, eight_then_four, priced, tiny_config
from workloads.config import WorkloadConfig

RECORDED = Path(__file__).parent / "data" / "events-three-attempts.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Recorded run, 8 chips on-demand at $2/chip-hour: billed 46 + 37 + 51 = 134 s.
COST = 8 * 134 / 3600 * 2.0  # $0.59556
TOKENS = (20 + 10 + 30) * 16 * 32  # steps that count x tiny.yaml's batch x seq_len
PER_MILLION = COST / TOKENS * 1e6  # $19.3866


def fake_run(root: Path, *overrides: str, name: str = "three") -> Path:
    """A run directory as the pipeline leaves it: config.json, the recorded events, a few
    metrics rows and an eval.json."""
    config = tiny_config(root, f"run_name={name}", *overrides)
    plan = plan_run(config)
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True)
    workload = WorkloadConfig(
        pipeline=config,
        run_id=plan.run_id,
        run_dir=plan.run_dir,
        dataset_dir=str(root / "datasets" / "fp"),
        config_hash=plan.config_hash,
    )
    (run_dir / "config.json").write_text(workload.model_dump_json())
    shutil.copy(RECORDED, run_dir / "events.jsonl")
    rows = [{"step": s, "loss": 5.0 - s / 20, "time": 20.0 + s} for s in range(2, 61, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "eval.json").write_text(json.dumps({"step": 60, "loss": 2.25}))
    return run_dir


def test_report_prints_the_timeline_and_writes_a_png(tmp_path, capsys):
    run_dir = fake_run(tmp_path, "cost.usd_per_chip_hour=2.0")
    assert cli_main(["report", "three", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    attempts = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"])]
    # attempt, start, end, outcome, six buckets, chips, billed seconds, chip-hours, cost
    first = "1 +0.0 +46.0 preempted 10.0 10.0 0.0 20.0 5.0 1.0 8 46.0 0.1022 $0.2044"
    assert attempts[0] == first.split(" ")
    assert attempts[1][:4] == ["2", "+50.0", "+97.0", "preempted"]
    assert attempts[1][4] == "20.0" and attempts[1][-3:] == ["37.0", "0.0822", "$0.1644"]
    assert attempts[2][3] == "completed" and attempts[2][-3:] == ["51.0", "0.1133", "$0.2267"]
    # Why each attempt that did not complete ended: the ledger's reason, shown at last.
    assert "attempt 1 preempted: slice PREEMPTED" in lines
    assert "attempt 2 preempted: exit 75" in lines
    assert not [line for line in lines if line.startswith("attempt 3 ")]
    assert "attempts 3, preempted 2; wall 151.0s; goodput 46.4% (productive 70.0s)" in out
    assert "provisioning 35.0s" in out and "idle 7.0s" in out
    assert f"= {TOKENS:,} training tokens" in out
    assert f"cost: ${COST:.4f} for {8 * 134 / 3600:.4f} chip-hours (8 chips)" in out
    assert f"per 1M training tokens: ${PER_MILLION:.4f}" in out
    assert "eval loss 2.2500 at step 60" in out
    png = run_dir / "report.png"
    assert f"plot: {png}" in out
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    from PIL import Image

    with Image.open(png) as image:
        image.verify()  # a whole, decodable PNG
        assert image.format == "PNG" and image.size == (800, 650)


def test_report_can_reprice_a_run_and_write_elsewhere(tmp_path, capsys):
    fake_run(tmp_path, "cost.usd_per_chip_hour=2.0")
    out_png = tmp_path / "elsewhere.png"
    args = ["report", "three", "--config", str(REPO / "configs" / "tiny.yaml")]
    args += ["--set", f"storage.root={tmp_path}", "--set", "cost.usd_per_chip_hour=1.0"]
    assert cli_main([*args, "--out", str(out_png)]) == 0
    assert f"cost: ${COST / 2:.4f}" in capsys.readouterr().out
    assert out_png.read_bytes().startswith(PNG_MAGIC)
    # A config with no cost section of its own, given to find the root: the recorded prices
    # stand (it re-priced them all as "not priced: a local slice").
    for unset in ([], ["--set", "cost.usd_per_chip_hour=null"], ["--set", "cost={}"]):
        assert cli_main([*args[:-2], *unset, "--no-png"]) == 0
        out = capsys.readouterr().out
        assert f"cost: ${COST:.4f}" in out and "not priced" not in out, unset


def test_an_unpriced_run_reports_chip_hours_without_cost(tmp_path, capsys):
    fake_run(tmp_path)
    assert cli_main(["report", "three", "--root", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "not priced: a local slice" in out
    assert f"cost: not priced for {8 * 134 / 3600:.4f} chip-hours" in out
    assert not (tmp_path / "runs" / "three" / "report.png").exists()


def test_a_plot_the_disk_cannot_hold_leaves_the_old_one_and_no_stray_file(
    tmp_path, capsys, monkeypatch
):
    # On a full disk the report said it could not write the plot, and left a 0-byte
    # report.png in the run directory.
    import errno

    from etils import epath

    run_dir = fake_run(tmp_path)
    png = run_dir / "report.png"
    png.write_bytes(b"the last plot")
    real = epath.Path.write_bytes

    def full(self, data):
        real(self, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(epath.Path, "write_bytes", full)
    assert cli_main(["report", "three", "--root", str(tmp_path)]) == 1
    assert f"cannot write the plot to {png}: No space left on device" in capsys.readouterr().err
    assert png.read_bytes() == b"the last plot"
    assert sorted(p.name for p in run_dir.iterdir() if "report" in p.name) == ["report.png"]


def test_unknown_run_exits_non_zero_naming_the_runs_there(tmp_path, capsys):
    fake_run(tmp_path)
    assert cli_main(["report", "nope", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no run 'nope' under" in err and "runs there: three" in err
    assert cli_main(["report", "x", "--root", str(tmp_path / "empty")]) == 1
    assert "no runs there" in capsys.readouterr().err
    assert cli_main(["report", "three", "--set", "cost.region=us-east1"]) == 2  # no --config


def test_a_gs_root_without_credentials_is_refused_at_once_naming_them(
    tmp_path, capsys, monkeypatch
):
    # The README's `tpupipe report v5e-small --config configs/v5e-8-spot.yaml` with no
    # credentials retried its reads for 82 s and printed six tracebacks naming none.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-key.json"))
    args = ["report", "v5e-small", "--config", str(REPO / "configs/v5e-8-spot.yaml")]
    assert cli_main([*args, "--no-png"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpupipe report: gs://") and "Application Default Credentials" in err
    assert f"GOOGLE_APPLICATION_CREDENTIALS={tmp_path / 'no-key.json'}" in err
    assert len(err.splitlines()) == 1


def test_a_run_with_no_attempt_recorded_says_so_whatever_its_ledger_holds(tmp_path):
    run_dir = fake_run(tmp_path)
    by_hand = {"time": 1.0, "event": "started", "attempt": None, "source": "workload"}
    (run_dir / "events.jsonl").write_text(f"not json\n{json.dumps(by_hand)}\n")
    text = format_report(load_report(str(tmp_path), "three"))
    assert text.endswith("no attempts recorded yet (events.jsonl holds no event of an attempt)")


def test_an_unreadable_eval_json_is_left_out_of_the_report_with_a_warning(tmp_path, capsys, caplog):
    # It gave a JSONDecodeError traceback naming no file.
    run_dir = fake_run(tmp_path)
    (run_dir / "eval.json").write_text('{"torn')
    assert cli_main(["report", "three", "--root", str(tmp_path), "--no-png"]) == 0
    assert "run three:" in capsys.readouterr().out
    assert f"{run_dir / 'eval.json'}: not valid JSON" in caplog.text


def test_the_ledger_lands_in_the_runs_row_and_the_summary(tmp_path):
    run_dir = fake_run(tmp_path, "cost.usd_per_chip_hour=2.0")
    config = tiny_config(tmp_path, "run_name=three", "cost.usd_per_chip_hour=2.0")
    plan = plan_run(config)
    row = RunRow(
        run_id="three",
        run_name="three",
        status="completed",
        config_hash=plan.config_hash,
        config_json="{}",
        dataset_fingerprint="fp",
        started_at="2026-11-22T00:00:00Z",
        run_dir=str(run_dir),
        **ledger_fields(run_ledger(config, str(run_dir))),
    )
    assert (row.chips, row.usd_per_chip_hour, row.tokens_trained) == (8, 2.0, TOKENS)
    assert row.chip_hours == pytest.approx(8 * 134 / 3600)
    assert row.cost_usd == pytest.approx(COST)
    assert row.cost_per_million_tokens == pytest.approx(PER_MILLION)
    assert row.price_source == "cost.usd_per_chip_hour (config)" and row.goodput == pytest.approx(
        70 / 151
    )
    sink = DuckDBSink(tmp_path / "m.duckdb")
    sink.land(row, [], [])
    assert sink.read_run("three") == row
    summary = summary_markdown(config, plan, row)
    assert f"| cost | ${COST:.4f} for 0.2978 chip-hours (8 chips) at $2.0000/chip-hour" in summary
    assert f"| cost per 1M training tokens | ${PER_MILLION:.4f} ({TOKENS:,} tokens" in summary


def test_a_price_table_broken_after_validation_still_lands_the_row(tmp_path):
    table = tmp_path / "prices.yaml"
    config = tiny_config(
        tmp_path,
        "run_name=three",
        "cost.priced_as=v5litepod-8",
        "cost.region=us-central1",
        f"cost.price_table={table}",  # missing by the time the run lands
    )
    run_dir = fake_run(tmp_path)
    ledger = run_ledger(config, str(run_dir))
    assert ledger.cost_usd is None and ledger.chip_hours == pytest.approx(8 * 134 / 3600)
    assert ledger.price.source.startswith("not priced: cost.price_table = ")


def _write_events(run_dir: Path, events: list[dict]) -> None:
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_report_of_a_run_name_run_twice_counts_every_attempt(tmp_path, capsys):
    # An old ledger: invocation A preempted twice (budget spent), B 1000 s later preempted
    # once, then finished; both numbered 1, 2.
    run_dir = fake_run(tmp_path, "cost.usd_per_chip_hour=2.0")
    _write_events(
        run_dir,
        [
            *attempt_events(1, 0, 0, 15, "preempted"),
            *attempt_events(2, 25, 15, 30, "preempted"),
            *attempt_events(1, 1000, 30, 45, "preempted"),
            *attempt_events(2, 1025, 45, 60, "completed"),
        ],
    )
    assert cli_main(["report", "three", "--root", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["3"], ["4"])]
    assert [r[:4] for r in rows] == [
        ["3", "+1000.0", "+1021.0", "preempted"],
        ["4", "+1025.0", "+1046.0", "completed"],
    ]
    # Each invocation: 0 .. 46 s (20 + 1 + 4 + 21); the 954 s between them are not wall.
    assert "attempts 4, preempted 3; wall 92.0s over 2 invocations" in out
    assert f"= {60 * 16 * 32:,} training tokens" in out
    assert f"cost: ${8 * 4 * 21 / 3600 * 2.0:.4f}" in out


def test_a_final_attempt_that_only_restored_lands_all_the_steps(tmp_path):
    # SIGTERM at the last step: attempt 1 saved step 60; attempt 2 restored it and finished
    # without a step of its own.
    run_dir = fake_run(tmp_path)
    _write_events(
        run_dir,
        [
            *attempt_events(1, 0, 0, 60, "preempted"),
            {"time": 70, "attempt": 2, "event": "provision_requested"},
            {"time": 72, "attempt": 2, "event": "provision_ready"},
            {"time": 74, "attempt": 2, "event": "restored", "step": 60, "seconds": 1.0},
            {"time": 75, "attempt": 2, "event": "finished", "step": 60},
            {"time": 76, "attempt": 2, "event": "attempt_ended", "outcome": "completed"},
        ],
    )
    fields = ledger_fields(run_ledger(tiny_config(tmp_path, "run_name=three"), str(run_dir)))
    assert fields["tokens_trained"] == TOKENS  # all 60 steps, as the runs row lands them
    assert fields["goodput"] == pytest.approx((64 - 5) / 76)


def test_a_rerun_on_another_slice_does_not_reprice_earlier_attempts(tmp_path):
    """Attempt 1 ran on 8 devices priced as v5litepod-8 ($2 in the table); the run name is
    run again on 4 devices priced as v5litepod-4 at a flat $3, which rewrites config.json.
    Attempt 1 keeps its chips, chip-hours and cost in the report and the runs row, whether
    the rerun made an attempt of its own or not (its training had finished)."""
    table = price_table(tmp_path)
    eight, four = eight_then_four(tmp_path, table)
    eight, four = (c.model_copy(update={"run_name": "three"}) for c in (eight, four))
    run_dir = fake_run(tmp_path)
    first = priced(attempt_events(1, 0, 0, 10, "preempted"), eight)
    second = priced(attempt_events(2, 100, 10, 20, "completed"), four)
    write_config(run_dir, four)  # as the rerun's plan does
    sink = DuckDBSink(tmp_path / "m.duckdb")
    one, two = 8 * 16 / 3600, 4 * 16 / 3600  # chip-hours: each attempt billed 16 s

    _write_events(run_dir, first)  # the finished run's rerun made no attempt
    out = format_report(load_report(str(tmp_path), "three"))
    (row,) = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert row[-4:] == ["8", "16.0", f"{one:.4f}", f"${one * 2.0:.4f}"]
    assert "attempt 1 ran on 8 chips, v5litepod-8 (on-demand) in us-central1: $2.0000" in out
    assert f"cost: ${one * 2.0:.4f} for {one:.4f} chip-hours (8 chips)" in out
    land(sink, run_dir, four)
    runs = "SELECT chips, chip_hours, usd_per_chip_hour, cost_usd FROM runs WHERE run_id = 'three'"
    assert sink.query(runs) == [(8, pytest.approx(one), 2.0, pytest.approx(one * 2.0))]

    _write_events(run_dir, [*first, *second])  # a rerun that trained on the 4 devices
    out = format_report(load_report(str(tmp_path), "three"))
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [r[-4:] for r in rows] == [
        ["8", "16.0", f"{one:.4f}", f"${one * 2.0:.4f}"],
        ["4", "16.0", f"{two:.4f}", f"${two * 3.0:.4f}"],
    ]
    total = one * 2.0 + two * 3.0
    assert f"cost: ${total:.4f} for {one + two:.4f} chip-hours (chips per attempt: 8, 4)" in out
    # Landed again for the same run: still one row, now with both attempts.
    land(sink, run_dir, four)
    assert sink.query(runs) == [(4, pytest.approx(one + two), 3.0, pytest.approx(total))]


def price_table(root: Path) -> Path:
    path = root / "prices.yaml"
    path.write_text(TABLE)
    return path


def write_config(run_dir: Path, config) -> None:
    """Rewrite the run's config.json with `config`, as a rerun does."""
    old = WorkloadConfig.model_validate_json((run_dir / "config.json").read_text())
    new = old.model_copy(update={"pipeline": config})
    (run_dir / "config.json").write_text(new.model_dump_json())


def land(sink: DuckDBSink, run_dir: Path, config) -> None:
    """Land the run's row as the landing stage would (its ledger under `config`)."""
    row = RunRow(
        run_id="three",
        run_name="three",
        status="completed",
        config_hash="h",
        config_json="{}",
        dataset_fingerprint="fp",
        started_at="2026-11-22T00:00:00Z",
        run_dir=str(run_dir),
        **ledger_fields(run_ledger(config, str(run_dir))),
    )
    sink.land(row, [], [])


def test_the_runs_row_starts_at_the_first_event_of_an_invocation_that_landed_nothing(tmp_path):
    """An orchestrator killed outright lands no row, so its rerun's row said the run
    started when the rerun did, though its report showed the first attempt before."""
    from datetime import UTC, datetime, timedelta

    from tasks.landing import build_rows

    run_dir = fake_run(tmp_path)
    rerun = datetime(2026, 11, 26, 8, 0, tzinfo=UTC)
    first = rerun - timedelta(minutes=30)
    _write_events(
        run_dir,
        [
            {"time": first.timestamp(), "attempt": 1, "event": "provision_requested"},
            {"time": first.timestamp() + 60, "attempt": 1, "event": "provision_ready"},
        ],
    )
    config = tiny_config(tmp_path, "run_name=three")
    run, _, _ = build_rows(config, plan_run(config), rerun, None, None)
    assert run.started_at == first
    # Events after this invocation's start do not move it later.
    _write_events(run_dir, [{"time": rerun.timestamp() + 5, "attempt": 2, "event": "x"}])
    run, _, _ = build_rows(config, plan_run(config), rerun, None, None)
    assert run.started_at == rerun


def test_a_step_trained_again_is_reported_by_its_last_row(tmp_path):
    # The report's loss line and plots read every row of metrics.jsonl: a step trained
    # again after a resume showed the discarded attempt's loss, and was plotted twice.
    run_dir = fake_run(tmp_path)
    again = [{"step": s, "loss": 9.0, "time": 100.0 + s} for s in (2, 4)]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in again)
    report = load_report(str(tmp_path), "three")
    steps = [m["step"] for m in report.metrics]
    assert steps == sorted(set(steps)) == list(range(2, 61, 2))
    assert [m["loss"] for m in report.metrics[:3]] == [9.0, 9.0, 5.0 - 6 / 20]


def test_a_priced_run_that_kept_no_step_says_so_not_not_priced(tmp_path, capsys):
    # Killed before its first checkpoint: its cost is known, and the cost per token has
    # no tokens to divide by, which the report called "not priced".
    run_dir = fake_run(tmp_path, "cost.usd_per_chip_hour=2.0", name="none")
    events = [
        {"time": 0.0, "event": "provision_requested", "attempt": 1, "source": "orchestrator"},
        {"time": 2.0, "event": "provision_ready", "attempt": 1, "source": "orchestrator"},
        {"time": 30.0, "event": "deleted", "attempt": 1, "source": "orchestrator"},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert cli_main(["report", "none", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"cost: ${8 * 30 / 3600 * 2.0:.4f}" in out
    assert "per 1M training tokens: none (no step kept)" in out
