"""One host of tests/test_preemption_hosts.py: an attempt resumed at step 14 that takes a
step, saves it, is sent SIGTERM, then reports the step its hosts agree to stop at.

    python tests/preemption_host.py PROCESS_ID PORT RUN_DIR KEEP GO_FILE
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

START = 14  # the step the attempt resumed from


def main() -> None:
    pid, port, run_dir, keep, go = sys.argv[1:6]
    import orbax.checkpoint as ocp

    from workloads import checkpoint
    from workloads.train import PreemptionNotice, init_distributed

    env = {
        "TPUPIPE_NUM_PROCESSES": "2",
        "TPUPIPE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "TPUPIPE_PROCESS_ID": pid,
    }
    notice = PreemptionNotice()
    notice.across_hosts = init_distributed(env)
    mngr = checkpoint.make_manager(run_dir, keep=int(keep))
    assert not notice.stop_at(1)  # step 15, this attempt's first
    meta = ocp.args.JsonSave({"step": START + 1})
    mngr.save(START + 1, args=ocp.args.Composite(meta=meta), force=True)
    mngr.wait_until_finished()  # its finalize thread too
    print("saved", flush=True)
    while not Path(go).exists():  # the test sends SIGTERM meanwhile
        time.sleep(0.05)
    for taken in range(2, 41):
        if notice.stop_at(taken):
            print(f"stop at step {START + taken}", flush=True)
            break
        time.sleep(0.05)
    else:
        print("no stop within 40 steps", flush=True)
    mngr.close()


if __name__ == "__main__":
    main()
