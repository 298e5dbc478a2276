"""The deployments of prefect.yaml against a real Prefect server: deployed with the CLI,
run by a process worker, triggered through the API as the UI does, cancelled mid-training,
swept through `run_deployment`, and the `train` form looked at in the real UI.

One server, one worker and one deploy serve the whole module (~15 s + ~12 s to start).
"""

from __future__ import annotations

import importlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import SyncPrefectClient

from infra.metrics import DuckDBSink
from infra.slices import build_provider
from tests.browser import chromium_binary, headless_chromium
from tests.helpers import processes_mentioning, tiny_config
from tests.prefect_server import REPO, PrefectServer, running_server, running_worker

pytestmark = [pytest.mark.integration, pytest.mark.server]

SCREENSHOTS = REPO / "test-artifacts"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def test_prefect_yaml_entrypoints_are_the_projects_flows():
    """Cheap check before the server ones: every entrypoint loads and is a flow."""
    from prefect import Flow

    spec = prefect_yaml()
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"train-nightly", "train", "sweep", "reap-orphans"}
    for d in deployments.values():
        path, name = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert isinstance(getattr(module, name), Flow), d["entrypoint"]
        assert d["work_pool"]["name"] == spec["definitions"]["work_pools"]["default"]["name"]


@pytest.mark.parametrize("name", ["train", "sweep", "reap-orphans"])
def test_an_entrypoint_loaded_by_path_as_a_worker_does_sends_module_logs_to_its_run(name):
    """A process worker loads `flows/pipeline.py` by its path, which imports no package:
    `flows/__init__.py`'s set-up never ran, and no `tasks.*` or `infra.*` line (the
    reaper's "kept slice ...", the hooks' "deleted slice ...") reached a deployed run's
    logs, and a refusal was logged with its tracebacks."""
    import subprocess
    import sys

    (entrypoint,) = [d["entrypoint"] for d in prefect_yaml()["deployments"] if d["name"] == name]
    check = (
        "import logging\n"
        "from prefect.flows import load_flow_from_entrypoint\n"
        f"load_flow_from_entrypoint({entrypoint!r})\n"
        "from tasks.logs import MODULE_LOGGERS, RUN_LOGGERS, RunLogHandler\n"
        "assert all(any(isinstance(h, RunLogHandler) for h in logging.getLogger(n).handlers)"
        " for n in MODULE_LOGGERS), 'module logs not sent to runs'\n"
        "assert all(logging.getLogger(n).filters for n in RUN_LOGGERS), 'no refusal filter'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]


@dataclass
class Stack:
    server: PrefectServer
    root: Path  # storage root of every run the tests start

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        # Explicit API URL: the session's test harness may own the process's settings.
        return SyncPrefectClient(api=self.server.api_url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Server, work pool, `prefect deploy --all`, worker; everything stopped afterwards,
    and any slice a failed test left behind deleted."""
    root = tmp_path_factory.mktemp("store")
    pool = prefect_yaml()["definitions"]["work_pools"]["default"]["name"]
    with running_server(tmp_path_factory.mktemp("prefect-home")) as server:
        server.cli("work-pool", "create", pool, "--type", "process")
        server.cli("deploy", "--all")
        try:
            with running_worker(server, pool):
                yield Stack(server, root)
        finally:
            provider = build_provider("local", str(root))
            for status in provider.list():
                provider.delete(status.name)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    """Poll `predicate` until it returns something truthy; returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def run_deployment_via_api(stack: Stack, name: str, parameters: dict):
    """Create a flow run of deployment `name` the way the UI's Run form does."""
    with stack.client() as client:
        deployment = client.read_deployment_by_name(name)
        return client.create_flow_run_from_deployment(deployment.id, parameters=parameters)


def start_sweep(stack: Stack, name: str, *overrides: str):
    """A run of the `sweep` deployment: two trials (seeds 1 and 2) of configs/tiny.yaml."""
    from tasks.sweep_space import SearchSpace, SweepConfig

    sweep = SweepConfig(
        base=tiny_config(stack.root, *overrides),
        space=SearchSpace(grid={"seed": [1, 2]}),
        sweep_name=name,
        chip_limit=f"chips-{uuid.uuid4().hex[:8]}",
        chip_quota=16,
    )
    return run_deployment_via_api(
        stack, "tpu-sweep/sweep", {"config": sweep.model_dump(mode="json")}
    )


def final_state(stack: Stack, flow_run_id, timeout_s: float) -> str:
    def ended():
        with stack.client() as client:
            state = client.read_flow_run(flow_run_id).state
        return state.type.value if state and state.type.value in TERMINAL else None

    return wait_for(ended, timeout_s, f"flow run {flow_run_id} to end")


def test_every_deployment_is_registered_with_its_schedule_and_pool(stack):
    with stack.client() as client:
        deployments = {
            name: client.read_deployment_by_name(name)
            for name in (
                "tpu-training-pipeline/train-nightly",
                "tpu-training-pipeline/train",
                "tpu-sweep/sweep",
                "reap-orphans/reap-orphans",
            )
        }
    nightly = deployments["tpu-training-pipeline/train-nightly"].schedules
    assert [(s.schedule.cron, s.schedule.timezone) for s in nightly] == [("0 3 * * *", "UTC")]
    reaper = deployments["reap-orphans/reap-orphans"].schedules
    assert [s.schedule.interval.total_seconds() for s in reaper] == [600]
    assert not deployments["tpu-training-pipeline/train"].schedules
    assert {d.work_pool_name for d in deployments.values()} == {"local-process"}
    # The form of `train` comes from PipelineConfig: every field of every section described.
    schema = deployments["tpu-training-pipeline/train"].parameter_openapi_schema
    undescribed = [
        f"{model}.{field}"
        for model, definition in schema["definitions"].items()
        for field, prop in definition.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert undescribed == []
    assert deployments["tpu-training-pipeline/train"].enforce_parameter_schema


def test_the_server_s_scheduler_makes_the_scheduled_deployments_runs(tmp_path):
    """On its own server, scheduler on (the module's is off, so that no scheduled run
    competes with the tests'), no worker: with the SQLAlchemy 2.1 the lock once held,
    Prefect's scheduler failed every loop ("Can't evaluate bulk DML statement"), and
    reap-orphans and train-nightly never ran."""
    pool = prefect_yaml()["definitions"]["work_pools"]["default"]["name"]
    with running_server(tmp_path / "prefect-home", scheduler=True) as server:
        server.cli("work-pool", "create", pool, "--type", "process")
        server.cli("deploy", "--name", "reap-orphans", "--name", "train-nightly")

        def scheduled() -> dict[str, int]:
            with SyncPrefectClient(api=server.api_url) as client:
                runs = client.read_flow_runs()
                names = {d.id: d.name for d in client.read_deployments()}
            counts: dict[str, int] = {}
            for run in runs:
                if run.state and run.state.type.value == "SCHEDULED":
                    name = names.get(run.deployment_id)
                    counts[name] = counts.get(name, 0) + 1
            return counts if set(counts) == {"reap-orphans", "train-nightly"} else {}

        counts = wait_for(scheduled, 60, "the scheduler's first runs")
        assert "bulk DML" not in server.logs.read_text()
    assert counts["reap-orphans"] >= 3 and counts["train-nightly"] >= 1


def test_an_integer_beyond_64_bits_from_the_ui_is_refused_and_the_runs_list_still_reads(stack):
    """`train.steps = 10**30` from the Run form was stored: the run trained without end, and
    every listing of flow runs (the UI's Runs page) failed with HTTP 500 until it was
    deleted."""
    from prefect.exceptions import PrefectHTTPStatusError

    config = tiny_config(stack.root, "run_name=huge").model_dump(mode="json")
    for section, field, value in (("train", "steps", 10**30), ("eval", "max_batches", 2**64)):
        parameters = {"config": {**config, section: {**config[section], field: value}}}
        with pytest.raises(PrefectHTTPStatusError, match=rf"409 .*{value}"):
            run_deployment_via_api(stack, "tpu-training-pipeline/train", parameters)
    with stack.client() as client:
        client.read_flow_runs()  # raised HTTP 500 for as long as such a run was stored


def test_train_from_the_api_completes_and_its_metrics_land(stack):
    config = tiny_config(stack.root, "run_name=from-api")
    flow_run = run_deployment_via_api(
        stack, "tpu-training-pipeline/train", {"config": config.model_dump(mode="json")}
    )
    assert final_state(stack, flow_run.id, timeout_s=400) == "COMPLETED"

    sink = DuckDBSink(stack.root / "metrics.duckdb")
    ((status, linked_flow_run, final_step),) = sink.query(
        "SELECT status, flow_run_id, final_step FROM runs WHERE run_id = 'from-api'"
    )
    assert (status, linked_flow_run, final_step) == (
        "completed",
        str(flow_run.id),
        config.train.steps,
    )
    ((steps,),) = sink.query("SELECT count(*) FROM step_metrics WHERE run_id = 'from-api'")
    assert steps >= config.train.steps // config.train.log_every
    assert sink.query("SELECT count(*) FROM eval_metrics WHERE run_id = 'from-api'") == [(1,)]


def test_cancelling_a_run_mid_training_deletes_its_slice(stack):
    config = tiny_config(stack.root, "run_name=cancelled", "train.steps=100000")
    flow_run = run_deployment_via_api(
        stack, "tpu-training-pipeline/train", {"config": config.model_dump(mode="json")}
    )
    provider = build_provider("local", str(stack.root))
    labels = {"flow-run-id": str(flow_run.id)}
    status_file = stack.root / "runs" / "cancelled" / "status.json"

    def training():
        import json

        beat = json.loads(status_file.read_text()) if status_file.exists() else {}
        return provider.list(labels) and (beat.get("step") or 0) >= 2

    wait_for(training, 300, "the run to train a few steps")
    from prefect.states import Cancelling

    with stack.client() as client:  # what the UI's Cancel button does
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    assert final_state(stack, flow_run.id, timeout_s=120) == "CANCELLED"
    wait_for(lambda: not provider.list(labels), 60, "the cancelled run's slice to go")
    config_json = str(stack.root / "runs" / "cancelled" / "config.json")
    wait_for(lambda: not processes_mentioning(config_json), 30, "the workload to exit")


def test_deployed_sweep_runs_its_trials_through_the_train_deployment(stack):
    flow_run = start_sweep(stack, "deployed")
    assert final_state(stack, flow_run.id, timeout_s=500) == "COMPLETED"

    sink = DuckDBSink(stack.root / "metrics.duckdb")
    trials = sink.query(
        "SELECT trial, status, flow_run_id, sweep_flow_run_id FROM sweeps "
        "WHERE sweep_id = 'deployed' ORDER BY trial"
    )
    assert [(t[0], t[1], t[3]) for t in trials] == [
        (0, "completed", str(flow_run.id)),
        (1, "completed", str(flow_run.id)),
    ]
    with stack.client() as client:
        train = client.read_deployment_by_name("tpu-training-pipeline/train")
        runs = [client.read_flow_run(uuid.UUID(t[2])) for t in trials]
    # Each trial ran as a run of `train` on the worker, linked to the sweep as a subflow.
    assert all(r.deployment_id == train.id and r.parent_task_run_id for r in runs)
    assert [r.name for r in runs] == ["deployed-t00", "deployed-t01"]


def test_cancelling_a_deployed_sweep_cancels_its_trials_runs_and_their_slices(stack):
    # Trials ran on as runs of `train`, their slices billed, after the sweep was cancelled.
    from prefect.states import Cancelling

    flow_run = start_sweep(stack, "cancel-me", "train.steps=100000")
    provider = build_provider("local", str(stack.root))
    beats = [stack.root / "runs" / f"cancel-me-t0{i}" / "status.json" for i in (0, 1)]

    def both_training():
        import json

        steps = [json.loads(b.read_text()).get("step") or 0 for b in beats if b.exists()]
        return len(steps) == 2 and min(steps) >= 2

    wait_for(both_training, 400, "both trials to train a few steps")
    with stack.client() as client:  # what the UI's Cancel button does
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    assert final_state(stack, flow_run.id, timeout_s=180) == "CANCELLED"

    sink = DuckDBSink(stack.root / "metrics.duckdb")
    trials = sink.query(
        "SELECT trial, status, flow_run_id FROM sweeps WHERE sweep_id = 'cancel-me' ORDER BY trial"
    )
    assert [(t[0], t[1]) for t in trials] == [(0, "cancelled"), (1, "cancelled")]
    # Each row says what stopped its trial, as its run's row does, not Prefect's "Flow
    # run was cancelled successfully.".
    errors = sink.query(
        "SELECT s.error, r.error FROM sweeps s JOIN runs r USING (run_id) "
        "WHERE s.sweep_id = 'cancel-me' ORDER BY s.trial"
    )
    assert len(errors) == 2 and all(mine == theirs and theirs for mine, theirs in errors), errors
    for _, _, trial_run in trials:
        assert final_state(stack, uuid.UUID(trial_run), timeout_s=60) == "CANCELLED"
        labels = {"flow-run-id": trial_run}
        wait_for(lambda labels=labels: not provider.list(labels), 60, "a trial's slice to go")
    for i in (0, 1):
        config_json = str(stack.root / "runs" / f"cancel-me-t0{i}" / "config.json")
        wait_for(lambda c=config_json: not processes_mentioning(c), 30, "the workloads to exit")


def test_ui_run_form_of_train_shows_the_config_fields_and_their_descriptions(stack, tmp_path):
    binary = chromium_binary()
    assert binary, "headless Chromium is missing: `make chromium` installs Debian's package"
    from workloads.config import PipelineConfig, TrainConfig

    with stack.client() as client:
        deployment = client.read_deployment_by_name("tpu-training-pipeline/train")
    url = f"{stack.server.url}/deployments/deployment/{deployment.id}/run"
    # Descriptions of the top-level sections and of fields nested inside them.
    needles = [
        PipelineConfig.__doc__.splitlines()[0],
        *(f.description for f in PipelineConfig.model_fields.values()),
        TrainConfig.model_fields["learning_rate"].description,
        TrainConfig.model_fields["steps"].description,
    ]
    with headless_chromium(tmp_path / "chromium-profile", binary) as page:
        page.goto(url)
        try:
            text = page.wait_for_text("Learning Rate", *needles, timeout_s=90)
        finally:
            shot = page.screenshot(SCREENSHOTS / "ui-train-run-form.png")
    assert "Submit" in text and shot.stat().st_size > 10_000


def test_the_train_form_submitted_as_it_opens_leaves_the_size_to_fill_in_the_model(stack, tmp_path):
    # The form sent the default model's dimensions beside the size, so a size picked in it
    # was overridden: `model.size: small` trained the tiny model (probe X, session 39).
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from workloads.config import PipelineConfig

    binary = chromium_binary()
    assert binary, "headless Chromium is missing: `make chromium` installs Debian's package"
    pool = prefect_yaml()["definitions"]["work_pools"]["default"]["name"]
    with stack.client() as client:
        deployment = client.read_deployment_by_name("tpu-training-pipeline/train")
        of_train = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        before = {r.id for r in client.read_flow_runs(deployment_filter=of_train)}
    stack.server.cli("work-pool", "pause", pool)  # the run is read, never trained
    try:
        with headless_chromium(tmp_path / "chromium-profile", binary) as page:
            page.goto(f"{stack.server.url}/deployments/deployment/{deployment.id}/run")
            page.wait_for_text("Submit", "D Model", timeout_s=90)
            page.call(
                "Runtime.evaluate",
                expression="[...document.querySelectorAll('button')]"
                ".find(b => b.innerText.trim() === 'Submit').click()",
            )

            def submitted():
                with stack.client() as client:
                    runs = client.read_flow_runs(deployment_filter=of_train)
                return [r for r in runs if r.id not in before]

            (run,) = wait_for(submitted, 60, "the form's flow run")
        config = run.parameters["config"]
        assert [config["model"].get(k) for k in ("d_model", "n_layers", "n_heads", "d_ff")] == [
            None
        ] * 4
        assert PipelineConfig.model_validate(config).model_dump() == PipelineConfig().model_dump()
        config["model"]["size"] = "small"  # what picking it in the form changes
        assert PipelineConfig.model_validate(config).model.d_model == 512
    finally:
        with stack.client() as client:
            for r in submitted() if "submitted" in locals() else []:
                client.delete_flow_run(r.id)
        stack.server.cli("work-pool", "resume", pool)
