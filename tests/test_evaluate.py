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
    """A finished tiny float32 run (trained on a (2, 2, 2) mesh), checkpoint at step 4,
    not evaluated yet (no eval.json)."""
    run = WorkloadRun(
        tmp_path_factory.mktemp("eval"),
        "model.dtype=float32",
        # Wide enough for the MLP kernel's bytes to be stored as they are (bit rot test).
        "model.d_model=128",
        "model.d_ff=512",
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


def _copy_of(trained, tmp_path, **changes) -> str:
    """A copy of the trained run's directory, its config.json pointing at the copy (and
    changed as given); returns the config path."""
    import json
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained.run_dir, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config.update(run_dir=str(run_dir), **changes)
    (run_dir / "config.json").write_text(json.dumps(config))
    return str(run_dir / "config.json")


def test_the_cli_refuses_a_checkpoint_whose_parameters_changed_in_one_line(
    trained, tmp_path, capsys
):
    # Bit rot in a parameter: the pipeline's verification refused the step, and this
    # command printed (and wrote to eval.json) the loss of the altered model.
    from tests.test_checkpoint import flip_low_bit
    from workloads import checkpoint

    config_path = _copy_of(trained, tmp_path)
    state, _ = checkpoint.restore_on_host(str(trained.run_dir), 4)
    needle = np.asarray(state["model"]["blocks"]["0"]["up"]["kernel"]).reshape(-1)[:4].astype("<f4")
    flip_low_bit(tmp_path / "run" / "checkpoints" / "4" / "state", needle.tobytes())

    assert main(["--config", config_path]) == 1
    err = capsys.readouterr().err
    assert "up/kernel does not match the checksum saved with it" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "eval.json").exists()
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()  # nothing quarantined here


def test_the_command_on_a_step_that_does_not_restore_says_one_line_and_nothing_after(
    trained, tmp_path
):
    # It said its line, then 2-5 "RuntimeError: Event loop is closed" tracebacks of
    # TensorStore reads still in flight (13-31 lines in all).
    import os
    import subprocess
    import sys
    from pathlib import Path

    config_path = _copy_of(trained, tmp_path)
    data = max((tmp_path / "run" / "checkpoints" / "4" / "state" / "d").iterdir(),
               key=lambda p: p.stat().st_size)  # fmt: skip
    damaged = bytearray(data.read_bytes())
    for i in range(len(damaged) - 3000, len(damaged) - 2984):
        damaged[i] ^= 0x55
    data.write_bytes(bytes(damaged))
    out = subprocess.run(
        [sys.executable, "-m", "workloads.evaluate", "--config", config_path],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and "does not restore" in out.stderr, out.stderr


def test_the_cli_names_a_dataset_that_is_gone_in_one_line(trained, tmp_path, capsys):
    config_path = _copy_of(trained, tmp_path, dataset_dir=str(tmp_path / "gone"))
    assert main(["--config", config_path]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "gone") in err and len(err.splitlines()) == 1


def test_the_cli_leaves_a_newer_step_s_evaluation_in_eval_json(trained, tmp_path, capsys):
    import json

    config_path = _copy_of(trained, tmp_path)
    eval_json = tmp_path / "run" / "eval.json"
    newer = {"step": 9, "loss": 1.0, "bits_per_byte": 1.0, "tokens": 32, "batches": 1}
    eval_json.write_text(json.dumps(newer))
    assert main(["--config", config_path, "--step", "4"]) == 0
    assert json.loads(eval_json.read_text()) == newer
    assert "eval.json left as it is: it holds the newer step 9" in capsys.readouterr().err
    eval_json.unlink()  # none yet: this evaluation is the run's
    assert main(["--config", config_path]) == 0
    assert json.loads(eval_json.read_text())["step"] == 4


def test_the_cli_on_a_run_directory_it_cannot_write_prints_the_figures_and_one_line(
    trained, tmp_path, capsys
):
    # A teammate's run, read-only for this user: the figures were printed after a
    # PermissionError traceback (/tmp/s34/probeB/repros/r7_workload_alone_readonly.sh).
    from tests.helpers import immutable

    config_path = _copy_of(trained, tmp_path)
    with immutable(tmp_path / "run"):
        assert main(["--config", config_path]) == 1
    out, err = capsys.readouterr()
    assert "bits_per_byte" in out
    assert (
        err.startswith("eval.json not written (its figures are above): ") and "Traceback" not in err
    )
    assert len(err.splitlines()) == 1 and not (tmp_path / "run" / "eval.json").exists()


def test_only_the_late_closed_loop_errors_are_dropped(capsys):
    import logging
    import sys
    from types import SimpleNamespace

    from workloads.closed_loop_noise import drop_closed_loop_noise

    async def _read_array_index_and_device_put():  # orbax's read of one array
        pass

    async def other_coroutine():
        pass

    seen = []
    before, level = sys.unraisablehook, logging.getLogger("absl").level
    sys.unraisablehook = seen.append
    try:
        drop_closed_loop_noise()
        drop_closed_loop_noise()  # installed once: one hook over `seen`, not two
        assert sys.unraisablehook.__closure__[0].cell_contents == seen.append
        for error in (RuntimeError("Event loop is closed"), RuntimeError("other"), OSError("x")):
            sys.unraisablehook(SimpleNamespace(exc_value=error, object=None))
        for coroutine in (_read_array_index_and_device_put(), other_coroutine()):
            sys.unraisablehook(SimpleNamespace(exc_value=Exception("read"), object=coroutine))
            coroutine.close()
        # Orbax's WARNING and ERROR lines about a damaged step (or another step's metadata)
        # came before and after the command's one line.
        assert not logging.getLogger("absl").isEnabledFor(logging.ERROR)
    finally:
        sys.unraisablehook = before
        logging.getLogger("absl").setLevel(level)
    assert [str(u.exc_value) for u in seen] == ["other", "x", "read"]
    assert seen[-1].object.cr_code.co_name == "other_coroutine"
