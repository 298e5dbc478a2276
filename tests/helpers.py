"""Small helpers shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

from workloads.config import PipelineConfig
from workloads.config_file import load_config

REPO = Path(__file__).resolve().parent.parent


def tiny_config(root: Path, *overrides: str) -> PipelineConfig:
    """configs/tiny.yaml with its storage under `root` and any `key=value` overrides."""
    return load_config(REPO / "configs" / "tiny.yaml", [f"storage.root={root}", *overrides])


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def group_alive(pgid: int) -> list[int]:
    """Processes of a process group that are not zombies."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def attempt_events(
    attempt: int,
    t0: float,
    resumed: int,
    last: int,
    outcome: str,
    invocation: str | None = None,
) -> list[dict]:
    """A synthetic ledger of one attempt that trained steps `resumed`+1 .. `last`.

    Its slice is requested at t0 and ready at +2; it restores `resumed` (if any) at +3,
    finishes its first step at +5 and then one step a second. At step `last` it finishes
    (outcome 'completed') or saves and stops (a SIGTERM: 'preempted'), ends 1 s later and
    deletes its slice 1 s after that. `invocation` stamps the orchestrator's events.
    """
    orch = {"attempt": attempt, "source": "orchestrator"}
    if invocation:
        orch["invocation"] = invocation
    work = {"attempt": attempt, "source": "workload"}
    first, stop = t0 + 5, t0 + 5 + (last - resumed - 1)
    events = [
        {"time": t0, "event": "provision_requested", **orch},
        {"time": t0 + 2, "event": "provision_ready", **orch},
    ]
    if resumed:
        events.append(
            {"time": t0 + 3, "event": "restored", "step": resumed, "seconds": 1.0, **work}
        )
    events.append(
        {"time": first, "event": "first_step", "step": resumed + 1, "resumed_from": resumed, **work}
    )
    if outcome == "completed":
        events.append({"time": stop, "event": "finished", "step": last, **work})
    else:
        events.append({"time": stop, "event": "checkpoint", "step": last, **work})
        events.append({"time": stop, "event": "preempted", "step": last, **work})
    events.append({"time": stop + 1, "event": "attempt_ended", "outcome": outcome, **orch})
    events.append({"time": stop + 2, "event": "deleted", **orch})
    return events
