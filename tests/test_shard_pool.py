"""The sharding run's processes: this one works alongside its workers, results come back
in job order, and a failure stops the run with the first failing job's error."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from workloads.shard_pool import worker_pool
from workloads.sources import DatasetError


def whose(job: tuple[int, str]) -> tuple[int, int]:
    """(job number, pid), once two processes have run jobs (or after 30 s): however slowly
    the worker starts, this process cannot run every job before it is up."""
    index, marks = job
    Path(marks, str(os.getpid())).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return index, os.getpid()


def test_results_come_in_job_order_and_this_process_works_alongside_its_worker(tmp_path):
    jobs = [(i, str(tmp_path)) for i in range(30)]
    with worker_pool(2) as run:
        results = list(run(whose, jobs))
    assert [job for job, _ in results] == list(range(30))  # each job once, in order
    pids = {pid for _, pid in results}
    assert os.getpid() in pids and len(pids) == 2


def test_no_job_waits_for_a_worker_that_is_not_up():
    # A worker still starting (its start-up no-op never finishes here) is given no job:
    # this process runs them all and the run ends without waiting for it.
    from concurrent.futures import Future, ThreadPoolExecutor

    from workloads.shard_pool import _Board, _shared_map, _Workers

    with ThreadPoolExecutor(1) as executor:
        pool = _Workers(executor, 1)
        pool._ready = [Future()]  # never done
        results = list(_shared_map(pool, in_thread, _Board(list(range(5)))))
    assert results == [(i, threading.current_thread().name) for i in range(5)]
    with worker_pool(1) as run:  # one process: this one alone
        assert list(run(quick, range(3))) == [(i, os.getpid()) for i in range(3)]


def quick(job: int) -> tuple[int, int]:
    return job, os.getpid()


def in_thread(job: int) -> tuple[int, str]:
    return job, threading.current_thread().name


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


def dies_in_a_worker(job: tuple[int, str]) -> int:
    """A job that kills any worker process running it, as the OOM killer would. In the
    calling process it waits until a worker has died, so the test does not depend on how
    fast a worker starts: the caller could otherwise run every job before one is up."""
    parent, marker = job
    if os.getpid() != parent:
        Path(marker).touch()
        os._exit(9)
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    return parent


def test_a_worker_that_dies_fails_the_run_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with (
        pytest.raises(RuntimeError, match="a sharding worker process died"),
        worker_pool(2) as run,
    ):
        list(run(dies_in_a_worker, [(os.getpid(), str(tmp_path / "died"))] * 20))
    assert time.monotonic() - start < 30  # not hanging on the dead worker's job


INTERRUPTED_RUN = """
import os, sys, time
from pathlib import Path

from workloads.shard_pool import worker_pool


def job(args):
    marks, parent = args
    if os.getpid() != parent:  # a worker: a long unit of work
        Path(marks, str(os.getpid())).touch()
        time.sleep(120)
        return
    deadline = time.monotonic() + 30  # this process: done once the worker holds a job
    while not os.listdir(marks) and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    with worker_pool(2) as run:
        for _ in run(job, [(sys.argv[1], os.getpid())] * 6):
            raise KeyboardInterrupt  # what Ctrl-C, or SIGTERM's SystemExit, raises mid-run
"""


def _run_script(tmp_path: Path, name: str, text: str):
    """Run `text` as a script with a fresh `marks` directory as its argument; returns the
    finished process and that directory."""
    import subprocess
    import sys

    script, marks = tmp_path / name, tmp_path / "marks"
    script.write_text(text)
    marks.mkdir()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script), str(marks)], env=env, capture_output=True, timeout=60
    )
    return out, marks


def test_an_interrupted_run_ends_at_once_and_its_workers_with_it(tmp_path):
    # The worker holds a 120 s job and one queued behind it: the process used to wait for
    # both before exiting, however it was stopped.
    import signal

    out, marks = _run_script(tmp_path, "interrupted.py", INTERRUPTED_RUN)
    assert out.returncode == -signal.SIGINT and b"KeyboardInterrupt" in out.stderr
    (worker,) = (int(p.name) for p in marks.iterdir())
    assert not running(worker)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (this VM's init may not reap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


# Run as `python -m slow_main`, as Prefect deployments run flows (`python -m prefect.engine`):
# multiprocessing runs the main module again in every worker, and this one imports a
# module that takes 3 s to import.
SLOW_MAIN = """
import json, os, sys, time
from pathlib import Path

import slow_dependency  # noqa: F401  (3 s, like a heavy framework's import)
from tests.test_shard_pool import whose
from workloads.shard_pool import worker_pool


