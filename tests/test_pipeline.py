"""The whole flow on the embedded backends: real sharding, a real slice process, real
training, verification, evaluation and landing in DuckDB."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from infra.metrics import DuckDBSink
from tasks.goodput import read_events
from tests.helpers import REPO, cut_checkpoint_data, processes_mentioning, tiny_config
from workloads import checkpoint, data

pytestmark = pytest.mark.integration


def _slices_left(root: Path) -> list[str]:
    registry = root / "slices"
    return sorted(p.name for p in registry.glob("*.json")) if registry.exists() else []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, prefect_harness):
    """Run the tiny pipeline once; several tests inspect what it left behind."""
    from flows.pipeline import tpu_training_pipeline

    root = tmp_path_factory.mktemp("store")
    config = tiny_config(root)
    run = tpu_training_pipeline(config=config)
    return config, root, run


def test_pipeline_shards_trains_verifies_evaluates_and_lands(tiny_run):
    config, root, run = tiny_run
    run_dir = Path(run.run_dir)

    # Shards and a manifest exist, and the manifest's checksums match the files.
    wcfg = json.loads((run_dir / "config.json").read_text())
    dataset_dir = Path(wcfg["dataset_dir"])
    manifest = data.load_manifest(dataset_dir)
    assert len(manifest["splits"]["train"]["shards"]) == config.dataset.num_shards
    data.verify_shards(dataset_dir)

    # The final checkpoint verifies independently of the flow, with the same checksum.
    verified = checkpoint.verify_checkpoint(str(run_dir), config.train.steps, run.config_hash)
    assert verified.step == config.train.steps
    assert run.params_sha256 == verified.params_sha256
    assert run.status == "completed"
    assert run.train_loss_last < run.train_loss_first

    # DuckDB holds the run's step and eval rows.
    sink = DuckDBSink(str(root / "metrics.duckdb"))
    steps = [
        s
        for (s,) in sink.query(
            "SELECT step FROM step_metrics WHERE run_id = ? ORDER BY step", [run.run_id]
        )
    ]
    assert steps[-1] == config.train.steps
    assert len(steps) == len(set(steps)) >= config.train.steps // config.train.log_every
    ((eval_loss, bpb),) = sink.query(
        "SELECT loss, bits_per_byte FROM eval_metrics WHERE run_id = ?", [run.run_id]
    )
    assert eval_loss == pytest.approx(run.eval_loss) and bpb > 0
    assert json.loads((run_dir / "eval.json").read_text())["step"] == config.train.steps

    # No slice or workload process is left.
    assert _slices_left(root) == []
    assert processes_mentioning(str(run_dir / "config.json")) == []
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "finished"
    with pytest.raises(ProcessLookupError):
        os.kill(status["pid"], 0)


def test_summary_artifact_describes_the_run(tiny_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    _, _, run = tiny_run

    async def latest():
        # Other tests' runs may share the key (the same run name): take this flow run's.
        artifact_filter = ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"run-{run.run_id}"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.flow_run_id]),
        )
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=artifact_filter)

    import asyncio

    (artifact,) = asyncio.run(latest())
    text = artifact.data
    assert f"`{run.run_dir}`" in text and "eval bits per byte" in text
    assert f"{run.train_loss_first:.4f} → {run.train_loss_last:.4f}" in text
    assert "| cost | not priced: a local slice" in text
    assert f"| cost per 1M training tokens | n/a ({run.tokens_trained:,} tokens" in text


def test_the_runs_ledger_and_its_report(tiny_run, capsys):
    from flows.cli import main as cli_main

    config, root, run = tiny_run
    per_step = config.train.batch_size * config.dataset.seq_len
    assert run.tokens_trained == config.train.steps * per_step  # one attempt: all steps count
    assert run.chips == config.slice.devices and 0 < run.chip_hours < 1
    assert run.cost_usd is None and run.price_source.startswith("not priced")
    # The attempt recorded its slice and price as it asked for the slice: a rerun on
    # another slice does not re-price it.
    events = read_events(Path(run.run_dir) / "events.jsonl")
    (request,) = [e for e in events if e["event"] == "provision_requested"]
    assert request["slice"]["devices"] == request["price"]["chips"] == config.slice.devices
    assert request["price"]["usd_per_chip_hour"] is None
    assert cli_main(["report", run.run_id, "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "attempts 1, preempted 0" in out and "completed" in out
    assert (Path(run.run_dir) / "report.png").read_bytes().startswith(b"\x89PNG")


def test_evaluation_runs_alone_on_one_device(tiny_run):
    """An orchestrator with one CPU device evaluates a checkpoint written by eight."""
    _, _, run = tiny_run
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "workloads.evaluate", "--config", f"{run.run_dir}/config.json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert f"loss={run.eval_loss}" in out.stdout


def test_rerun_with_same_name_resumes_and_lands_once(tiny_run):
    from flows.pipeline import tpu_training_pipeline

    config, root, first = tiny_run
    ledger = Path(first.run_dir) / "events.jsonl"
    before = read_events(ledger)
    again = tpu_training_pipeline(config=config)
    assert again.params_sha256 == first.params_sha256  # nothing retrained
    # Training had finished: no slice was provisioned for the rerun, no attempt made.
    assert read_events(ledger) == before
    assert again.attempts == first.attempts and again.chip_hours == first.chip_hours
    sink = DuckDBSink(str(root / "metrics.duckdb"))
    assert sink.query("SELECT count(*) FROM runs WHERE run_id = ?", [first.run_id]) == [(1,)]
    ((n, distinct),) = sink.query(
        "SELECT count(*), count(DISTINCT step) FROM step_metrics WHERE run_id = ?",
        [first.run_id],
    )
    assert n == distinct


def test_a_rerun_of_a_finished_run_deletes_the_slice_a_killed_orchestrator_left(tiny_run, tmp_path):
    # An orchestrator killed outright (SIGKILL, OOM) leaves its slice; its workload may
    # train on to the end alone. The rerun found training finished and skipped the
    # training stage, teardown included: on GCP the TPU VM stayed up until the reaper.
    from flows.pipeline import tpu_training_pipeline
    from infra.slices import SliceSpec, build_provider
    from tasks.plan import plan_run

    config, root, _ = tiny_run
    name = plan_run(config).slice_name
    provider = build_provider("local", str(root))
    marker = f"left-by-a-killed-orchestrator-{uuid.uuid4().hex}"
    spec = SliceSpec(
        name=name,
        devices=8,
        command=[sys.executable, "-c", "import time; time.sleep(600)", marker],
        log_path=str(tmp_path / "orphan.log"),
    )
    provider.create(spec)
    assert processes_mentioning(marker)

    tpu_training_pipeline(config=config)

    assert name not in [s.name for s in provider.list()]
    assert not processes_mentioning(marker)


def test_a_rerun_whose_final_checkpoint_is_corrupt_trains_its_last_steps_again(
    tmp_path, prefect_harness
):
    from flows.pipeline import tpu_training_pipeline

    config = tiny_config(tmp_path, "run_name=corrupt")
    first = tpu_training_pipeline(config=config)
    final = Path(first.run_dir) / "checkpoints" / str(config.train.steps) / "state"
    cut_checkpoint_data(final)

    again = tpu_training_pipeline(config=config)
    assert again.status == "completed" and again.final_step == config.train.steps
    assert again.params_sha256 == first.params_sha256  # resumed exactly from step 10
    events = read_events(Path(first.run_dir) / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "restored"] == [10]
    (moved,) = (Path(first.run_dir) / "quarantine").iterdir()
    assert moved.name.startswith(f"{config.train.steps}-")


def test_a_final_checkpoint_trained_on_other_data_is_quarantined_not_landed(
    tmp_path, prefect_harness
):
    # A final checkpoint of a run over other records, copied in (its data iterator says
    # so; its arrays are whole and of this config): the rerun found training finished,
    # verified only the arrays and config, and landed the other run's parameters.
    from flows.pipeline import tpu_training_pipeline

    config = tiny_config(tmp_path, "run_name=foreign-final")
    first = tpu_training_pipeline(config=config)
    final = Path(first.run_dir) / "checkpoints" / str(config.train.steps)
    data_iter = final / "data_iter" / "metadata"
    saved = json.loads(data_iter.read_text())
    assert saved["records"] and saved["next_index"] == config.train.steps
    data_iter.write_text(json.dumps({**saved, "records": "0123456789abcdef"}))

    again = tpu_training_pipeline(config=config)
    assert again.status == "completed" and again.params_sha256 == first.params_sha256
    (moved,) = (Path(first.run_dir) / "quarantine").iterdir()
    assert "saved over a dataset of other records" in (moved / "QUARANTINED.txt").read_text()
    lines = (Path(first.run_dir) / "events.jsonl").read_text().splitlines()
    (recorded,) = [json.loads(x) for x in lines if '"quarantined"' in x]
    assert recorded["step"] == config.train.steps and recorded["source"] == "orchestrator"
    assert "other records" in recorded["reason"] and recorded["attempt"] is None
    # The rerun trained the last steps again from the checkpoint before, on this data.
    events = read_events(Path(first.run_dir) / "events.jsonl")
    restored = [e["step"] for e in events if e["event"] == "restored"]
    assert restored == [config.train.steps - config.train.steps % config.train.checkpoint_every]


def test_a_rerun_after_a_failure_goes_on_numbering_attempts(tmp_path, prefect_harness):
    """The first invocation is preempted with no budget left and fails; running the run
    name again resumes it. The rerun's attempt is number 2 on both sides of the ledger,
    and the runs row and the report count both attempts and every step once."""
    from flows.pipeline import tpu_training_pipeline
    from tasks.report import format_report, load_report
    from tasks.watch import WorkloadPreempted

    config = tiny_config(
        tmp_path,
        "run_name=twice",
        "train.steps=40",
        "slice.chaos.at_step=2",  # SIGTERM: the workload saves its step, then exits 75
        "slice.chaos.times=1",  # counted per run name: the rerun is not hit
        "resilience.max_preemptions=0",
    )
    # The error says which budget ran out, not only what happened this time.
    budget = r"max_preemptions = 0 preemption\(s\) tolerated, all used: run it again"
    with pytest.raises(WorkloadPreempted, match=budget) as first:
        tpu_training_pipeline(config=config)
    run = tpu_training_pipeline(config=config)
    assert run.status == "completed" and run.final_step == 40

    events = read_events(Path(run.run_dir) / "events.jsonl")
    assert {e["attempt"] for e in events} == {1, 2}
    orchestrator = {e["attempt"]: e["invocation"] for e in events if e["source"] == "orchestrator"}
    assert orchestrator[2] == run.flow_run_id != orchestrator[1]
    (saved,) = [e["step"] for e in events if e["event"] == "preempted"]
    assert 2 <= saved < 40
    assert str(first.value).endswith(f"to resume from its newest checkpoint (step {saved})")
    resumed = [(e["attempt"], e["step"]) for e in events if e["event"] == "restored"]
    assert resumed == [(2, saved)]  # the workload stamps the attempt it was given

    per_step = config.train.batch_size * config.dataset.seq_len
    assert (run.attempts, run.preemptions) == (2, 1)
    assert run.tokens_trained == 40 * per_step
    # Not through the CLI and capsys: Prefect's console logger, set up by this test's
    # flows when it runs alone, would keep capsys's stream past the test.
    out = format_report(load_report(str(tmp_path), "twice"))
    assert "attempts 2, preempted 1; wall" in out and "over 2 invocations" in out
    assert f"steps that count: 40 x {per_step:,} tokens" in out


def test_a_spent_budget_with_no_checkpoint_says_a_rerun_starts_again(tmp_path, prefect_harness):
    # It said "run it again to resume from its newest checkpoint" when there was none.
    from flows.pipeline import tpu_training_pipeline
    from tasks.watch import WorkloadPreempted

    config = tiny_config(
        tmp_path,
        "run_name=none-saved",
        "train.checkpoint_every=1000",
        "slice.chaos.signal=KILL",
        "slice.chaos.at_step=2",
        "slice.chaos.times=1",
        "resilience.max_preemptions=0",
    )
    with pytest.raises(WorkloadPreempted, match=r"resume from step 0: it has no checkpoint yet$"):
        tpu_training_pipeline(config=config)


def test_attempts_killed_before_saving_again_and_again_fail_the_run(tmp_path, prefect_harness):
    """A workload killed without notice at the same step each time (out of memory on its
    host) was re-provisioned on the whole preemption budget, 21 slices by default."""
    from flows.pipeline import tpu_training_pipeline
    from infra.slices import build_provider
    from tasks.report import format_report, load_report
    from tasks.watch import WorkloadFailed

    config = tiny_config(
        tmp_path,
        "run_name=oom",
        "train.checkpoint_every=100",  # nothing is committed before the kill
        "slice.chaos.signal=KILL",
        "slice.chaos.at_step=2",
        "slice.chaos.times=5",  # the default resilience.max_stalled_attempts is 3
    )
    stalled = r"3 attempt\(s\) in a row were lost without a preemption notice before "
    with pytest.raises(WorkloadFailed, match=stalled + r"committing a checkpoint \(the run has"):
        tpu_training_pipeline(config=config)
    events = read_events(Path(tmp_path) / "runs" / "oom" / "events.jsonl")
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert [(e["attempt"], e["outcome"], e.get("stalled")) for e in ended] == [
        (1, "preempted", True),
        (2, "preempted", True),
        (3, "preempted", True),
    ]
    assert not build_provider("local", str(tmp_path)).list()  # torn down
    # The report tells these attempts from preemptions (it read "preempted 3" alone).
    out = format_report(load_report(str(tmp_path), "oom"))
    assert "attempts 3, preempted 3 (stalled 3);" in out
    rows = [row.split() for row in out.splitlines()]
    assert [row[3] for row in rows if row[:1] in (["1"], ["2"], ["3"])] == ["stalled"] * 3


def test_failed_training_still_kills_the_slice(tmp_path, prefect_harness, monkeypatch):
    """The watcher gives up while the workload is still running: teardown must kill it."""
    from flows.pipeline import tpu_training_pipeline
    from infra.slices import LocalSliceProvider
    from tasks.watch import WorkloadFailed, WorkloadPreempted

    seen_at_teardown = []
    real_delete = LocalSliceProvider.delete

    def delete_and_record(self, name, grace_s=5.0, where=None):
        seen_at_teardown.append(self.status(name).state.value)
        return real_delete(self, name, grace_s, where=where)

    monkeypatch.setattr(LocalSliceProvider, "delete", delete_and_record)
    config = tiny_config(
        tmp_path,
        "run_name=stalls",
        "slice.heartbeat_timeout_s=0.5",
        "resilience.heartbeat_confirm_s=0",
        "resilience.max_preemptions=0",
    )
    # Silent before its first heartbeat (never started) or after it (preempted).
    with pytest.raises((WorkloadPreempted, WorkloadFailed), match="no heartbeat"):
        tpu_training_pipeline(config=config)
    # Deletes before the create find nothing; the attempt's own teardown found it running.
    assert seen_at_teardown[0] == "NOT_FOUND" and "READY" in seen_at_teardown
    run_dir = tmp_path / "runs" / "stalls"
    assert _slices_left(tmp_path) == []
    assert processes_mentioning(str(run_dir / "config.json")) == []
    sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
    ((status, error),) = sink.query("SELECT status, error FROM runs WHERE run_id = 'stalls'")
    assert status == "failed" and "heartbeat" in error


def test_a_signal_stays_the_cause_when_the_teardown_after_it_fails(
    tmp_path, prefect_harness, monkeypatch
):
    # Ctrl-C or SIGTERM in training, then a slice the API will not delete: the teardown's
    # SliceError replaced the signal, so the run exited 1 instead of 143, its row named the
    # SliceError and the flow run was failed, not crashed (its crash hook never ran).
    import flows.pipeline as pipeline
    from infra.slices import LocalSliceProvider, SliceError

    def interrupted(config):
        def train(*args):
            raise KeyboardInterrupt

        return train

    def refuse(self, name, grace_s=5.0, where=None):
        raise SliceError(f"slice {name!r} could not be deleted: 503")

    monkeypatch.setattr(pipeline, "train_with_retries", interrupted)
    monkeypatch.setattr(LocalSliceProvider, "delete", refuse)
    config = tiny_config(tmp_path, "run_name=signalled")
    with pytest.raises(KeyboardInterrupt):
        pipeline.tpu_training_pipeline(config=config)
    sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
    ((status, error),) = sink.query("SELECT status, error FROM runs WHERE run_id = 'signalled'")
    assert status == "failed" and "KeyboardInterrupt" in error and "SliceError" not in error


def test_workload_error_fails_fast_with_its_message(tmp_path, prefect_harness, capsys):
    """A diverging run stops with a clear error and never checkpoints the bad state."""
    from flows.cli import main as cli_main

    args = ["run", "--config", str(REPO / "configs" / "tiny.yaml")]
    for override in (f"storage.root={tmp_path}", "run_name=diverges", "train.learning_rate=1e30"):
        args += ["--set", override]
    assert cli_main([*args, "--set", "train.warmup_steps=0"]) == 1
    err = capsys.readouterr().err
    assert "pipeline failed: WorkloadFailed:" in err and "not finite" in err
    # "lower train.learning_rate" alone sent users to a rerun that refuses a changed config.
    assert "a lower train.learning_rate or other data needs a new run_name" in err
    # It comes back on a rerun as it is: "run it again" alone sent users round that loop.
    assert err.rstrip().endswith("run it again to resume it once its cause is dealt with)")
    assert _slices_left(tmp_path) == []
    run_dir = tmp_path / "runs" / "diverges"
    assert checkpoint.latest_step(str(run_dir)) is None
    events = read_events(run_dir / "events.jsonl")  # a bug is never retried
    assert [e["event"] for e in events if e["source"] == "orchestrator"] == [
        "provision_requested",
        "provision_ready",
        "attempt_ended",
        "deleted",
    ]


def test_cli_refuses_a_rerun_that_would_train_something_else(tiny_run, capsys, tmp_path):
    from flows.cli import main as cli_main

    config, root, first = tiny_run
    path = tmp_path / "rerun.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json")))  # JSON is YAML
    slices = _slices_left(root)
    code = cli_main(["run", "--config", str(path), "--set", "train.learning_rate=0.001"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"run {first.run_id!r} already exists" in err and "train.learning_rate" in err
    assert _slices_left(root) == slices


def test_cli_refuses_bad_input_without_a_traceback(tmp_path):
    # Prefect's task and flow engines logged a refused input with its traceback, twice:
    # about 80 lines above the CLI's one-line message. Run as a user runs it: in-process,
    # pytest captures Prefect's console logs before they are printed.
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "ph")}
    env.pop("PREFECT_API_URL", None)
    none = f"{tmp_path}/none/*.txt"
    overrides = ["--set", f"storage.root={tmp_path}", "--set", f"dataset.sources=[{none}]"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            str(REPO / "configs/tiny.yaml"),
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    text = out.stdout + out.stderr
    assert f"invalid config or input:\ndataset source '{none}' matches no file" in out.stderr
    assert 'Task run failed with exception: DatasetError("dataset source' in text  # logged
    assert "Traceback" not in text


def test_cli_reports_a_spent_preemption_budget_without_a_traceback(tmp_path):
    # Prefect logged the budget's WorkloadPreempted with two chained tracebacks of the
    # watch's own code, twice, above the CLI's one line that says it all.
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "ph")}
    env.pop("PREFECT_API_URL", None)
    overrides = [
        f"storage.root={tmp_path}",
        "slice.chaos.signal=KILL",
        "slice.chaos.at_step=2",
        "slice.chaos.times=1",
        "resilience.max_preemptions=0",
    ]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs/tiny.yaml")]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    text = out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("pipeline failed: ")]
    assert said and "max_preemptions = 0 preemption(s) tolerated, all used" in said[0]
    assert "Task run failed with exception: WorkloadPreempted(" in text  # logged, one line
    assert "Traceback" not in text


def test_invalid_config_fails_in_validation_before_any_slice(tmp_path, prefect_harness):
    from flows.pipeline import tpu_training_pipeline

    bad = tiny_config(tmp_path).model_dump()
    bad["train"]["batch_size"] = 30  # not divisible by data*fsdp = 4
    with pytest.raises(Exception, match=r"train\.batch_size = 30 .*mesh\.data\*mesh\.fsdp"):
        tpu_training_pipeline(config=bad)
    assert not (tmp_path / "slices").exists() or _slices_left(tmp_path) == []
    assert not (tmp_path / "runs").exists()


def test_a_run_stopped_by_bad_input_before_training_still_lands_its_failed_row(
    tmp_path, prefect_harness
):
    """Its row was lost ("could not land the failed run's row: ... config.json: cannot read
    the workload config"): nothing had written the workload config yet, so a signal
    during sharding lost it too."""
    from flows.pipeline import tpu_training_pipeline
    from workloads.data import DatasetError

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n')
    config = tiny_config(
        tmp_path, "run_name=badinput", f"dataset.sources=[{corpus}]", "dataset.format=jsonl"
    )
    with pytest.raises(DatasetError, match=r"corpus\.jsonl:3"):
        tpu_training_pipeline(config=config)
    assert _slices_left(tmp_path) == []
    sink = DuckDBSink(str(tmp_path / "metrics.duckdb"))
    ((status, error, fingerprint),) = sink.query(
        "SELECT status, error, dataset_fingerprint FROM runs WHERE run_id = 'badinput'"
    )
    assert status == "failed" and "corpus.jsonl:3" in error and fingerprint == ""


@pytest.mark.parametrize(
    ("error", "code", "says"),
    [
        ("DatasetError", 2, "invalid config or input:"),  # the input must change
        ("DatasetWriteError", 1, "pipeline failed:"),  # a full disk: nothing to change
    ],
)
def test_cli_exit_code_tells_bad_input_from_a_dataset_it_could_not_write(
    tmp_path, capsys, monkeypatch, error, code, says
):
    # A full disk while sharding exited 2, "invalid config or input", which the README
    # keeps for a config or input the user must change.
    from flows import cli, pipeline
    from workloads import sources

    def fails(config):
        raise getattr(sources, error)("cannot write the shard /d/train-00000: No space left")

    monkeypatch.setattr(pipeline, "tpu_training_pipeline", fails)
    monkeypatch.setattr(cli, "orchestrate_here", contextlib.nullcontext)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(tiny_config(tmp_path).model_dump(mode="json")))
    assert cli.main(["run", "--config", str(path)]) == code
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    "stop", [RuntimeError("slice lost"), KeyboardInterrupt(), SystemExit(143)], ids=str
)
def test_the_cli_names_an_unnamed_run_and_how_to_resume_it(tmp_path, capsys, monkeypatch, stop):
    # It said "run None stopped by Ctrl-C; run it again to resume it": run again, the
    # config made a new run, from step 0.
    from flows import cli, pipeline

    ran = []

    def stops(config):
        ran.append(config.run_name)
        raise stop

    monkeypatch.setattr(pipeline, "tpu_training_pipeline", stops)
    monkeypatch.setattr(cli, "orchestrate_here", contextlib.nullcontext)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({**tiny_config(tmp_path).model_dump(mode="json"), "run_name": None}))
    if isinstance(stop, KeyboardInterrupt | SystemExit):  # Ctrl-C, SIGTERM (said as SIGTERM)
        with pytest.raises(type(stop)):
            cli.main(["run", "--config", str(path)])
    else:
        assert cli.main(["run", "--config", str(path)]) == 1
    (name,) = ran
    assert name and name.startswith("run-")
    last = capsys.readouterr().err.splitlines()[-1]
    assert f"run {name}" in last and f"again with --set run_name={name} to resume it" in last


def test_an_eval_split_gone_after_training_is_an_evaluation_error(tmp_path, monkeypatch):
    # Deleting the dataset during training exited 2 at evaluation ("invalid config or
    # input"), although the input had been accepted and a slice had trained on it.
    from tasks import checks
    from workloads import evaluate
    from workloads.sources import DatasetError

    def gone(wcfg, step, stop=None):
        raise DatasetError("incomplete dataset: no manifest.json in /d")

    monkeypatch.setattr(evaluate, "evaluate", gone)
    monkeypatch.setattr(checks, "load_workload_config", lambda plan: None)
    with pytest.raises(checks.EvaluationError, match="cannot evaluate step 40: incomplete"):
        checks.evaluate_checkpoint.fn(None, 40)
