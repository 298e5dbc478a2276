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
