"""One orchestrator per `gs://` run across machines: the lock object in the bucket
(`infra.gcp.gcs_lease`, held by `tasks.run_lock`), against the GCS emulator.

Before it, a second machine running a `gs://` run that was being run elsewhere deleted the
first one's live slice as it provisioned its own (both use the run's slice name)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from infra.gcp.gcs_lease import GcsLease, LeaseHeld
from tests.helpers import REPO

pytestmark = pytest.mark.emulator


def owner(host: str, pid: int) -> dict:
    return {"pid": pid, "host": host, "flow_run_id": None, "since": "earlier"}


def test_a_renewed_lock_refuses_another_machine_until_it_is_released(gcs_client, bucket):
    uri = f"gs://{bucket}/root/locks/r.lock"
    first = GcsLease(gcs_client, uri, owner("machine-a", 11), ttl_s=2.0, renew_every_s=0.2)
    first.acquire()
    try:
        time.sleep(3.0)  # longer than the TTL: only the renewals keep it live
        second = GcsLease(gcs_client, uri, owner("machine-b", 22), ttl_s=2.0)
        with pytest.raises(LeaseHeld, match=r"held by pid 11 on machine-a since earlier") as held:
            second.acquire()
        assert held.value.age_s < 2.0
    finally:
        first.release()
    assert gcs_client.bucket(bucket).get_blob("root/locks/r.lock") is None
    second.acquire()  # free once released
    second.release()


def test_a_stale_lock_is_taken_over_and_its_old_holder_lets_go(gcs_client, bucket, caplog):
    uri = f"gs://{bucket}/root/locks/r.lock"
    cut_off = GcsLease(gcs_client, uri, owner("machine-a", 11), ttl_s=60, renew_every_s=0.3)
    cut_off.acquire()
    # Seen from a machine whose clock is past the TTL, as after a minute of no renewal.
    taker = GcsLease(
        gcs_client, uri, owner("machine-b", 22), ttl_s=60, clock=lambda: time.time() + 61
    )
    with caplog.at_level(logging.WARNING, logger="infra.gcp.gcs_lease"):
        taker.acquire()
        time.sleep(1.0)  # the old holder's next renewal finds the lock replaced
        cut_off.release()
    try:
        assert cut_off.lost
        assert "lost the lock" in caplog.text and "machine-b" in caplog.text
        assert "took over the lock" in caplog.text and "stale for 61 s" in caplog.text
        # The old holder neither wrote over the new one's lock nor deleted it.
        record = json.loads(gcs_client.bucket(bucket).blob("root/locks/r.lock").download_as_bytes())
        assert record["host"] == "machine-b"
    finally:
        taker.release()


def gone_pid() -> int:
    """The pid of a process of this machine that has exited."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_a_holder_gone_from_this_host_is_replaced_at_once(gcs_client, bucket):
    uri = f"gs://{bucket}/root/locks/r.lock"
    blob = gcs_client.bucket(bucket).blob("root/locks/r.lock")
    gone = gone_pid()
    blob.upload_from_string(json.dumps(GcsLease.record(owner(socket.gethostname(), gone))))
    rerun = GcsLease(gcs_client, uri, owner("here", 33))
    rerun.acquire()  # no wait for the TTL: a killed orchestrator's rerun goes on at once
    rerun.release()

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        blob.upload_from_string(json.dumps(GcsLease.record(owner(socket.gethostname(), alive.pid))))
        with pytest.raises(LeaseHeld, match=f"pid {alive.pid} on {socket.gethostname()}"):
            GcsLease(gcs_client, uri, owner("here", 33)).acquire()
    finally:
        alive.kill()
        alive.wait()


def test_a_live_holder_on_another_machine_of_this_hostname_is_not_taken_over(gcs_client, bucket):
    # Containers given one --hostname, VMs cloned from one image: the holder's pid is no
    # process here, and its lock, renewed a moment ago, was taken over at once; two
    # orchestrators then ran the run and deleted each other's slices.
    uri = f"gs://{bucket}/root/locks/r.lock"
    blob = gcs_client.bucket(bucket).blob("root/locks/r.lock")
    gone = gone_pid()
    record = GcsLease.record(owner(socket.gethostname(), gone))
    for elsewhere in (
        {**record, "machine": "another-boot/4026531836"},
        owner(socket.gethostname(), gone),
    ):
        # Another machine's record, and an older version's (no machine): live until the TTL.
        blob.upload_from_string(json.dumps(elsewhere))
        with pytest.raises(LeaseHeld, match=f"pid {gone} on {socket.gethostname()}"):
            GcsLease(gcs_client, uri, owner("here", 33)).acquire()
    # A pid no process can have: an OverflowError out of os.kill, a traceback.
    blob.upload_from_string(json.dumps({**record, "pid": 2**70}))
    with pytest.raises(LeaseHeld, match=f"pid {2**70} on"):
        GcsLease(gcs_client, uri, owner("here", 33)).acquire()
    # Its pid reused by another process here: the holder is gone all the same.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        blob.upload_from_string(
            json.dumps({**GcsLease.record(owner(socket.gethostname(), alive.pid)), "started": "1"})
        )
        taker = GcsLease(gcs_client, uri, owner("here", 33))
        taker.acquire()
        taker.release()
    finally:
        alive.kill()
        alive.wait()


def test_a_gs_run_held_on_another_machine_starts_nothing_here(
    gcs_client, bucket, tmp_path, prefect_harness, capsys
):
    from flows.cli import main

    held = owner("machine-a", 11)
    lock = gcs_client.bucket(bucket).blob("root/locks/busy.lock")
    lock.upload_from_string(json.dumps(held))
    args = ["--set", f"storage.root=gs://{bucket}/root", "--set", "run_name=busy"]
    code = main(["run", "--config", str(REPO / "configs" / "tiny.yaml"), *args])

    assert code == 2
    err = capsys.readouterr().err
    assert "run 'busy' is being run by another orchestrator (pid 11 on machine-a" in err
    assert f"gs://{bucket}/root/locks/busy.lock" in err and "stale after 120 s" in err
    # Nothing sharded, provisioned or written for it, and the other machine's lock kept.
    names = [b.name for b in gcs_client.list_blobs(bucket)]
    assert names == ["root/locks/busy.lock"]
    assert json.loads(lock.download_as_bytes()) == held
