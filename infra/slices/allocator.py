"""The memory allocator of local workload processes.

XLA:CPU asks for its temporary buffers afresh at every step: hundreds of MB for the
`small` model. glibc's malloc serves blocks that large with `mmap` and returns them with
`munmap` at once, so every step faults the same pages in again (measured here: ~138k minor
faults and 0.23 s of kernel time per step of `small`, about a quarter of the step).
TCMalloc keeps freed memory for reuse: the faults drop to almost none and a step takes
0.70-0.74 s instead of 0.85. Without it, glibc's transparent huge pages tunable cuts the
faults 200-fold and gains ~8%.

`TPUPIPE_MALLOC=system` keeps the environment's allocator untouched, as does an
`LD_PRELOAD` the user set already.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def find_tcmalloc(dirs: Iterable[str] = LIBRARY_DIRS) -> str | None:
    """Path of an installed TCMalloc shared library (Debian: libtcmalloc-minimal4), or None."""
    for directory in dirs:
        for name in TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def allocator_env(env: Mapping[str, str], dirs: Iterable[str] = LIBRARY_DIRS) -> dict[str, str]:
    """`env` with the allocator a workload process should use.

    Returns:
        A copy of `env`, unchanged if `TPUPIPE_MALLOC=system` or `LD_PRELOAD` is set;
        else with TCMalloc preloaded when installed, or glibc's huge-pages tunable added to
        `GLIBC_TUNABLES` (other tunables kept).
    """
    out = dict(env)
    mode = out.get("TPUPIPE_MALLOC", "auto")
    if mode not in ("auto", "system"):
        raise ValueError(f"TPUPIPE_MALLOC={mode!r}: expected 'auto' or 'system'")
    if mode == "system" or out.get("LD_PRELOAD"):
        return out
    tcmalloc = find_tcmalloc(dirs)
    if tcmalloc:
        out["LD_PRELOAD"] = tcmalloc
        return out
    tunables = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append(HUGE_PAGES_TUNABLE)
    out["GLIBC_TUNABLES"] = ":".join(tunables)
    return out
