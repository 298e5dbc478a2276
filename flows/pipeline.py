"""The training pipeline flow: it only wires the stages together and guarantees teardown.

Teardown has three layers: the `finally` below (and in every training attempt), the
flow's cancellation and crash hooks (they delete every slice labelled with this flow run),
and the `reap-orphans` flow (flows/reaper.py) for an orchestrator that died outright.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow, runtime

# A worker loads this file by its path (prefect.yaml's entrypoint), which imports
# no package; the flows package's set-up sends the project's module logs to the run and
# logs refusals in one line, as `tpupipe run` does.
from flows import form_parameter
from infra.metrics import RunRow
from tasks.checks import evaluate_checkpoint, finished_training, verify_checkpoint
from tasks.landing import land_failure, land_metrics, publish_summary
from tasks.prepare import check_same_records, shard_dataset, validate_config
from tasks.run_lock import run_held
from tasks.teardown import delete_flow_run_slices
from tasks.training import slice_torn_down, train_with_retries
from workloads.config import PipelineConfig

# The default config, as the UI's run form shows it (`flows.form_parameter`).
DEFAULT_CONFIG = form_parameter(PipelineConfig())


@flow(
    name="tpu-training-pipeline",
    log_prints=True,
    on_cancellation=[delete_flow_run_slices],
    on_crashed=[delete_flow_run_slices],
)
def tpu_training_pipeline(config: PipelineConfig = DEFAULT_CONFIG) -> RunRow:
    """Shard → provision → train (re-provisioning after preemptions) → verify → evaluate →
    land, tearing the slice down whatever fails; a run whose training finished in an
    earlier invocation skips to evaluate. A failed run still lands a `runs` row, one
    stopped by Ctrl-C or SIGTERM too, during the landing or the summary included: the row
    says failed whenever the run does, and keeps the results landed before."""
    started = datetime.now(UTC)
    plan = validate_config(config, str(runtime.flow_run.id or "") or None)
    with run_held(plan, config):  # RunInUse if another orchestrator runs it: nothing spent, no row
        check_same_records(config, plan)  # sources touched since: refused like validate's
        verified = result = None
        try:
            config_path = shard_dataset(config, plan)
            verified = finished_training(config, plan)  # a rerun of a finished run
            # Torn down after a finished run too: a killed orchestrator may have left one.
            with slice_torn_down(config, plan):
                if verified is None:
                    train_with_retries(config)(config, plan, config_path)
            verified = verified or verify_checkpoint(config, plan)
            result = evaluate_checkpoint(plan, verified.step)
            # Inside the try: a signal while landing waits for the metrics file, or after
            # the completed row landed, must still leave a failed row, as the exit says.
            run = land_metrics(config, plan, started, verified, result)
            publish_summary(config, plan, run)
        except BaseException as exc:  # Ctrl-C and SIGTERM too: a crashed run keeps its row
            land_failure(config, plan, started, verified, result, exc)
            raise
        return run
