"""The BigQuery sink under transport faults the emulator never makes by itself: BigQuery's
own transient answers (403 rateLimitExceeded, 5xx backendError), connection resets,
permanent refusals that must not be retried, and a drop of the staging tables failing
after the MERGE committed."""

from __future__ import annotations

import json

import pytest
import requests
from google.api_core import exceptions as gexc

from infra.metrics import bigquery_sink
from infra.metrics.bigquery_sink import BigQuerySink
from tests.emulator.test_bigquery_sink import count, rows

pytestmark = pytest.mark.emulator


def _answer(code: int, reason: str, message: str) -> requests.Response:
    resp = requests.Response()
    resp.request = requests.Request("GET", "http://bigquery.invalid/").prepare()
    resp.status_code = code
    resp.headers["Content-Type"] = "application/json"
    error = {"code": code, "message": message, "errors": [{"reason": reason, "message": message}]}
    resp._content = json.dumps({"error": error}).encode()
    return resp


class Faults:
    """Wraps the client's HTTP session: the first request matching each fault gets it."""

    def __init__(self, sink, monkeypatch) -> None:
        self.pending: list[tuple[str, str, object]] = []
        self.seen: list[tuple[str, str]] = []
        self.timeouts: list[object] = []  # each request's own time limit
        real = sink.client._http.request

        def request(method, url, *args, **kwargs):
            self.seen.append((method, url))
            self.timeouts.append(kwargs.get("timeout"))
            for i, (m, part, fault) in enumerate(self.pending):
                if m == method and part in url:
                    del self.pending[i]
                    if isinstance(fault, Exception):
                        raise fault
                    return fault
            return real(method, url, *args, **kwargs)

        monkeypatch.setattr(sink.client._http, "request", request)


@pytest.fixture
def sink(bq_emulator, request) -> BigQuerySink:
    from infra.gcp.clients import bigquery_client

    dataset = f"f_{abs(hash(request.node.nodeid)) % 10**8}"
    return BigQuerySink(bigquery_client("test-project"), dataset, location="US")


@pytest.fixture
def fast_retry(monkeypatch):
    monkeypatch.setattr(
        bigquery_sink, "RETRY", bigquery_sink.RETRY.with_delay(initial=0.01, maximum=0.05)
    )


def test_bigquerys_own_transient_answers_and_connection_resets_are_retried(
    sink, monkeypatch, fast_retry
):
    faults = Faults(sink, monkeypatch)
    reset = requests.exceptions.ConnectionError("Connection reset by peer")
    faults.pending = [
        # Table metadata updates are rate limited per table: BigQuery answers 403.
        ("PATCH", "/tables/_staging_", _answer(403, "rateLimitExceeded", "Exceeded rate limits")),
        ("POST", "/test-project/jobs?", reset),  # the MERGE transaction's job insert
        ("GET", "/queries/", _answer(500, "internalError", "Internal error")),
        ("GET", "/datasets/", _answer(503, "backendError", "Backend error")),
    ]
    run, steps, evals = rows()

    sink.land(run, steps, evals)

    assert faults.pending == []
    assert count(sink, "step_metrics", "r1") == 5 and count(sink, "runs", "r1") == 1


def test_a_permanent_refusal_is_not_retried(sink, monkeypatch, fast_retry):
    faults = Faults(sink, monkeypatch)
    denied = _answer(403, "accessDenied", "Access Denied: Dataset test-project:m")
    faults.pending = [("GET", "/datasets/", denied)]
    run, steps, evals = rows()

    with pytest.raises(gexc.Forbidden, match="Access Denied"):
        sink.land(run, steps, evals)
    assert len(faults.seen) == 1


def test_a_dataset_in_another_location_is_named_before_anything_lands(sink):
    from google.cloud import bigquery

    existing = bigquery.Dataset(sink.dataset)
    existing.location = "EU"
    sink.client.create_dataset(existing)

    # BigQuery runs a job where its data is: every load and MERGE of a US sink would fail
    # with "Not found: Dataset ... was not found in location US", for a dataset that exists.
    with pytest.raises(bigquery_sink.LocationError, match=r"is in EU.*metrics.location.*US"):
        sink.land(*rows())
    assert list(sink.client.list_tables(sink.dataset)) == []


def test_a_staging_table_a_crash_left_with_an_older_schema_is_replaced(sink):
    """A landing that crashed after its load leaves its staging table for a day; a later
    landing of the run, after the row model gained a column, loaded into it with WRITE_TRUNCATE
    but kept its old schema on the emulator, and the MERGE then failed on the new column."""
    from google.cloud import bigquery

    from infra.metrics import StepMetricRow as StepRow

    sink.ensure_tables()
    old_schema = [f for f in bigquery_sink.bq_schema(StepRow) if f.name in ("run_id", "step")]
    sink.client.create_table(bigquery.Table(sink._staging(StepRow, "r1"), schema=old_schema))
    run, steps, evals = rows()

    sink.land(run, steps, evals)

    assert count(sink, "step_metrics", "r1") == 5
    ((loss,),) = sink.query(
        f"SELECT loss FROM `{sink.dataset}.step_metrics` WHERE run_id = @run_id AND step = 1",
        "r1",
    )
    assert loss is not None


