"""The sharding run's processes: this one works alongside its workers, results come back
in job order, and a failure stops the run with the first failing job's error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from workloads.shard_pool import worker_pool
from workloads.sources import DatasetError


def whose(job: int) -> tuple[int, int]:
    time.sleep(0.02)
    return job, os.getpid()


def test_results_come_in_job_order_and_this_process_works_alongside_its_worker():
    with worker_pool(2) as run:
        results = list(run(whose, range(30)))
    assert [job for job, _ in results] == list(range(30))  # each job once, in order
    pids = {pid for _, pid in results}
    assert os.getpid() in pids and len(pids) == 2
    with worker_pool(1) as run:  # one process: this one alone
        assert {pid for _, pid in run(whose, range(3))} == {os.getpid()}


def fails_at_3_and_5(job: tuple[int, str]) -> int:
    index, marks = job
    Path(marks, str(index)).touch()
    if index == 3:
        deadline = time.monotonic() + 30
        while not Path(marks, "5").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # job 5 fails first, in time, in whichever process runs it
        raise DatasetError("bad input in job 3")
    if index == 5:
        raise DatasetError("bad input in job 5")
    time.sleep(0.01)
    return index


def test_the_first_failing_job_in_order_raises_and_no_later_job_starts(tmp_path):
    jobs = [(i, str(tmp_path)) for i in range(60)]
    seen = []
    with pytest.raises(DatasetError, match="job 3"), worker_pool(2) as run:
        seen.extend(run(fails_at_3_and_5, jobs))
    assert seen == [0, 1, 2]  # yielded in order up to the first failing job
    started = sorted(int(p.name) for p in tmp_path.iterdir())
    # Jobs under way when 3 or 5 failed may finish; none is started after that.
    assert started[:6] == [0, 1, 2, 3, 4, 5] and len(started) < 12


def dies_in_a_worker(parent: int) -> int:
    if os.getpid() != parent:
        os._exit(9)  # as the OOM killer would end it
    time.sleep(0.01)
    return parent


def test_a_worker_that_dies_fails_the_run_with_a_clear_error():
    start = time.monotonic()
    with (
        pytest.raises(RuntimeError, match="a sharding worker process died"),
        worker_pool(2) as run,
    ):
        list(run(dies_in_a_worker, [os.getpid()] * 20))
    assert time.monotonic() - start < 30  # not hanging on the dead worker's job
