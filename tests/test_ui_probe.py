"""Faults an acceptance probe of the user interface found: inputs that validated but then
did something else than the user meant, or ended in a traceback instead of a named error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tasks.plan import plan_run
from tests.helpers import REPO, tiny_config
from workloads.config_file import ConfigError, load_config


def test_long_run_names_never_share_a_slice_name(tmp_path):
    """A slice name is `tpupipe-<run>` cut to 63 characters: two run names alike in their
    first 55 characters got the same slice, and each attempt deletes a slice of its name
    before it creates one, so one run deleted the other's live slice (a sweep of 100+
    trials under a 51-character name: t100..t109 all had one slice name)."""
    sweep = "s" * 51
    names = [f"{sweep}-t{i:02d}" for i in range(98, 112)] + ["a" * 62 + "1", "a" * 62 + "2"]
    slices = [plan_run(tiny_config(tmp_path, f"run_name={n}")).slice_name for n in names]
    assert len(set(slices)) == len(names), slices
    assert all(len(s) <= 63 and s[-1] != "-" for s in slices)
    # A name that fits keeps its readable slice name, as before.
    assert plan_run(tiny_config(tmp_path, "run_name=tiny")).slice_name == "tpupipe-tiny"
    assert plan_run(tiny_config(tmp_path, f"run_name={sweep}-t07")).slice_name == (
        f"tpupipe-{sweep}-t07"
    )


@pytest.mark.parametrize(
    ("root", "said"),
    [
        ("s3://bucket/x", "s3://"),
        ("file:///data/x", "file://"),
        ("~/tpupipe", "~"),
        ("''", "empty"),
        ("'  '", "empty"),
        ("' /data/x'", "begins or ends with whitespace"),  # ./ /data/x, silently
        ("'/data/x '", "begins or ends with whitespace"),
        ("gs:/bucket/x", "local directory named 'gs:'"),  # one slash missing
        ("gs://Bad_Bucket!/x", "is not a bucket name"),  # a traceback from the client
        ("gs://bucket//x", "an empty, '.' or '..' part"),  # objects named "/x/..."
    ],
)
def test_a_storage_root_that_would_become_an_odd_local_directory_is_refused(tmp_path, root, said):
    """`s3://b/x` was taken as the local directory `./s3:/b/x`, `~/x` as `./~/x` and an
    empty root as the working directory: a run wrote its checkpoints there silently."""
    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, f"storage.root={root}")
    assert "storage.root" in str(err.value) and said in str(err.value)


@pytest.mark.parametrize(
    ("source", "said"),
    [("http://host/corpus", "http://"), ("s3://bucket/c", "s3://"), ("gs://", "no bucket")],
)
def test_a_source_no_run_could_read_fails_validation(tmp_path, source, said):
    """`tpupipe validate` said such a config was valid (remote sources are not listed
    there), and the run then refused it."""
    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, f"dataset.sources=[{source!r}]")
    assert source in str(err.value) and said in str(err.value)
    # gs:// and file:// sources stay accepted.
    for fine in ("gs://bucket/corpus/", "file:///tmp/corpus"):
        assert tiny_config(tmp_path, f"dataset.sources=[{fine!r}]").dataset.sources == [fine]


def test_validate_exits_2_for_a_source_scheme_the_run_cannot_read(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "validate",
            "--config",
            "configs/tiny.yaml",
            "--set",
            "dataset.sources=[http://host/corpus]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--set" in out.stderr and "http://" in out.stderr


def test_validate_lists_file_uri_sources_as_local_ones(tmp_path, capsys):
    # A missing file:// source was called valid ("1 remote source(s) checked when the run
    # starts"): file:// is this machine's (probe Z, session 39).
    from flows.cli import main as cli_main

    (tmp_path / "a.txt").write_text("a document")
    base = ["validate", "--config", str(REPO / "configs/tiny.yaml"), "--set"]
    root = f"storage.root={tmp_path / 'root'}"
    missing = f"dataset.sources=['file://{tmp_path}/missing.txt']"
    assert cli_main([*base, missing, "--set", root]) == 2
    assert f"dataset source 'file://{tmp_path}/missing.txt' matches no file" in (
        capsys.readouterr().err
    )
    there = f"dataset.sources=['file://{tmp_path}/a.txt']"
    assert cli_main([*base, there, "--set", root]) == 0
    assert "sources: 1 local file(s)\n" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["' /m.duckdb'", "'m.duckdb '", "'m.duckdb\t'"])
def test_a_metrics_path_with_whitespace_around_it_is_refused(tmp_path, value):
    # ' /x/m.duckdb' landed the run's rows in ./ /x/m.duckdb (probe P, session 39).
    with pytest.raises(ConfigError, match=r"metrics\.path .* begins or ends with whitespace"):
        tiny_config(tmp_path, f"metrics.path={value}")


def test_load_config_still_reads_the_shipped_configs():
    for name in ("tiny", "demo", "v5e-8-spot"):
        load_config(REPO / "configs" / f"{name}.yaml")


def _tpupipe(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


def _recorded_run(root, name: str = "probe") -> None:
    """A run directory with one completed attempt and the config.json of configs/tiny.yaml."""
    import json

    from tasks.plan import plan_run, write_workload_config
    from tests.helpers import attempt_events

    config = tiny_config(root, f"run_name={name}")
    plan = plan_run(config)
    write_workload_config(config, plan, str(root / "datasets" / "x"))
    events = "".join(json.dumps(e) + "\n" for e in attempt_events(1, 0, 0, 12, "completed"))
    (root / "runs" / name / "events.jsonl").write_text(events)


@pytest.mark.parametrize("out", ["missing-dir/r.png", "."])
def test_report_out_that_cannot_be_written_is_named_not_a_traceback(tmp_path, out):
    """`--out` in a directory that does not exist, or naming a directory, ended the
    report in a FileNotFoundError / IsADirectoryError traceback."""
    _recorded_run(tmp_path)
    done = _tpupipe("report", "probe", "--root", str(tmp_path), "--out", out, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"tpupipe report: cannot write the plot to {out}" in done.stderr
    assert "attempts 1" in done.stdout  # the timeline itself was still printed


def test_report_of_a_run_whose_config_json_this_version_cannot_read(tmp_path):
    """A config.json from another version (a field since renamed) or truncated by hand
    ended the report in a pydantic traceback; the timeline needs only events.jsonl."""
    _recorded_run(tmp_path)
    config_json = tmp_path / "runs" / "probe" / "config.json"
    config_json.write_text(config_json.read_text().replace('"seed"', '"old_seed"'))
    done = _tpupipe("report", "probe", "--root", str(tmp_path), "--no-png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "attempts 1" in done.stdout
    assert "not priced:" in done.stdout and "config.json" in done.stdout
    assert "old_seed" in done.stdout


def test_an_unknown_key_names_the_field_it_is_probably_a_typo_of(tmp_path):
    """`trian:` or `learning_rte:` were refused as 'Extra inputs are not permitted' with
    no hint of the field meant; a far-off key gets no guess."""
    path = tmp_path / "typo.yaml"
    path.write_text("run_name: x\ntrian:\n  steps: 5\ntrain:\n  learning_rte: 0.1\n  zzz: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["slice.chaos.time=1"])
    lines = str(err.value).splitlines()
    assert f"{path}:2: trian: Extra inputs are not permitted (did you mean 'train'?)" in lines
    assert any(":5: train.learning_rte:" in x and "'learning_rate'?" in x for x in lines)
    assert any(":6: train.zzz:" in x and "did you mean" not in x for x in lines)
    assert any(x.startswith("--set: slice.chaos.time:") and "'times'?" in x for x in lines)


def test_every_deployments_parameters_validate_as_a_run_of_it_would():
    """What a deployment's runs start from (its `parameters` in prefect.yaml over the flow's
    defaults) passes the server's schema check (enforce_parameter_schema) and the flow's
    own validation, cross-field checks included, so a schedule never fires a run that
    fails on its parameters. No test loaded them before."""
    import importlib

    import yaml
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
        params = deployment.get("parameters") or {}
        schema = parameter_schema(flow).model_dump_for_openapi()
        validate(params, schema, raise_on_error=True, ignore_required=True)
        flow.validate_parameters(params)


@pytest.mark.parametrize("field", ["storage.root", "metrics.path"])
def test_a_local_path_that_cannot_be_created_is_refused_before_anything_runs(tmp_path, field):
    """A storage root below a regular file failed the run only at its lock (exit 1), and a
    metrics.path that is a directory only when landing, after the whole training run."""
    from tasks.plan import plan_run
    from tasks.prepare import check_inputs

    (tmp_path / "afile").write_text("x")
    bad = {"storage.root": tmp_path / "afile" / "store", "metrics.path": tmp_path}[field]
    config = tiny_config(tmp_path / "ok", f"{field}={bad}", "dataset.max_bytes=20000")
    with pytest.raises(ConfigError) as err:
        check_inputs(config, plan_run(config))
    assert f"{field} = {str(bad)!r}" in str(err.value)
    done = _tpupipe(
        "validate", "--config", str(REPO / "configs/tiny.yaml"), "--set", f"{field}={bad}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and field in done.stderr, done.stderr


def test_long_run_names_get_summary_artifacts_of_their_own():
    """The run summary's artifact key was `run-<name>` cut to 64 characters, so runs whose
    names share their first 60 showed up as versions of one artifact in the UI."""
    from tasks.landing import summary_key

    names = ["a" * 62 + "1", "a" * 62 + "2", "b" * 63]
    assert len({summary_key(n) for n in names}) == 3
    assert summary_key("tiny") == "run-tiny"


@pytest.mark.parametrize("run_id", ["..", "."])
def test_report_of_a_dot_run_id_is_not_a_run(tmp_path, run_id):
    """`tpupipe report ..` reported the storage root itself as a run (exit 0, 'no
    attempts recorded yet')."""
    from tasks.report import RunNotFound, find_run_dir

    _recorded_run(tmp_path)
    with pytest.raises(RunNotFound, match="runs there: probe"):
        find_run_dir(str(tmp_path), run_id)


def test_a_runs_config_json_given_as_the_config_says_what_it_is(tmp_path):
    """`tpupipe run --config .tpupipe/runs/x/config.json` gave six 'Extra inputs' lines,
    one with a misleading guess (dataset_dir: did you mean 'dataset'?)."""
    _recorded_run(tmp_path)
    path = tmp_path / "runs" / "probe" / "config.json"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: a run's config.json")
    assert "'pipeline' section" in str(err.value) and "did you mean" not in str(err.value)


def test_report_says_when_the_storage_cannot_be_read_not_that_no_run_is_there(monkeypatch):
    """Without credentials or network, `tpupipe report v5e-small --config <gs:// root>`
    said "no run 'v5e-small' ... (no runs there)": a missing run, where the bucket had not
    been read at all (gcsfs's is_dir answers False on any error)."""
    from tasks import report

    class Unreadable(type(report.epath.Path("/"))):
        def is_dir(self):
            return False

        def iterdir(self):
            raise PermissionError("Anonymous caller does not have storage.objects.list access")

    monkeypatch.setattr(report.epath, "Path", Unreadable)
    with pytest.raises(report.RunNotFound) as err:
        report.find_run_dir("gs://bucket/tpupipe", "v5e-small")
    assert "cannot read gs://bucket/tpupipe/runs" in str(err.value)
    assert "storage.objects.list" in str(err.value) and "no runs there" not in str(err.value)
