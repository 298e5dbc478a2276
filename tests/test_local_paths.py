"""Local paths a run writes (its storage root, its DuckDB metrics file) are checked before
anything is provisioned: each case here passed `tpupipe validate` and the validate stage,
and the run failed later, at its lock or after the whole training run."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main as cli_main
from infra.metrics import DuckDBSink
from tasks.plan import plan_run
from tasks.prepare import check_inputs, check_local_paths
from tests.helpers import GCP_OVERRIDES, REPO, immutable, tiny_config
from workloads.config_file import ConfigError

TINY = str(REPO / "configs" / "tiny.yaml")


def _database_head(tmp_path: Path, size: int) -> bytes:
    """The first `size` bytes of a real metrics database: what a create that ran out of
    disk after its first header write left (a 4 KB stub whose magic bytes are right)."""
    real = tmp_path / "real.duckdb"
    DuckDBSink(real).ensure_tables()
    return real.read_bytes()[:size]


@pytest.mark.parametrize(
    "content, said",
    [
        (b"", "it is empty (0 bytes), as a create that failed on a full disk leaves it"),
        (b"notes about the runs\n", "it has no 'DUCK' at byte 8, so it is some other file"),
        (4096, "it has 4096 bytes, fewer than DuckDB's 12288-byte headers"),
    ],
    ids=["empty", "text", "4kb-stub"],
)
def test_a_metrics_file_that_is_not_a_duckdb_database_is_refused(tmp_path, content, said):
    """It passed validation, and every run (every sweep trial) trained, evaluated and then
    failed landing: "... exists, but it is not a valid DuckDB database file!"."""
    path = tmp_path / "m.duckdb"
    path.write_bytes(_database_head(tmp_path, content) if isinstance(content, int) else content)
    config = tiny_config(tmp_path / "root", f"metrics.path={path}", "dataset.max_bytes=20000")
    with pytest.raises(ConfigError) as err:
        check_inputs(config, plan_run(config))  # what the validate stage runs, before a slice
    message = str(err.value)
    assert f"metrics.path = {str(path)!r}: {path} is not a usable DuckDB database" in message
    assert said in message


def test_validate_exits_2_for_a_metrics_stub_and_passes_the_database_it_becomes(tmp_path, capsys):
    path = tmp_path / "m.duckdb"
    path.touch()  # DuckDB's first connect on a full disk leaves this
    args = ["validate", "--config", TINY, "--set", f"storage.root={tmp_path / 'root'}"]
    assert cli_main([*args, "--set", f"metrics.path={path}"]) == 2
    assert "0 bytes" in capsys.readouterr().err and path.stat().st_size == 0  # not touched
    path.unlink()
    DuckDBSink(path).ensure_tables()
    assert cli_main([*args, "--set", f"metrics.path={path}"]) == 0


@pytest.mark.parametrize(
    "field, under_link",
    [("storage.root", ""), ("metrics.path", "/m.duckdb"), ("metrics.path", "")],
    ids=["storage-root", "metrics-directory", "metrics-file"],
)
def test_a_path_through_a_symlink_to_a_missing_disk_is_refused(tmp_path, field, under_link):
    """A storage root that is a symlink to an unmounted disk passed validation (the walk up
    to an existing directory went past the link) and the run failed with a bare
    `FileExistsError: File exists`; a metrics.path there failed only when landing."""
    link = tmp_path / "bigdisk"
    target = tmp_path / "mnt" / "bigdisk"  # not mounted: nothing there
    link.symlink_to(target)
    value = f"{link}{under_link}"
    config = tiny_config(tmp_path / "root", f"{field}={value}")
    with pytest.raises(ConfigError) as err:
        check_local_paths(config, plan_run(config))
    message = str(err.value)
    assert message.startswith(f"{field} = {value!r}: ")
    assert f"symlink to {target}, which does not exist: is its disk mounted?" in message


def test_validate_exits_2_for_a_dangling_storage_root(tmp_path, capsys, monkeypatch):
    """/tmp/probe-res/dangling_root.sh: a relative root, as a user types it."""
    monkeypatch.chdir(tmp_path)
    Path("dangling").symlink_to("/nonexistent/bigdisk")
    assert cli_main(["validate", "--config", TINY, "--set", "storage.root=dangling"]) == 2
    err = capsys.readouterr().err
    assert "storage.root = 'dangling'" in err and "symlink to /nonexistent/bigdisk" in err


@pytest.mark.parametrize(
    ("field", "value"), [("storage.root", "/proc/tpupipe"), ("metrics.path", "/proc/m.duckdb")]
)
def test_a_place_that_passes_os_access_but_takes_no_file_is_refused(capsys, field, value):
    # As root, os.access said /proc was writable: validation passed, and the run failed
    # at its lock (storage.root) or after the whole training run (metrics.path).
    assert cli_main(["validate", "--config", TINY, "--set", f"{field}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"{field} = {value!r}" in err and "nothing can be written in /proc" in err


def test_a_metrics_database_and_usable_symlinks_pass(tmp_path):
    """The checks refuse only what would fail: a real database (read by its header, not
    opened, so a run holding it open does not matter) and links to existing places."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "root").symlink_to(disk)
    DuckDBSink(disk / "real.duckdb").ensure_tables()
    (tmp_path / "m.duckdb").symlink_to(disk / "real.duckdb")
    for metrics in (disk / "real.duckdb", tmp_path / "m.duckdb", tmp_path / "new" / "m.duckdb"):
        config = tiny_config(tmp_path / "root", f"metrics.path={metrics}")
        check_local_paths(config, plan_run(config))


