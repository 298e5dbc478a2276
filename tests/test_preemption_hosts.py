"""Two hosts, a resumed attempt: a SIGTERM after a checkpoint save stops both hosts at the
next step, whatever step numbers the checkpoint manager saw."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from infra.slices.procs import free_port
from tests.helpers import REPO

HOST = REPO / "tests" / "preemption_host.py"


@pytest.mark.parametrize("keep", [3, 1])  # both kinds of manager (ckpt_manager)
def test_a_notice_after_a_save_stops_both_hosts_at_the_next_step(tmp_path, keep):
    port, go = free_port(), tmp_path / "go"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    hosts = [
        subprocess.Popen(
            [sys.executable, str(HOST), str(i), str(port), str(tmp_path / "run"), str(keep), go],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    # The hosts ignore SIGTERM (JAX's preemption service takes it): a hung host is killed.
    watchdog = threading.Timer(180, lambda: [host.kill() for host in hosts])
    watchdog.start()
    try:
        for host in hosts:  # past gloo's own lines on stdout
            lines = (line.strip() for line in iter(host.stdout.readline, ""))
            assert "saved" in lines, host.wait(timeout=60)
        for host in hosts:  # the preemption notice, to every host as on a real slice
            host.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # JAX's preemption service agrees on the step meanwhile
        go.touch()
        lines = [host.communicate(timeout=60)[0].strip().splitlines()[-1] for host in hosts]
    finally:
        watchdog.cancel()
        for host in hosts:
            host.kill()
    # One past the furthest host's step: step 16, right after the notice (it was 14 + 16
    # when the manager's own calls with global steps mixed into the count).
    assert lines == ["stop at step 16", "stop at step 16"]
