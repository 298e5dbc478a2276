"""The command's output streams: a reader that goes away, or a stream closed from the start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_a_reader_of_stderr_that_goes_away_ends_the_output_not_the_command(tmp_path):
    # Prefect logs through rich, which exits (SystemExit(1)) on a broken pipe: `tpupipe
    # run ... 2>&1 | grep -m1 compiling` failed the training run at its next log line.
    # And validate's refusal to a closed stderr exited 1, not 2.
    from rich.console import Console

    from flows.cli_options import readers_may_leave

    read, write = os.pipe()
    os.close(read)
    console = Console(file=os.fdopen(write, "w"))
    with readers_may_leave():
        console.print("a log line " * 1000)  # SystemExit(1) before
        print("a message", file=sys.stderr)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: x\n")
    child = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "validate", "--config", str(bad)],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
    )
    child.stderr.close()  # gone before the refusal is written
    assert child.wait(timeout=120) == 2


@pytest.mark.parametrize(
    ("closed", "config", "code"),
    [(">&-", "tiny.yaml", 0), ("<&- >&- 2>&-", "tiny.yaml", 0), (">&-", "bad.yaml", 2)],
    ids=["stdout", "all-three", "stdout-refusal"],
)
def test_a_stream_closed_from_the_start_changes_nothing_but_the_output(
    tmp_path, closed, config, code
):
    # Python sets sys.stdout to None when fd 1 is closed (`tpupipe run ... >&-`): the
    # first print ended the command with a traceback and exit 120, after a run that had
    # completed and landed.
    (tmp_path / "bad.yaml").write_text("train:\n  steps: x\n")
    path = REPO / "configs" / config if config == "tiny.yaml" else tmp_path / config
    command = f'exec "{sys.executable}" -m flows.cli validate --config "{path}" {closed}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-c", command], env=env, timeout=120, capture_output=True)
    assert done.returncode == code, done.stderr.decode()[-2000:]
