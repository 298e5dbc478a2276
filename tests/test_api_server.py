"""The run's temporary Prefect API server: a failure to start says where its database is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO

START = "from flows.api_server import temporary_api\nwith temporary_api(60):\n    pass\n"


def test_a_prefect_home_that_cannot_be_written_is_named_when_the_server_fails(tmp_path):
    # With an unwritable HOME and no PREFECT_HOME, the run failed with SQLite's "unable to
    # open database file" and no word of which directory, nor of PREFECT_HOME.
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "prefect"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("RuntimeError: ")]
    assert said.startswith("RuntimeError: the temporary Prefect API server"), done.stderr[-3000:]
    assert f"its database is under PREFECT_HOME = {home}: set PREFECT_HOME" in said
