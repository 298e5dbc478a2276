"""Kill a real sharding process with SIGKILL mid-way, then finish the job in a new run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import group_alive
from tests.test_data import files_of
from workloads import data
from workloads.config import DatasetConfig
from workloads.data import DatasetError
from workloads.shard_stats import SHARD_STATS

# The child shards with two workers and reports progress slowly in the stage to be killed
# (argv[3]), so the kill lands while there is work left; it prints each progress call for
# the test to follow.
CHILD = """
import sys, time
from workloads import data
from workloads.config import DatasetConfig

def progress(stage, done, total):
    print(stage, done, total, flush=True)
    if stage == sys.argv[3]:
        time.sleep(0.3)

cfg = DatasetConfig(sources=[sys.argv[1]], seq_len=64, num_shards=6, workers=2)
data.shard_dataset(cfg, sys.argv[2], progress=progress, unit_bytes=40_000)
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume") / "corpus"
    root.mkdir()
    rng = random.Random(0)
    for i in range(40):  # 40 files of 10 kB: 10 units of work, 7 shards
        (root / f"{i:02d}.txt").write_text("".join(rng.choices("abcdef gh\n", k=10_000)))
    return root


def kill_when(corpus: Path, out: Path, stage: str, after: int, group: bool = True) -> None:
    """Run the child and SIGKILL its whole process group (workers included), or with
    `group=False` the child alone, once it has reported `after` progress calls of `stage`.
    Either way, no process of the group may outlive it by more than a few seconds."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(corpus), str(out), stage],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen = 0
    try:
        for line in child.stdout:
            assert not line.startswith("done"), "the child finished before it was killed"
            seen += line.split()[0] == stage
            if seen >= after:
                break
    finally:
        if group:
            os.killpg(child.pid, signal.SIGKILL)
        else:  # as the OOM killer, `kill -9` or SIGTERM's default action do
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
    deadline = time.monotonic() + 10
    while group_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_alive(child.pid) == []


@pytest.mark.parametrize(
    ("stage", "after", "group"),
    [("tokenize", 4, True), ("write", 3, True), ("write", 3, False)],
    ids=["tokenize", "write", "write-orchestrator-only"],
)
def test_sigkill_mid_run_then_rerun_equals_a_clean_run(corpus, tmp_path, stage, after, group):
    # Killing the orchestrator alone once left its workers running for good, writing into
    # the directory the rerun below was completing.
    kill_when(corpus, tmp_path / "killed", stage, after, group)
    (dataset_dir,) = (tmp_path / "killed").iterdir()
    assert not (dataset_dir / "manifest.json").exists()
    with pytest.raises(DatasetError, match="incomplete dataset"):
        data.load_manifest(dataset_dir)

    cfg = DatasetConfig(sources=[str(corpus)], seq_len=64, num_shards=6, workers=1)
    calls = []
    resumed = data.shard_dataset(
        cfg, tmp_path / "killed", progress=lambda *a: calls.append(a), unit_bytes=40_000
    )
    assert not resumed.cached and resumed.dataset_dir == str(dataset_dir)
    # Units the killed run finished are not tokenized again.
    first_stage, done, total = calls[0]
    assert first_stage == "tokenize" and 0 < done <= total
    if stage == "write":
        assert done == total
    clean = data.shard_dataset(cfg, tmp_path / "clean", unit_bytes=40_000)
    assert files_of(resumed.dataset_dir) == files_of(clean.dataset_dir)
    hidden = sorted(p.name for p in dataset_dir.iterdir() if p.name.startswith("."))
    assert hidden == [".lock", SHARD_STATS]  # no leftover, no .work
    data.verify_shards(dataset_dir)


def test_a_build_says_which_interrupted_builds_beside_it_no_run_holds(tmp_path, caplog):
    # A run killed mid-build keeps its work for a run of the same sources; once a source
    # changed, none ever resumed it, and its `.work` stayed, unsaid.
    import fcntl

    from tests.test_data import cfg_for, make_corpus

    out = tmp_path / "out"
    for name, size in (("killed", 2_000_000), ("running", 10), ("complete", 10)):
        (out / name / ".work").mkdir(parents=True)
        (out / name / ".work" / "unit-0").write_bytes(b"x" * size)
        (out / name / ".lock").touch()
    (out / "complete" / "manifest.json").write_text("{}")
    held = os.open(out / "running" / ".lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a build under way
    try:
        with caplog.at_level("WARNING", logger="workloads.data"):
            result = data.shard_dataset(cfg_for(make_corpus(tmp_path / "c")), out)
    finally:
        os.close(held)
    assert not result.cached
    said = "1 interrupted build(s) beside this dataset keep 2.0 MB of finished work"
    assert f"{said} ({out / 'killed'})" in caplog.text
    assert (out / "killed" / ".work" / "unit-0").is_file()  # said, never deleted