def test_local_runs_share_the_compilation_cache_tpupipe_compile_cache_names(
    tmp_path, monkeypatch, capsys
):
    # Set: every local run's workload compiles into that directory, whatever its root.
    shared = tmp_path / "cache"
    monkeypatch.setenv("TPUPIPE_COMPILE_CACHE", str(shared))
    for root in ("a", "b"):
        assert plan_run(tiny_config(tmp_path / root)).compile_cache_dir == str(shared)
    # A Cloud TPU slice's workers cannot read this machine's directory: its root's.
    gcp = tiny_config(tmp_path, *GCP_OVERRIDES)
    assert plan_run(gcp).compile_cache_dir == "gs://bkt/root/compile_cache"
    # Unset: the storage root's own.
    monkeypatch.delenv("TPUPIPE_COMPILE_CACHE")
    assert plan_run(tiny_config(tmp_path)).compile_cache_dir == str(tmp_path / "compile_cache")
    # A file, or a path beneath one, is refused naming the variable, before anything
    # starts: JAX ran without a cache, saying so only in the slice's log.
    shared.write_text("")
    for value in (shared, shared / "sub"):
        monkeypatch.setenv("TPUPIPE_COMPILE_CACHE", str(value))
        assert cli_main(["validate", "--config", TINY, "--set", f"storage.root={tmp_path}"]) == 2
        said = f"TPUPIPE_COMPILE_CACHE = '{value}': {value} cannot be created ({shared} is not"
        assert said in capsys.readouterr().err
    # Deleting slices needs no cache: the reaper's plan of a run is made all the same.
    assert plan_run(tiny_config(tmp_path)).compile_cache_dir == str(shared / "sub")


@pytest.mark.parametrize(
    "root, said",
    [
        ("x" * 300, "is 300 bytes long, over this file system's limit of 255 (NAME_MAX)"),
        ("/".join(["y" * 200] * 19), "bytes longer beneath it (checkpoints): over this system's"),
    ],
    ids=["a-part-over-name-max", "near-path-max"],
)
def test_a_storage_root_too_long_for_what_a_run_writes_is_refused(tmp_path, capsys, root, said):
    # Near PATH_MAX, the root passed validation and the run failed at its first checkpoint
    # save, its slice provisioned and its steps trained; a part over NAME_MAX passed
    # `tpupipe validate` as valid and then ended it with a traceback.
    root = tmp_path / root
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "storage.root = " in err and said in err, err
    assert "…" in err.splitlines()[1]  # the value is shortened, not quoted whole
    assert list(tmp_path.iterdir()) == []  # nothing made
    config = tiny_config(tmp_path / "ok", "dataset.max_bytes=20000")
    check_local_paths(config, plan_run(config))  # a root of an ordinary length passes


