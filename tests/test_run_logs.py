"""The project's own module logs reach the flow run's logs in the Prefect API (the UI),
and the Google API retries say what they retry. Before, a TPU create retried per zone or a
BigQuery call answered 503 again and again showed nothing in the UI until it gave up."""

from __future__ import annotations

import asyncio
import logging
import time
import warnings

from google.api_core import exceptions as gexc

import flows  # noqa: F401 (importing the flows package routes the module logs)
from infra.gcp.retries import logged_retry


def _api_logs(flow_run_id) -> list[tuple[str, str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read():
        async with get_client() as client:
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            return await client.read_logs(flt)

    return [(log.name, log.message) for log in asyncio.run(read())]


def test_a_retried_google_call_is_logged_in_its_flow_run(prefect_harness):
    from prefect import flow, task
    from prefect.context import get_run_context

    answers = [gexc.ServiceUnavailable("backend busy"), "done"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    retry = logged_retry(
        "TPU API call failed", lambda e: isinstance(e, gexc.ServiceUnavailable), initial=0.01
    )

    @task
    def provision():
        assert retry(call)() == "done"
        logging.getLogger("infra.slices.gcp").info("deleting PREEMPTED slice s before re-creating")
        return get_run_context().task_run.flow_run_id

    @flow
    def pipeline():
        return provision()

    flow_run_id = pipeline()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = _api_logs(flow_run_id)
        if any(name == "infra.slices.gcp" for name, _ in logs):
            break
        time.sleep(0.5)
    assert (
        "infra.retries",
        "TPU API call failed: 503 backend busy; retrying (for up to 300 s)",
    ) in logs
    assert ("infra.slices.gcp", "deleting PREEMPTED slice s before re-creating") in logs


def test_module_logs_outside_a_run_are_kept_without_a_warning(caplog):
    # `tpupipe shard` or `tpupipe report` log outside any flow run: Prefect's own API
    # handler would warn there that it has no flow run to send the line to.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logging.getLogger("workloads.checkpoint").warning("checkpoint step 4 quarantined")
    assert "checkpoint step 4 quarantined" in caplog.messages


def test_a_logger_prefect_already_sends_is_sent_once(prefect_harness):
    # `PREFECT_LOGGING_EXTRA_LOGGERS=infra` gives `infra` Prefect's own API handler, on
    # top of the one `flows` adds: each line must still reach the run's logs once.
    from prefect import flow
    from prefect.context import get_run_context
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("infra")
    prefects = APILogHandler()
    logger.addHandler(prefects)
    try:

        @flow
        def pipeline():
            logging.getLogger("infra.slices.local").info("slice s READY")
            return get_run_context().flow_run.id

        flow_run_id = pipeline()
        prefects.flush()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            logs = _api_logs(flow_run_id)
            if ("infra.slices.local", "slice s READY") in logs:
                break
            time.sleep(0.5)
        time.sleep(2)  # a second copy would have been sent by now
        logs = _api_logs(flow_run_id)
    finally:
        logger.removeHandler(prefects)
    assert logs.count(("infra.slices.local", "slice s READY")) == 1


def test_the_cli_starts_without_importing_prefect():
    # `tpupipe shard`, `validate` and `report` run no flow: importing Prefect cost them
    # about a second before anything started.
    import subprocess
    import sys

    code = "import sys, flows.cli; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_refusal_logged_without_traceback_names_an_exception_class():
    # Matched by name: SliceNameTaken moved from tasks.training to tasks.own_slice and its
    # name here did not, so the refusal was logged with its traceback again.
    import importlib

    from tasks.logs import REFUSALS

    for name in REFUSALS:
        module, _, cls = name.rpartition(".")
        found = getattr(importlib.import_module(module), cls, None)
        assert isinstance(found, type) and issubclass(found, Exception), name
        assert f"{found.__module__}.{found.__qualname__}" == name, name


def test_a_refusal_is_logged_in_one_line_that_names_it():
    # A deployment's run given a config that does not validate (the UI's Run form) was
    # logged "Engine execution exited with unexpected exception" and a Prefect traceback;
    # with the traceback dropped alone, that line would name nothing.
    import logging
    import sys

    from prefect.exceptions import ParameterTypeError

    from tasks.logs import _RefusalsWithoutTraceback

    def record(message: str, *args: object) -> logging.LogRecord:
        try:
            raise ParameterTypeError("train.warmup_steps = 50 must be below train.steps = 10")
        except ParameterTypeError:
            info = sys.exc_info()
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, "f", 1, message, args, info)

    bare = record("Engine execution exited with unexpected exception")
    named = record("Failed: %s", "ParameterTypeError(...)")
    assert _RefusalsWithoutTraceback().filter(bare) and _RefusalsWithoutTraceback().filter(named)
    assert (bare.exc_info, named.exc_info) == (None, None)
    assert bare.getMessage() == (
        "Engine execution exited with unexpected exception: ParameterTypeError: "
        "train.warmup_steps = 50 must be below train.steps = 10"
    )
    assert named.getMessage() == "Failed: ParameterTypeError(...)"  # named already