def test_every_request_has_a_time_limit_and_a_hung_one_is_retried(sink, monkeypatch, fast_retry):
    # The library sends requests with no timeout by default: a MERGE whose answer never
    # came hung the landing for 11 minutes, until a SIGTERM (RETRY's deadline is only
    # looked at between attempts, and there was no second attempt).
    faults = Faults(sink, monkeypatch)
    hung = requests.exceptions.ReadTimeout("read timed out")  # what a time limit gives
    faults.pending = [("POST", "/jobs?prettyPrint", hung)]  # the MERGE's job insert
    run, steps, evals = rows()

    sink.land(run, steps, evals)

    assert faults.pending == [] and count(sink, "step_metrics", "r1") == 5
    unlimited = [seen for seen, t in zip(faults.seen, faults.timeouts, strict=True) if t is None]
    assert unlimited == []


def test_a_landing_failing_for_good_is_bounded_and_names_the_run_and_dataset(sink, monkeypatch):
    # A MERGE answered 500 every time was retried silently for 878 s (the library's own
    # job retry around RETRY), then failed naming only a URL.
    import threading

    monkeypatch.setattr(
        bigquery_sink, "RETRY", bigquery_sink.RETRY.with_delay(0.01, 0.05).with_timeout(1.0)
    )
    sink.ensure_tables()
    faults = Faults(sink, monkeypatch)
    failing = _answer(500, "backendError", "Backend error")
    faults.pending = [("POST", "/jobs?prettyPrint", failing) for _ in range(10_000)]
    run, steps, evals = rows()
    raised: list[BaseException] = []

    def land() -> None:
        try:
            sink.land(run, steps, evals)
        except BaseException as exc:  # the test looks at it
            raised.append(exc)

    worker = threading.Thread(target=land, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the landing was still retrying after 60 s"
    (error,) = raised
    assert isinstance(error, gexc.RetryError | gexc.InternalServerError)
    assert f"landing run r1 into {sink.dataset}" in str(error)


def test_a_run_into_a_dataset_of_another_location_is_refused_before_provisioning(sink, tmp_path):
    # metrics.location=EU against a US dataset trained the whole run, then failed landing.
    from google.cloud import bigquery

    from tasks.access import check_backend_access
    from tasks.plan import plan_run
    from workloads.config_file import ConfigError

    config = _eu_config(sink, tmp_path)
    existing = bigquery.Dataset(sink.dataset)
    existing.location = "US"
    sink.client.create_dataset(existing)
    with pytest.raises(ConfigError, match=r"^metrics.location = 'EU': .* is in US"):
        check_backend_access(config, plan_run(config))
    assert list(sink.client.list_tables(sink.dataset)) == []  # nothing made there
    us = config.model_copy(update={"metrics": config.metrics.model_copy(update={"location": "us"})})
    check_backend_access(us, plan_run(us))


def test_the_dataset_and_tables_are_made_before_provisioning_or_the_run_is_refused(
    sink, tmp_path, monkeypatch, fast_retry
):
    """A dataset the credentials may not create was found missing only when landing, after
    the run trained, in an error naming no dataset; so was a table whose column changed
    type."""
    from google.cloud import bigquery

    from infra.metrics import RunRow
    from tasks.access import check_backend_access
    from tasks.plan import plan_run
    from workloads.config_file import ConfigError

    project, dataset = sink.dataset.split(".")
    config = _eu_config(sink, tmp_path)
    plan = plan_run(config)
    denied = _answer(403, "accessDenied", "User does not have bigquery.datasets.create")
    Faults(sink, monkeypatch).pending = [("POST", f"/projects/{project}/datasets", denied)]
    monkeypatch.setattr(bigquery_sink.BigQuerySink, "__init__", _sharing_client(sink))
    with pytest.raises(
        ConfigError,
        match=rf"^metrics.dataset = '{dataset}': these credentials may not use {sink.dataset} "
        rf"\(creating BigQuery dataset {sink.dataset} in EU: .*datasets.create\); grant ",
    ):
        check_backend_access(config, plan)

    check_backend_access(config, plan)  # allowed now: made in metrics.location, with tables
    assert sink.client.get_dataset(sink.dataset).location == "EU"
    tables = {t.table_id for t in sink.client.list_tables(sink.dataset)}
    assert {m.table for m in sink.models} <= tables

    runs = f"{sink.dataset}.{RunRow.table}"
    sink.client.delete_table(runs)
    schema = [bigquery.SchemaField(name, "STRING") for name in ("run_id", "final_step")]
    sink.client.create_table(bigquery.Table(runs, schema=schema))
    with pytest.raises(ConfigError, match=r"final_step STRING -> INT64"):
        check_backend_access(config, plan)


def _eu_config(sink, tmp_path):
    """configs/tiny.yaml landing in `sink`'s dataset, with metrics.location EU."""
    from tests.helpers import tiny_config

    project, dataset = sink.dataset.split(".")
    return tiny_config(
        tmp_path,
        "metrics.sink=bigquery",
        f"metrics.project={project}",
        f"metrics.dataset={dataset}",
        "metrics.location=EU",
    )


def _sharing_client(sink):
    """`BigQuerySink.__init__` that gives every new sink `sink`'s client (and its faults)."""
    real = bigquery_sink.BigQuerySink.__init__

    def init(self, client, *args, **kwargs):
        real(self, sink.client, *args, **kwargs)

    return init


def fail_drops_after_commit(sink, monkeypatch, answer: requests.Response) -> Faults:
    """Faults that answer every staging table's DELETE with `answer` once the landing's
    MERGE has committed; the drop before each load is left alone."""
    faults = Faults(sink, monkeypatch)
    real_query = sink._query

    def query(sql, run_id=None):
        result = real_query(sql, run_id)
        if "COMMIT TRANSACTION" in sql:
            faults.pending = [("DELETE", "/tables/_staging_", answer)] * 10_000
        return result

    monkeypatch.setattr(sink, "_query", query)
    return faults


def test_a_failed_drop_after_the_merge_committed_is_a_warning_not_a_failed_landing(
    sink, monkeypatch, caplog
):
    # The drop raised after the rows were stored, with the library's own 600 s retry
    # ("RetryError Timeout of 600.0s exceeded ... 503 DELETE"): the pipeline then rewrote
    # the completed run's row to failed and exited 1.
    import threading

    from infra.metrics.bigquery_sink import STAGING_TTL

    monkeypatch.setattr(
        bigquery_sink, "RETRY", bigquery_sink.RETRY.with_delay(0.01, 0.05).with_timeout(1.0)
    )
    faults = fail_drops_after_commit(sink, monkeypatch, _answer(503, "backendError", "Backend"))
    run, steps, evals = rows()
    landed: list[object] = []
    worker = threading.Thread(target=lambda: landed.append(sink.land(run, steps, evals)))
    worker.daemon = True

    worker.start()
    worker.join(timeout=30)

    assert not worker.is_alive(), "the drop was still retrying after 30 s (not RETRY's 1 s)"
    (result,) = landed  # returned, not raised
    assert (result.runs, result.steps, result.evals) == (1, 5, 1)
    assert sink.read_run("r1").status == "completed" and count(sink, "step_metrics", "r1") == 5
    assert 10_000 - len(faults.pending) > 1  # the drop after the commit was retried
    drops = [t for (m, _), t in zip(faults.seen, faults.timeouts, strict=True) if m == "DELETE"]
    assert set(drops) == {bigquery_sink.CALL_TIMEOUT_S}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == bigquery_sink.__name__]
    assert warning.startswith(f"landing run r1 into {sink.dataset}: the rows are stored")
    assert "503" in warning and f"{STAGING_TTL.total_seconds() / 3600:.0f} h" in warning
    for model in sink.models:  # every table left behind is named
        assert sink._staging(model, "r1") in warning