@pytest.mark.parametrize(
    "value, said",
    [
        ("~/tpupipe-cc", "starts with ~, which is not expanded here"),
        ("gs://bkt/cc", "is not a directory on this machine: give a directory"),
        ("  ", "TPUPIPE_COMPILE_CACHE is empty: give a directory"),
        ("${CACHE}/cc", "holds ${CACHE}, an environment variable, which is not expanded"),
    ],
    ids=["tilde", "gs", "blank", "variable"],
)
def test_a_tpupipe_compile_cache_storage_root_would_refuse_is_refused(
    tmp_path, monkeypatch, capsys, value, said
):
    # Each became an odd local directory, a cold cache no other run shared: `~/x` was
    # <cwd>/~/x, `gs://bkt/cc` was <cwd>/gs:/bkt/cc, and a blank value <cwd>/"  ".
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TPUPIPE_COMPILE_CACHE", value)
    assert cli_main(["validate", "--config", TINY, "--set", f"storage.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert said in err and (value.strip() == "" or f"TPUPIPE_COMPILE_CACHE {value!r}" in err)
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_tpupipe_run_refuses_a_compile_cache_in_gcs_before_it_starts(
    tmp_path, monkeypatch, capsys, prefect_harness
):
    monkeypatch.setenv("TPUPIPE_COMPILE_CACHE", "gs://bkt/cc")
    args = ["run", "--config", TINY, "--set", f"storage.root={tmp_path}", "--set", "run_name=r"]
    assert cli_main(args) == 2
    assert "TPUPIPE_COMPILE_CACHE 'gs://bkt/cc' is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "r" / "events.jsonl").exists()  # nothing provisioned


@pytest.mark.parametrize(
    "blocker, field, said",
    [
        ("runs", "and run_name = 'tiny'", "runs/tiny cannot be created ({root}/runs is not a"),
        ("runs/tiny", "and run_name = 'tiny'", "runs/tiny is a symlink to /nonexistent/x"),
        ("datasets", "", "datasets cannot be created ({root}/datasets is not a directory)"),
        ("locks", "", "locks cannot be created ({root}/locks is not a directory)"),
        ("slices", "", "slices cannot be created ({root}/slices is not a directory)"),
        ("compile_cache", "", "compile_cache cannot be created ({root}/compile_cache is not"),
    ],
    ids=["runs-a-file", "run-dir-a-dangling-link", "datasets-a-file", "locks", "slices", "cache"],
)
def test_what_is_in_the_way_beneath_the_storage_root_is_refused(
    tmp_path, capsys, monkeypatch, blocker, field, said
):
    # /tmp/s34/probeA/repro_runs_dir_checks.sh, repro_datasets_dir.sh: validate said valid;
    # the run then failed with a NotADirectoryError traceback, or sharded its dataset and
    # failed with a bare "File exists", or failed in its shard stage naming no field.
    monkeypatch.delenv("TPUPIPE_COMPILE_CACHE")  # the root's own cache, not the suite's
    root = tmp_path / "root"
    (root / blocker).parent.mkdir(parents=True)
    if blocker == "runs/tiny":
        (root / blocker).symlink_to("/nonexistent/x")
    else:
        (root / blocker).write_text("")
    before = sorted(root.rglob("*"))
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"storage.root = {str(root)!r}{' ' + field if field else ''}" in err, err
    assert said.format(root=root) in err, err
    assert sorted(root.rglob("*")) == before  # nothing made


def test_a_metrics_file_name_too_long_for_duckdbs_temporary_name_is_refused(tmp_path, capsys):
    # /tmp/s34/probeA/repro_metrics_name_too_long.sh: a 240-byte name passed validation, the
    # run trained, and landing failed with "File name too long" (DuckDB's file is created
    # under <name>.<pid>-<hex>.creating); a 300-byte one likewise.
    for name in ("m" * 233 + ".duckdb", "m" * 300):
        metrics = tmp_path / name
        args = ["validate", "--config", TINY, "--set", f"storage.root={tmp_path / 'root'}"]
        assert cli_main([*args, "--set", f"metrics.path={metrics}"]) == 2
        err = capsys.readouterr().err
        assert "metrics.path = " in err and "the DuckDB file's name" in err, err
        assert "over this file system's limit of 255 (NAME_MAX)" in err
    ok = tmp_path / ("m" * 200 + ".duckdb")
    config = tiny_config(tmp_path / "root", f"metrics.path={ok}")
    check_local_paths(config, plan_run(config))  # room for the temporary name: passes
    DuckDBSink(ok).ensure_tables()  # and DuckDB does create it


def test_a_dataset_cache_that_cannot_be_made_is_refused_for_a_gcs_root(tmp_path, monkeypatch):
    # A run with its storage root in GCS shards into the local dataset cache first.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", str(tmp_path / "file" / "cache"))
    config = tiny_config(tmp_path, *GCP_OVERRIDES, "storage.root=gs://bkt/root")
    with pytest.raises(ConfigError) as err:
        check_local_paths(config, plan_run(config))
    assert str(err.value).startswith(f"TPUPIPE_DATASET_CACHE = '{tmp_path}/file/cache': ")
    assert f"({tmp_path}/file is not a directory)" in str(err.value)


def test_places_a_run_only_reads_and_names_of_existing_files_are_not_refused(
    tmp_path, capsys, monkeypatch
):
    # /tmp/s34/probeC: a read-only datasets/ holding the complete dataset is read, never
    # written; an existing metrics file is never created under the longer temporary name.
    root = tmp_path / "root"
    (root / "datasets").mkdir(parents=True)
    metrics = root / ("m" * 239)
    import duckdb

    duckdb.connect(str(metrics)).close()  # made in place, by DuckDB itself
    args = ["validate", "--config", TINY, "--set", f"storage.root={root}"]
    with immutable(root / "datasets"):
        assert cli_main([*args, "--set", f"metrics.path={metrics}"]) == 0, capsys.readouterr()


def test_relative_cache_places_of_a_gcs_root_are_checked_and_named(tmp_path, monkeypatch):
    # /tmp/s34/probeC/repro_relative_cache_hang.sh: validate spun forever on a relative
    # TPUPIPE_DATASET_CACHE or XDG_CACHE_HOME (dirname('') is '').
    import signal

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TPUPIPE_DATASET_CACHE", "relcache/ds")
    monkeypatch.setenv("XDG_CACHE_HOME", "relxdg")
    config = tiny_config(tmp_path, *GCP_OVERRIDES, "storage.root=gs://bkt/root")
    signal.alarm(60)
    try:
        check_local_paths(config, plan_run(config))
        Path("xdgfile").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", "xdgfile")
        with pytest.raises(ConfigError) as err:
            check_local_paths(config, plan_run(config))
    finally:
        signal.alarm(0)
    assert str(err.value).startswith("XDG_CACHE_HOME = 'xdgfile': ")
    assert f"({tmp_path}/xdgfile is not a directory)" in str(err.value)


@pytest.mark.parametrize(
    "value, said",
    [
        ("gs://bucket/m.duckdb", "is not a file on this machine: DuckDB metrics are a local file"),
        ("~/m.duckdb", "starts with ~, which is not expanded here"),
        ("", "metrics.path is empty: give a DuckDB file's path, or leave it out"),
        ("$HOME/m.duckdb", "holds $HOME, an environment variable, which is not expanded"),
    ],
    ids=["gs", "tilde", "empty", "variable"],
)
def test_a_metrics_path_that_is_no_local_file_is_refused(tmp_path, value, said):
    # Each landed somewhere else, silently: ./gs:/bucket/m.duckdb, ./~/m.duckdb, and the
    # default file for '' (an unset variable), where storage.root refuses all three.
    from workloads.config_file import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"metrics: {{path: '{value}'}}\nstorage: {{root: {tmp_path}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "c.yaml:1: metrics.path" in str(err.value) and said in str(err.value)


def test_a_write_ahead_log_left_without_its_database_is_refused(tmp_path):
    # Left by a damaged database moved away without it: DuckDB replayed it into the new
    # file at the landing's first connect and failed, "WAL does not match database file",
    # after the whole training run.
    path = tmp_path / "m.duckdb"
    config = tiny_config(tmp_path / "root", f"metrics.path={path}", "dataset.max_bytes=20000")
    (tmp_path / "m.duckdb.wal").write_bytes(b"a log of another database")
    with pytest.raises(ConfigError) as err:
        check_local_paths(config, plan_run(config))
    assert f"{path} does not exist, but its write-ahead log {path}.wal does" in str(err.value)
    (tmp_path / "m.duckdb.wal").unlink()
    check_local_paths(config, plan_run(config))


def test_a_slices_registry_shared_with_another_root_is_refused(tmp_path, capsys):
    # root-b/slices a symlink to root-a's: each root took the other's live copy of a run
    # name for its own and deleted it, and both runs failed (probe Q, session 39). A whole
    # root that is a symlink stays fine: it is the other root, its lock shared too.
    (tmp_path / "root-a" / "slices").mkdir(parents=True)
    (tmp_path / "root-b").mkdir()
    (tmp_path / "root-b" / "slices").symlink_to(tmp_path / "root-a" / "slices")
    (tmp_path / "root-c").symlink_to(tmp_path / "root-a")
    base = ["validate", "--config", TINY, "--set"]
    assert cli_main([*base, f"storage.root={tmp_path / 'root-b'}"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'root-b' / 'slices'} is a symlink to {tmp_path / 'root-a' / 'slices'}" in err
    )
    assert cli_main([*base, f"storage.root={tmp_path / 'root-c'}"]) == 0
