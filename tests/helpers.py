"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tasks.pricing import attempt_pricing
from workloads.config import PipelineConfig
from workloads.config_file import load_config

REPO = Path(__file__).resolve().parent.parent

# A price table of one TPU family and region.
TABLE = """\
source: https://example.test/prices
read_on: 2026-01-02
families:
  v5litepod:
    us-central1: {on_demand: 2.0, spot: 0.5}
"""

# Overrides that make configs/tiny.yaml a valid gcp config (a v5litepod-8 slice, gs://).
GCP_OVERRIDES = (
    "slice.provider=gcp",
    "slice.zone=us-west4-a",
    "slice.accelerator_type=v5litepod-8",
    "slice.runtime_version=v2-alpha-tpuv5-lite",
    "slice.wheel=gs://bkt/tpupipe-0-py3-none-any.whl",
    "mesh.data=-1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "storage.root=gs://bkt/root",
    "storage.project=test-project",
)


def cut_checkpoint_data(state_dir: Path, process: str = "*") -> None:
    """Cut every array data file of a checkpoint's `state` directory in half, as an
    interrupted copy would leave them. Cutting only the biggest file is not enough: OCDBT
    data files may end in bytes no longer referenced, so the cut can miss every array.
    `process`: only the files that JAX process wrote (each host writes the shards it holds)."""
    data_files = [p for p in state_dir.glob(f"ocdbt.process_{process}/d/*") if p.is_file()]
    assert data_files, f"no OCDBT data files under {state_dir}"
    for path in data_files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


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


def read_sequences(path: str, manifest: dict) -> np.ndarray:
    """One shard's sequences as stored, shape (count, record length), whatever number of
    sequences its ArrayRecord records hold."""
    from array_record.python.array_record_module import ArrayRecordReader

    dtype = {"uint8": "u1", "uint16": "<u2", "uint32": "<u4"}[manifest["record"]["dtype"]]
    reader = ArrayRecordReader(path)
    try:
        raw = b"".join(reader.read_all())
    finally:
        reader.close()
    return np.frombuffer(raw, dtype=dtype).reshape(-1, manifest["record"]["length"])


def as_format_4(dataset_dir: str, out_dir: Path) -> str:
    """A copy of a byte-tokenizer dataset as format 4 wrote it (uint16 ids, EOD stored as
    256, no `record.eod`), in `out_dir`; returns its path. For the reader's and the resume
    check's compatibility with datasets built before uint8 storage."""
    import hashlib
    import json

    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    manifest = json.loads((Path(dataset_dir) / "manifest.json").read_text())
    assert manifest["record"]["dtype"] == "uint8", manifest["record"]
    out_dir.mkdir(parents=True)
    length = manifest["record"]["length"]
    for split in ("train", "eval"):
        for shard in manifest["splits"][split]["shards"]:
            reader = ArrayRecordReader(os.path.join(dataset_dir, shard["name"]))
            records = reader.read_all()
            reader.close()
            path = out_dir / shard["name"]
            # Format 4: one sequence per record, several records a chunk.
            group = min(64, 32768 // (2 * length))
            writer = ArrayRecordWriter(str(path), f"uncompressed,group_size:{group}")
            for raw in np.frombuffer(b"".join(records), dtype=np.uint8).reshape(-1, length):
                ids = raw.astype("<u2")  # widened first: 256 does not fit a uint8
                ids[raw == 0xFF] = 256
                writer.write(ids.tobytes())
            writer.close()
            shard["bytes"] = path.stat().st_size
            shard["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["format_version"] = 4
    del manifest["manifest_sha256"]  # written since format 6 only
    manifest["record"] = {"dtype": "uint16", "length": length, "byte_order": "little"}
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    return str(out_dir)


def priced(events: list[dict], config: PipelineConfig) -> list[dict]:
    """`events` as the orchestrator records them under `config`: each provisioning request
    carries the attempt's price and slice."""
    fields = attempt_pricing(config)
    return [{**e, **fields} if e["event"] == "provision_requested" else e for e in events]


def eight_then_four(root: Path, table_file: Path) -> tuple[PipelineConfig, PipelineConfig]:
    """A local run priced as v5litepod-8 at the table's $2, rerun on 4 devices priced as
    v5litepod-4 at a flat $3."""
    eight = tiny_config(
        root,
        "cost.priced_as=v5litepod-8",
        "cost.region=us-central1",
        f"cost.price_table={table_file}",
    )
    four = tiny_config(
        root,
        "slice.devices=4",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "cost.priced_as=v5litepod-4",
        "cost.region=us-central1",
        "cost.usd_per_chip_hour=3.0",
    )
    return eight, four


class FakeClock:
    """A clock for `tasks.watch.watch_slice` that moves only when the watch sleeps.

    `limit`: a time past which a sleep fails the test (a watch that never ends)."""

    def __init__(self, start: float = 1000.0, limit: float | None = None) -> None:
        self.now, self.limit = start, limit

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.limit is not None and self.now > self.limit:
            raise AssertionError("still watching after a day of polls")


def heavy_modules_after(code: str) -> list[str]:
    """Which of Prefect, jax and grain a fresh interpreter has imported once it has run
    `code` (the repository on its path): what a command or process start pays for."""
    import ast
    import subprocess
    import sys

    code += "\nimport sys\nprint([m for m in ('grain', 'jax', 'prefect') if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.splitlines()[-1])


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """`path` made immutable (chattr +i: unwritable to root too, as a teammate's file of
    mode 0644 is to another user), or the test skipped where the system does not allow it."""
    import subprocess

    import pytest

    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i is not allowed here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def six_document_run(tmp_path: Path) -> tuple[Path, PipelineConfig]:
    """A corpus of six small documents and a run config sharding it into one shard."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 40)
    cfg = PipelineConfig(
        run_name="r",
        storage={"root": str(tmp_path / "root")},
        dataset={"sources": [str(corpus)], "seq_len": 16, "num_shards": 1, "eval_fraction": 0.3},
    )
    return corpus, cfg
