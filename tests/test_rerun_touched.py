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


def test_a_source_edited_to_the_same_size_is_refused_once_sharded(tmp_path):
    corpus, cfg = six_document_run(tmp_path)
    before = trained(cfg)
    text = (corpus / "3.txt").read_text()
    (corpus / "3.txt").write_text("X" + text[1:])  # same size, other bytes
    plan, _ = check_inputs(cfg, plan_run(cfg))
    new = data.shard_dataset(cfg.dataset, plan.datasets_root)
    assert not same_shards(data.load_manifest(before), new.manifest)
    with pytest.raises(ConfigError, match=r"\(changed: .*3\.txt, each of the same size, but"):
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
    (corpus / "2.txt").write_text("document 2 " * 40)
    (corpus / "new.txt").write_text("added")
    assert not times_only(before, cfg.dataset, data.resolve_sources(cfg.dataset.sources))
    (corpus / "new.txt").unlink()
    other = cfg.dataset.model_copy(update={"seq_len": 8})
    assert not times_only(before, other, data.resolve_sources(cfg.dataset.sources))


@pytest.mark.integration
def test_the_pipeline_s_shard_stage_resumes_a_touched_run_over_its_dataset(
    tmp_path, prefect_harness
):
    from prefect import flow

    from tasks.prepare import shard_dataset, validate_config

    corpus, cfg = six_document_run(tmp_path)

    @flow
    def shard_only() -> str:
        return shard_dataset(cfg, validate_config(cfg))

    def dataset_of(config_path: str) -> str:
        return json.loads(Path(config_path).read_text())["dataset_dir"]

    first = dataset_of(shard_only())
    for path in corpus.iterdir():  # a checkout that rewrote every file
        bump_mtime(path)
    assert dataset_of(shard_only()) == first
    (corpus / "4.txt").write_text("Y" + (corpus / "4.txt").read_text()[1:])
    with pytest.raises(ConfigError, match=r"each of the same size, but the shards they give"):
        shard_only()
    assert dataset_of(str(Path(plan_run(cfg).run_dir) / "config.json")) == first
