"""How much memory a local slice's processes may use on this machine: RAM plus swap, within
the memory limit of the cgroup they run in (a container's `--memory`, a Kubernetes pod's
`resources.limits.memory`, a systemd unit's `MemoryMax`).

Why the cgroup: inside a container /proc/meminfo shows the host's memory, not the
container's. A model the host could hold but the container cannot passed the memory check
(workloads/config_memory.py), provisioned its slice and was then SIGKILLed by the cgroup's
OOM killer, an exit the watch takes for a preemption and retries.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value.
_UNLIMITED = 2**62


def host_memory_bytes(
    meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT
) -> int | None:
    """This machine's memory a local slice can use: RAM plus swap, or less if this
    process's cgroup (and its ancestors') limit it; None if unknown.

    The total, not what is available now: a figure that moves with whatever else runs (the
    Prefect server, another run, the page cache) would refuse on a busy moment a config
    that trains on an idle machine.
    """
    ram_swap = _meminfo(meminfo)
    if ram_swap is None:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    ram, swap = ram_swap
    limited = cgroup_limit(cgroup, root, ram, swap)
    return ram + swap if limited is None else min(ram + swap, limited)


def cgroup_limit(cgroup: str, root: str, ram: int, swap: int) -> int | None:
    """RAM plus swap this process's cgroup allows (the tightest of it and its ancestors),
    or None when no limit is set or none can be read. v2 limits RAM (`memory.max`) and
    swap (`memory.swap.max`) apart; v1 limits RAM (`memory.limit_in_bytes`) and RAM plus
    swap together (`memory.memsw.limit_in_bytes`, when swap accounting is on)."""
    try:
        lines = Path(cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "" and os.path.exists(f"{root}/cgroup.controllers"):  # v2
            mem = _tightest(root, path, "memory.max")
            swap_max = _tightest(root, path, "memory.swap.max")
            if mem is None and swap_max is None:
                return None
            ram_limit = ram if mem is None else min(ram, mem)
            return ram_limit + (swap if swap_max is None else min(swap, swap_max))
        if "memory" in controllers.split(","):  # v1
            both = _tightest(f"{root}/memory", path, "memory.memsw.limit_in_bytes")
            mem = _tightest(f"{root}/memory", path, "memory.limit_in_bytes")
            limits = [x for x in (both, None if mem is None else mem + swap) if x is not None]
            return min(limits) if limits else None
    return None


def _tightest(mount: str, path: str, name: str) -> int | None:
    """The smallest limit `name` holds in the cgroup at `path` below `mount` and in each
    ancestor directory that exists (in a container the cgroup's own directory is often
    mounted as `mount` itself), or None if none is set."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        try:
            text = Path(mount, *parts[:depth], name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            found.append(int(text))
    return min(found) if found else None


def _meminfo(meminfo: str) -> tuple[int, int] | None:
    """(RAM, swap) in bytes from /proc/meminfo, or None if it cannot be read."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = int(fields["MemTotal"].split()[0]), int(fields.get("SwapTotal", "0").split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return kib[0] * 1024, kib[1] * 1024
