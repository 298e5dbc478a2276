"""A rerun over sources whose modification times changed, not their content.

The dataset fingerprint covers each source's version (its mtime), so a `touch`, a copy or
a checkout that keeps every byte gives another dataset, and a rerun of a finished run was
refused for good: "resuming or evaluating it again would go on over other data", though
its records were the same. Now such a rerun shards the sources and goes on over the
dataset it trained on when the new shards are its own byte for byte; a file edited without
changing its size is still refused, naming it, before anything is provisioned.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tasks.plan import plan_run, write_workload_config
from tasks.prepare import check_inputs
from tasks.rerun import same_records_result
from tests.helpers import six_document_run
from workloads import data
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError
from workloads.fingerprint import same_shards, times_only


def trained(cfg: PipelineConfig) -> str:
    """Shard the dataset and record it as the run's, as a first run does."""
    plan = plan_run(cfg)
    result = data.shard_dataset(cfg.dataset, plan.datasets_root)
    write_workload_config(cfg, plan, result.dataset_dir)
    return result.dataset_dir


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_touched_source_resumes_over_the_dataset_the_run_trained_on(tmp_path):
    corpus, cfg = six_document_run(tmp_path)
    before = trained(cfg)
    bump_mtime(corpus / "2.txt")
    files = data.resolve_sources(cfg.dataset.sources)
    assert times_only(before, cfg.dataset, files)
    # Deferred, by the run and by `tpupipe validate` alike: only the shards can tell.
    for remote in (True, False):
        plan, _ = check_inputs(cfg, plan_run(cfg), remote=remote)
        assert plan.same_records_as == before
    new = data.shard_dataset(cfg.dataset, plan.datasets_root)
    assert new.dataset_dir != before  # another fingerprint: the mtime is part of it
    assert same_shards(data.load_manifest(before), new.manifest)
    result = same_records_result(plan, new)
    assert (result.dataset_dir, result.cached) == (before, True)
    assert result.manifest == data.load_manifest(before)


def test_the_same_directory_named_through_a_symlink_resumes_over_the_trained_dataset(tmp_path):
    # probe U: the fingerprint covers the paths as given, and the rerun was refused as
    # "other data", every file "added" and "removed".
    corpus, cfg = six_document_run(tmp_path)
    before = trained(cfg)
    (tmp_path / "link").symlink_to(corpus)
    linked = cfg.model_copy(
        update={"dataset": cfg.dataset.model_copy(update={"sources": [str(tmp_path / "link")]})}
    )
    plan, _ = check_inputs(linked, plan_run(linked))
    assert plan.same_records_as == before
    new = data.shard_dataset(linked.dataset, plan.datasets_root)
    assert (same_records_result(plan, new).dataset_dir, new.dataset_dir != before) == (before, True)
    # The link moved to other files of the same names and sizes: other files, refused.
    other = tmp_path / "other"
    other.mkdir()
    for path in corpus.iterdir():
        (other / path.name).write_text(path.read_text().replace("document", "documenX"))
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to(other)
    with pytest.raises(ConfigError, match=r"other data|removed: .*corpus/0\.txt"):
        check_inputs(linked, plan_run(linked))


def test_a_source_edited_to_the_same_size_is_refused_once_sharded(tmp_path):
    corpus, cfg = six_document_run(tmp_path)
    before = trained(cfg)
    text = (corpus / "3.txt").read_text()
    (corpus / "3.txt").write_text("X" + text[1:])  # same size, other bytes
    plan, _ = check_inputs(cfg, plan_run(cfg))
    new = data.shard_dataset(cfg.dataset, plan.datasets_root)
    assert not same_shards(data.load_manifest(before), new.manifest)
    with pytest.raises(
        ConfigError, match=r"\(modified, same size: .*3\.txt: the shards they give are not"
    ):
        same_records_result(plan, new)
    # The dataset it trained on deleted meanwhile: nothing to compare with, refused.
    (Path(before) / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"trained on dataset .*no manifest\.json"):
        same_records_result(plan, new)


def test_other_changes_are_refused_before_anything_is_sharded(tmp_path):
    corpus, cfg = six_document_run(tmp_path)
    before = trained(cfg)
    (corpus / "2.txt").write_text("a shorter document")  # another size
    with pytest.raises(ConfigError, match=r"\(changed: .*2\.txt\)"):
        check_inputs(cfg, plan_run(cfg))
    # A file only touched (or restored) beside it is told apart: it may hold its bytes.
    bump_mtime(corpus / "3.txt")
    both = r"\(changed: .*2\.txt; rewritten, same size \(perhaps the same bytes\): .*3\.txt\)"
    with pytest.raises(ConfigError, match=both):
        check_inputs(cfg, plan_run(cfg))
    (corpus / "2.txt").write_text("document 2 " * 40)
    (corpus / "new.txt").write_text("added")
    assert not times_only(before, cfg.dataset, data.resolve_sources(cfg.dataset.sources))
    (corpus / "new.txt").unlink()
    other = cfg.dataset.model_copy(update={"seq_len": 8})
    assert not times_only(before, other, data.resolve_sources(cfg.dataset.sources))


@pytest.mark.integration
def test_the_pipeline_resumes_a_touched_run_and_refuses_an_edited_one_without_landing(
    tmp_path, prefect_harness, caplog
):
    from flows.pipeline import tpu_training_pipeline
    from infra.metrics import DuckDBSink
    from tests.helpers import tiny_config

    corpus, _ = six_document_run(tmp_path)
    config = tiny_config(
        tmp_path, "run_name=touched", f"dataset.sources=[{corpus}]", "dataset.eval_fraction=0.3"
    )
    run_config = Path(plan_run(config).run_dir) / "config.json"

    def trained_on() -> str:
        return json.loads(run_config.read_text())["dataset_dir"]

    assert tpu_training_pipeline(config=config).status == "completed"
    first = trained_on()
    for path in corpus.iterdir():  # a checkout that rewrote every file
        bump_mtime(path)
    with caplog.at_level(logging.INFO, logger="tasks.rerun"):
        assert tpu_training_pipeline(config=config).status == "completed"  # evaluated again
    assert trained_on() == first
    said = [r for r in caplog.records if "modification times changed" in r.getMessage()]
    assert len(said) == 1  # by the check before provisioning, not again by the shard stage
    (corpus / "4.txt").write_text("Y" + (corpus / "4.txt").read_text()[1:])
    with pytest.raises(ConfigError, match=r"modified, same size: .*: the shards they give"):
        tpu_training_pipeline(config=config)
    # A refusal of its inputs, like the validate stage's: the finished run's row stays.
    row = DuckDBSink(tmp_path / "metrics.duckdb").read_run("touched")
    assert (row.status, row.error) == ("completed", None)
    assert trained_on() == first
