"""A local slice's hosts run their command only once the slice is recorded.

The registry record is written after the hosts are forked (it names their pids). An
orchestrator SIGKILLed in between (`signals_held` cannot hold SIGKILL back) left a workload
training that no record named: no reaper, teardown or rerun could find it, and no ttl bound
it (probe Q: 2 of 2 such kills). Each host now starts as a shell that waits for a line on
its stdin, a pipe whose other end only the creator holds, and then becomes the command
(`exec`: the pid, and so the record, stay the same). The creator sends the line once the
record is written; if it dies first, the pipe's end closes, the shell reads nothing and
exits without ever running the command.
"""

from __future__ import annotations

import contextlib
import os

# Exit code of a host whose creator never opened the gate.
GATE_CLOSED = 70

# $0 names the gate in `ps`; "$@" is the command, run with stdin from /dev/null as before.
# The shell's own `read`, not `head`: a child process of the gate killed with it stayed a
# zombie where PID 1 reaps no orphans, and kept the slice's process group alive.
_SCRIPT = f'read -r go && [ "$go" = g ] || exit {GATE_CLOSED}; exec "$@" </dev/null'


class Gate:
    """The pipes of one slice's hosts: one per host, so that each reads its own line."""

    def __init__(self) -> None:
        self._senders: list[int] = []

    def gated(self, command: list[str]) -> tuple[list[str], int]:
        """The command behind the gate, and the fd its stdin must be (the caller closes
        it once the host is started)."""
        reader, sender = os.pipe()
        self._senders.append(sender)
        return ["/bin/sh", "-c", _SCRIPT, "tpupipe-gate", *command], reader

    def open(self) -> None:
        """Let every host run its command (the slice is recorded)."""
        for sender in self._senders:
            # A host already dead (killed meanwhile) has closed its end: it is one the
            # slice's status reports as ended, as before the gate, not a failed create.
            with contextlib.suppress(BrokenPipeError):
                os.write(sender, b"g\n")
        self.close()

    def close(self) -> None:
        """Close the pipes: a host not let through yet exits with `GATE_CLOSED`."""
        while self._senders:
            with contextlib.suppress(OSError):
                os.close(self._senders.pop())