def test_a_sweep_landing_survives_a_refused_drop_of_its_staging_table(
    sink, monkeypatch, caplog, fast_retry
):
    from infra.metrics import SweepRow
    from tests.emulator.test_bigquery_sweeps import trial

    denied = _answer(403, "accessDenied", "Access Denied: Table _staging_sweeps_sw")
    faults = fail_drops_after_commit(sink, monkeypatch, denied)

    assert sink.land_sweep([trial("sw", 0, 3.0), trial("sw", 1, 2.5)]) == 2

    assert sink.query(f"SELECT COUNT(*) FROM `{sink.dataset}.sweeps`") == [(2,)]
    assert len(faults.pending) == 10_000 - 1  # refused once: a 403 is not retried
    (warning,) = [r.getMessage() for r in caplog.records if r.name == bigquery_sink.__name__]
    assert f"landing sweep sw into {sink.dataset}.sweeps" in warning
    assert "Access Denied" in warning and sink._staging(SweepRow, "sw") in warning


def test_a_sink_given_little_patience_gives_up_within_it_naming_the_call(sink, monkeypatch, caplog):
    # A SIGTERMed run's row (and a stopped sweep's) retried each call against an
    # unreachable BigQuery for 300 s, with warnings that named no call.
    import time

    unreachable = requests.exceptions.ConnectionError("Remote end closed connection")
    faults = Faults(sink, monkeypatch)
    faults.pending = [("GET", "/", unreachable)] * 1000 + [("POST", "/", unreachable)] * 1000
    patient = BigQuerySink(sink.client, sink.dataset.split(".")[1], patience_s=1.0)

    started = time.monotonic()
    with pytest.raises(gexc.RetryError, match=f"^looking up BigQuery dataset {sink.dataset}: "):
        patient.land(*rows())
    assert time.monotonic() - started < 10
    warnings = [r.getMessage() for r in caplog.records if r.name == "infra.retries"]
    assert warnings and all(
        w.startswith(f"BigQuery call failed (looking up BigQuery dataset {sink.dataset}): ")
        and w.endswith("retrying (for up to 1 s)")
        for w in warnings
    )
    requests_made = len(faults.seen)
    assert faults.timeouts[:requests_made] == [bigquery_sink.MIN_CALL_S] * requests_made
