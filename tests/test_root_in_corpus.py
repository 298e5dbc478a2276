"""A storage root inside a source directory: the pipeline's own files are no corpus.

`storage.root: corpus/tpupipe` with `sources: [corpus]` (or, on GCS, a root under the
bucket a source prefix lists) is a natural layout. The run's lock file, written between the
check before provisioning and sharding, was sharded into its dataset as a document, and
every rerun was refused: its compile cache, checkpoints and lock were "added" sources.
Walks, globs and prefixes now leave out what the pipeline writes (`tasks.plan.owned_places`);
a file a source entry names outright is still read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.plan import owned_places, plan_run
from tasks.prepare import check_inputs
from tests.helpers import tiny_config
from workloads import data
from workloads.data import DatasetError


def corpus_with_root(tmp_path: Path) -> tuple[Path, Path]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 60)
    return corpus, corpus / "tp"


def test_walks_and_globs_leave_out_what_the_pipeline_writes_but_not_a_file_named(tmp_path):
    corpus, root = corpus_with_root(tmp_path)
    plan = plan_run(tiny_config(root, f"dataset.sources=[{corpus}]"))
    owned = owned_places(plan)
    # What a run leaves under its root, and the DuckDB file's companions.
    made = [
        "locks/tiny.lock",
        "runs/tiny/events.jsonl",
        "runs/tiny/checkpoints/5/meta/metadata",
        "compile_cache/jit_step-abc-cache",
        "slices/tiny.json",
        "metrics.duckdb",
        "metrics.duckdb.wal",
        "metrics.duckdb.tmp/spill",
    ]
    for name in made:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    # Beside them, a user's own files, named like them: corpus (probe U: a local root's
    # logs/ and `<metrics file>.*` were left out, silently).
    mine = ["tp/notes.txt", "tp/metrics.duckdb.md", "tp/logs/server.log", "runs.txt"]
    for name in mine:
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text("a user's own text")
    corpus_files = sorted([*(f"{i}.txt" for i in range(6)), *mine])

    for entry in (str(corpus), f"{corpus}/**/*", f"{corpus}/**"):
        keys = sorted(f.key for f in data.resolve_sources([entry], owned=owned))
        assert keys == corpus_files, entry
    without = sorted(f.key for f in data.resolve_sources([str(corpus)]))
    assert len(without) == len(corpus_files) + len(made)  # what the run read before

    # Named outright, a file is read; an entry inside a place the pipeline writes is refused,
    # naming the place and the setting that puts it there.
    lock = str(root / "locks" / "tiny.lock")
    assert [f.uri for f in data.resolve_sources([lock], owned=owned)] == [lock]
    with pytest.raises(DatasetError) as err:
        data.resolve_sources([str(root / "runs")], owned=owned)
    said = f"dataset source '{root}/runs' lies in {root}/runs, which the pipeline writes (placed "
    assert str(err.value).startswith(said + "by storage.root)"), err.value
    assert str(err.value).endswith("move the corpus elsewhere, or change storage.root")


def test_a_shared_compile_cache_in_the_corpus_is_no_corpus_with_or_without_its_variable(
    tmp_path, monkeypatch
):
    # probe U: TPUPIPE_COMPILE_CACHE inside the corpus was left out only while it was set;
    # a rerun from a shell without it read the cache's entries as "added" sources, and a
    # source inside it was blamed on storage.root.
    corpus, root = corpus_with_root(tmp_path)
    cache = corpus / "cc"
    cache.mkdir()
    for suffix in ("cache", "atime"):
        (cache / f"jit__identity_fn-{'0a' * 32}-{suffix}").write_bytes(b"\x00\xff binary")
    (cache / ".lockfile").write_text("")
    monkeypatch.setenv("TPUPIPE_COMPILE_CACHE", str(cache))
    config = tiny_config(root, f"dataset.sources=[{corpus}]")
    assert owned_places(plan_run(config))[f"{cache}/"] == "TPUPIPE_COMPILE_CACHE"
    for owned in (owned_places(plan_run(config)), None):
        files = data.resolve_sources([str(corpus)], owned=owned)
        assert sorted(f.key for f in files) == [f"{i}.txt" for i in range(6)]
    # Named outright, the cache is refused as what it is (probe W: "matches no file").
    with pytest.raises(DatasetError, match=r"source '.*/cc' is a JAX compilation cache"):
        data.resolve_sources([str(cache)])
    (cache / "corpus").mkdir()
    (cache / "corpus" / "a.txt").write_text("text kept where the cache is")
    with pytest.raises(DatasetError, match=r"placed by TPUPIPE_COMPILE_CACHE\) .* change TPUPIPE"):
        data.resolve_sources([str(cache / "corpus")], owned=owned_places(plan_run(config)))


def test_a_metrics_path_names_its_own_file_not_others_beginning_alike(tmp_path):
    corpus, root = corpus_with_root(tmp_path)
    for name in ("notes", "notes.txt", "notes.duckdb.bak", "notes.wal"):
        (corpus / name).write_text("the user's")
    config = tiny_config(root, f"dataset.sources=[{corpus}]", f"metrics.path={corpus}/notes")
    owned = owned_places(plan_run(config))
    assert owned[f"{corpus}/notes"] == "metrics.path"
    keys = sorted(f.key for f in data.resolve_sources([str(corpus)], owned=owned))
    assert keys == sorted([*(f"{i}.txt" for i in range(6)), "notes.txt", "notes.duckdb.bak"])


def test_places_name_the_root_the_local_registry_and_the_metrics_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = owned_places(plan_run(tiny_config(tmp_path / "r")))
    assert {f"{tmp_path}/r/{name}/" for name in ("runs", "locks", "slices")} <= set(local)
    assert f"{tmp_path}/r/logs/" not in local  # a local root's logs are in its run directories
    assert local[f"{tmp_path}/r/metrics.duckdb"] == "storage.root"
    gcs = owned_places(plan_run(tiny_config(tmp_path, "storage.root=gs://bkt/tp")))
    assert {"gs://bkt/tp/runs/", "gs://bkt/tp/datasets/", "gs://bkt/tp/locks/"} <= set(gcs)
    assert "gs://bkt/tp/compile_cache/" in gcs
    bigquery = tiny_config(tmp_path, "metrics.sink=bigquery", "metrics.dataset=d")
    assert not any(p.startswith("bigquery:") for p in owned_places(plan_run(bigquery)))


@pytest.mark.integration
def test_a_run_whose_root_is_inside_its_corpus_trains_on_the_corpus_and_resumes(
    tmp_path, prefect_harness
):
    from flows.pipeline import tpu_training_pipeline

    corpus, root = corpus_with_root(tmp_path)
    config = tiny_config(
        root, "run_name=nested", f"dataset.sources=[{corpus}]", "dataset.eval_fraction=0.3"
    )
    assert tpu_training_pipeline(config=config).status == "completed"
    run_config = json.loads((Path(plan_run(config).run_dir) / "config.json").read_text())
    manifest = data.load_manifest(run_config["dataset_dir"])
    assert sorted(s["key"] for s in manifest["sources"]) == [f"{i}.txt" for i in range(6)]
    # Its lock, runs, compile cache and metrics now exist under the corpus: the same six.
    plan, count = check_inputs(config, plan_run(config))
    assert (count, plan.same_records_as) == (6, None)
    assert tpu_training_pipeline(config=config).status == "completed"  # resumed, not refused


def test_a_directory_holding_one_cache_named_file_among_a_users_files_is_corpus(tmp_path):
    # probe W: one name like a cache entry made walks skip the whole directory, silently.
    corpus, _ = corpus_with_root(tmp_path)
    sub = corpus / "sub"
    sub.mkdir()
    (sub / "doc.txt").write_text("a user's document")
    (sub / f"model-{'b' * 64}-cache").write_text("a user's notes, named oddly")
    keys = sorted(f.key for f in data.resolve_sources([str(corpus)]))
    assert keys == sorted(
        [*(f"{i}.txt" for i in range(6)), "sub/doc.txt", f"sub/model-{'b' * 64}-cache"]
    )
