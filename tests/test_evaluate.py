"""Evaluation of a trained checkpoint on meshes other than the one that trained it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.workload_runs import WorkloadRun
from workloads.config_file import load_workload_config
from workloads.evaluate import EvaluationStopped, evaluate, main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> WorkloadRun:
    """A finished tiny float32 run (trained on a (2, 2, 2) mesh), checkpoint at step 4."""
    run = WorkloadRun(
        tmp_path_factory.mktemp("eval"),
        "model.dtype=float32",
        "train.steps=4",
        "train.warmup_steps=1",
        # Not a multiple of 2 or 8 devices: the batches must not shrink to fit them.
        "eval.batch_size=5",
        "eval.max_batches=3",
    )
    assert run.run_to_end() == 0
    return run


@pytest.mark.parametrize("devices", [2, 8])
def test_evaluation_on_several_devices_equals_one_device(trained, devices):
    wcfg = load_workload_config(trained.config_path)
    one = evaluate(wcfg, 4)
    many = evaluate(wcfg, 4, jax.devices()[:devices])
    # The same records scored: the config's batch size, not one cut to the device count.
    assert (many.tokens, many.batches) == (one.tokens, one.batches) == (3 * 5 * 32, 3)
    np.testing.assert_allclose(many.loss, one.loss, rtol=1e-5)
    np.testing.assert_allclose(many.bits_per_byte, one.bits_per_byte, rtol=1e-5)


def test_a_step_without_a_checkpoint_is_one_line_naming_the_steps_there(trained, capsys):
    assert main(["--config", trained.config_path, "--step", "3"]) == 1
    err = capsys.readouterr().err
    assert err == f"no committed checkpoint step 3 in {trained.run_dir}/checkpoints (steps: 4)\n"


def test_an_evaluation_told_to_stop_stops_before_its_next_batch(trained):
    asked = []

    def stop() -> bool:  # a stopped sweep's trial: asked before each batch
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(EvaluationStopped, match=r"^stopped after 2 eval batches$"):
        evaluate(load_workload_config(trained.config_path), 4, stop=stop)