def first_worker_job(marks):
    marks.mkdir()
    start = time.time()  # the clock of the marker files' mtimes
    with worker_pool(2) as run:
        results = list(run(whose, [(i, str(marks)) for i in range(4)]))
    assert {pid for _, pid in results} != {os.getpid()}
    started = [p.stat().st_mtime for p in marks.iterdir() if p.name != str(os.getpid())]
    return min(started) - start


if __name__ == "__main__":
    first_worker_job(Path(sys.argv[1], "first"))  # the first pool starts the forkserver
    print(json.dumps({"second_pool_s": first_worker_job(Path(sys.argv[1], "second"))}))
"""


def test_workers_of_a_run_started_as_python_m_start_without_importing_its_main_again(
    tmp_path,
):
    # Before, each pool's worker imported slow_dependency again (3 s) before its first
    # job; now the forkserver imports the main module once and workers start with it.
    import json
    import subprocess
    import sys

    (tmp_path / "slow_dependency.py").write_text("import time\ntime.sleep(3)\n")
    (tmp_path / "slow_main.py").write_text(SLOW_MAIN)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path)])}
    cmd = [sys.executable, "-m", "slow_main", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["second_pool_s"] < 2.0


def test_the_forkserver_preloads_the_module_run_with_python_m_only():
    import types

    from workloads.pool_processes import PRELOAD, forkserver_preload

    def main(spec_name):
        module = types.ModuleType("__main__")
        module.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None
        return module

    assert forkserver_preload(main("prefect.engine")) == [*PRELOAD, "prefect.engine"]
    assert forkserver_preload(main("pytest.__main__")) == list(PRELOAD)  # workers skip it
    assert forkserver_preload(main(None)) == list(PRELOAD)  # a script


def test_what_sharding_and_its_forkserver_import_leaves_out_grain_and_jax():
    # Sharding reads no shard through grain; its import of grain (and jax) had cost every
    # `tpupipe shard`, and the forkserver every worker pool first started in a process,
    # 0.6 s: a 2-worker run of the stdlib corpus took 0.9-1.3 s against 0.3 s after it.
    from tests.helpers import heavy_modules_after
    from workloads.pool_processes import PRELOAD

    preload = f"import importlib\nfor name in {list(PRELOAD)!r}: importlib.import_module(name)"
    assert heavy_modules_after(preload) == []


# A pool's processes and the signals a terminal sends its whole process group.
POOL_SIGNALS = """
import json, os, signal, sys, time
import multiprocessing.forkserver, multiprocessing.resource_tracker
from pathlib import Path

from workloads.shard_pool import worker_pool


def job(args):
    marks, parent = args
    if os.getpid() == parent:  # this process: done once the worker has run a job
        deadline = time.monotonic() + 30
        while not os.listdir(marks) and time.monotonic() < deadline:
            time.sleep(0.01)
        return None
    Path(marks, str(os.getpid())).touch()
    return [signal.getsignal(signal.SIGINT) == signal.SIG_IGN, list(signal.pthread_sigmask(0, []))]


def masks(pid):  # the signals process `pid` blocks and ignores, as bits
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status)
    return [int(fields[name], 16) for name in ("SigBlk", "SigIgn")]


if __name__ == "__main__":
    with worker_pool(2) as run:
        (worker, *_) = [r for r in run(job, [(sys.argv[1], os.getpid())] * 4) if r]
        helpers = [
            multiprocessing.resource_tracker._resource_tracker._pid,
            multiprocessing.forkserver._forkserver._forkserver_pid,
        ]
        print(json.dumps({"worker": worker, "helpers": [masks(pid) for pid in helpers]}))
"""


def test_ctrl_c_and_a_hang_up_are_the_runs_to_handle(tmp_path):
    # Sent to the whole group: multiprocessing's resource tracker died of SIGHUP (the exit
    # relaunched it, to "Some resources might leak" and a KeyError traceback per
    # semaphore), the forkserver of SIGHUP and SIGTERM, and an idle worker printed a
    # KeyboardInterrupt traceback for Ctrl-C. The run stops its workers itself.
    import json
    import signal

    out, _ = _run_script(tmp_path, "signals.py", POOL_SIGNALS)
    assert out.returncode == 0, out.stderr.decode()
    seen = json.loads(out.stdout)
    ignores_ctrl_c, blocked = seen["worker"]
    assert ignores_ctrl_c and blocked == []  # SIGTERM and SIGHUP end a worker as before
    for blocked_bits, ignored_bits in seen["helpers"]:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            assert (blocked_bits | ignored_bits) >> (signum - 1) & 1, signum
