"""The shard task inside a real flow run: the dataset, and its Prefect progress artifact."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.helpers import tiny_config
from workloads import data

pytestmark = pytest.mark.integration


def test_shard_task_writes_the_dataset_and_fills_a_progress_artifact(tmp_path, prefect_harness):
    from prefect import flow, runtime
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from tasks.prepare import shard_dataset, validate_config

    config = tiny_config(tmp_path, "run_name=shard-task")

    @flow
    def shard_only() -> tuple[str, str]:
        plan = validate_config(config)
        return shard_dataset(config, plan), str(runtime.flow_run.id)

    config_path, flow_run_id = shard_only()
    dataset_dir = json.loads(Path(config_path).read_text())["dataset_dir"]
    data.verify_shards(dataset_dir)

    async def artifacts():
        async with get_client() as client:
            run = ArtifactFilterFlowRunId(any_=[flow_run_id])
            return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=run))

    (artifact,) = [a for a in asyncio.run(artifacts()) if a.type == "progress"]
    assert artifact.data == 100.0 and "shard-task" in artifact.description
