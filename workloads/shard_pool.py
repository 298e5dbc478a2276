"""The processes a sharding run spreads its work over: the calling process is one of them.

With `workers = N`, the run starts N - 1 worker processes and works alongside them. The
caller used to start N workers and wait on them, idle, while they came up (forked by a
forkserver, each re-imports the main module: 20-35 ms here) and while they ran. On the
31 MB stdlib corpus with 2 workers, tokenizing took as long as in one process (66-75 ms
against 64-70 ms); now 48-56 ms, and the whole run 0.19-0.20 s against 0.22-0.24 s.

Jobs go to whichever process is free (a claim counter shared by this process and a feeder
thread that keeps each worker supplied), in order, so jobs of unequal size still balance.
Results come back in job order whoever ran them, and the first job to fail, in job order,
raises its error, as `executor.map` would.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

from workloads.pool_processes import (
    SHIELDED,
    forkserver_preload,
    init_worker,
    start_helpers,
)

# Jobs in flight per worker: the one it runs and one queued behind it. Handing a worker its
# next job takes the feeder thread the GIL, which the work in this process holds up to 5 ms
# at a time; with a job queued the worker never waits for that (timelines showed 5-10 ms
# gaps between jobs with one in flight, though whole runs on the stdlib corpus were no
# faster). The end may leave one process one job more than the other, as one in flight
# also allows: a queued job cannot be taken back.
IN_FLIGHT = 2


@contextmanager
def worker_pool(workers: int) -> Iterator[Callable[[Callable, Iterable], Iterator]]:
    """`run(fn, jobs)`, yielding `fn(job)` for each job in order, computed by this process
    and `workers - 1` worker processes (none for `workers <= 1`).

    Workers start from a forkserver: forking the orchestrator itself, whose Prefect threads
    may hold locks, could deadlock the child. A `ProcessPoolExecutor`, not a
    `multiprocessing.Pool`: a worker killed by the OOM killer raises instead of hanging.
    Workers keep the memory they free and exit with this process (`init_worker`);
    this process's allocator, the caller's, is left as it is. Signals sent to the whole
    process group are this process's to act on (`start_helpers`, `init_worker`).
    """
    if workers <= 1:
        yield lambda fn, jobs: map(fn, jobs)
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(forkserver_preload())
    start_helpers()
    executor = ProcessPoolExecutor(
        workers - 1, mp_context=ctx, initializer=init_worker, initargs=(os.getpid(),)
    )
    pool = _Workers(executor, workers - 1)
    boards: list[_Board] = []

    def run(fn: Callable, jobs: Iterable) -> Iterator:
        board = _Board(list(jobs))
        boards.append(board)
        return _shared_map(pool, fn, board)

    try:
        yield run
    except BaseException as exc:
        # Bad input, a dead worker, SIGTERM's SystemExit, Ctrl-C, a cancelled flow: end
        # now. Cancelling is not enough: the jobs a worker holds cannot be taken back, and
        # the interpreter waits for a pool's workers at exit, so the process outlived a
        # SIGTERM by the minutes a unit can take. Workers are gone once this returns: the
        # caller may remove the directory they wrote in, or the next run redo their work.
        _stop(boards)
        _kill_workers(executor)
        if isinstance(exc, BrokenProcessPool):
            raise WorkerDied(
                "a sharding worker process died (out of memory?); run again: the units of "
                "work already finished are reused"
            ) from exc
        raise
    # Every job is done; not waiting spares a run that needed no worker the wait for one
    # still starting. Workers exit once they read the shutdown, or with this process.
    executor.shutdown(wait=False, cancel_futures=True)


class WorkerDied(RuntimeError):
    """A worker process ended in the middle of the run (killed, out of memory)."""


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    """Kill the executor's worker processes, wait until they are gone, and shut it down."""
    kill = getattr(executor, "kill_workers", None)  # Python 3.14
    if kill is not None:
        kill()
    else:
        processes = list((executor._processes or {}).values())  # no public way before 3.14
        for process in processes:
            process.kill()
        for process in processes:
            process.join(timeout=5)  # gone before the caller retries in the same directory
    executor.shutdown(wait=False, cancel_futures=True)
    # Its manager thread closes its wake-up pipe as it ends; Python 3.11's exit wakes every
    # such thread without a lock, and one closing meanwhile printed "Exception ignored ...
    # OSError: [Errno 9] Bad file descriptor" under a stopped run's one line (fixed in
    # 3.12). Ended here, before the exit, its pipe is closed and the exit skips it.
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=5)


def _stop(boards: list[_Board]) -> None:
    for board in boards:
        board.stop()


class _Workers:
    """The executor's worker processes, started by the first feeder thread (`start`).

    A worker is started per submission, here a no-op whose result says the worker is up:
    none is given a job before, so no job waits on a worker still starting (0.1-0.3 s in
    a fresh process, where the forkserver starts too) while this process could run it.
    Starting them blocks until the forkserver has forked them, hence a thread: this one
    starts working meanwhile.
    """

    def __init__(self, executor: Executor, count: int):
        self.executor = executor
        self.count = count
        self._ready: list[Future] | None = None
        self._lock = threading.Lock()

    def start(self) -> list[Future]:
        """The workers' no-ops, submitted on the first call."""
        with self._lock:
            if self._ready is None:
                self._ready = [self.executor.submit(int) for _ in range(self.count)]
            return self._ready


class _Board:
    """The jobs of one `run` call: which is next to claim, and the results so far, as
    (True, value) or (False, exception), by job index."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self.results: dict[int, tuple[bool, Any]] = {}
        self._next = 0
        self._stopped = False
        self._cond = threading.Condition()

    def claim(self) -> int | None:
        """The next job's index, or None when none is left (or after `stop`)."""
        with self._cond:
            if self._stopped or self._next >= len(self.jobs):
                return None
            self._next += 1
            return self._next - 1

    def exhausted(self) -> bool:
        """Whether no job is left to claim."""
        return self._stopped or self._next >= len(self.jobs)

    def put(self, index: int, ok: bool, value: Any) -> None:
        with self._cond:
            self.results[index] = (ok, value)
            if not ok:
                self._stopped = True  # later jobs are not started: the run fails anyway
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wait_for(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: index in self.results)


def _shared_map(pool: _Workers, fn: Callable, board: _Board) -> Iterator:
    feeder = threading.Thread(
        target=_feed, args=(pool, fn, board), name="shard-feeder", daemon=True
    )
    feeder.start()
    try:
        for index in range(len(board.jobs)):
            while index not in board.results:
                mine = board.claim()
                if mine is None:
                    board.wait_for(index)
                    break
                try:
                    board.put(mine, True, fn(board.jobs[mine]))
                except Exception as exc:  # raised in job order, below
                    board.put(mine, False, exc)
            ok, value = board.results.pop(index)
            if not ok:
                raise value
            yield value
    finally:
        board.stop()  # nothing new starts; the feeder ends with the jobs it has under way


def _feed(pool: _Workers, fn: Callable, board: _Board) -> None:
    """Keep each worker process that is up busy with claimed jobs until none is left."""
    # A signal to the process is the main thread's to act on (it stops the pool). Taken
    # by this thread, or by the executor's threads started from here (they inherit the
    # mask), it waited for the main thread to return from a blocking call: a stopped
    # `tpupipe shard` whose main thread slept in its progress callback ran on for a minute.
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        ready = pool.start()
    except RuntimeError:  # shut down before the workers were started: nothing to feed
        return
    running: dict = {}
    while True:
        up = sum(f.done() for f in ready)
        while len(running) < up * IN_FLIGHT:
            index = board.claim()
            if index is None:
                break
            try:
                running[pool.executor.submit(fn, board.jobs[index])] = index
            except BaseException as exc:  # a broken or shut-down pool
                board.put(index, False, exc)
        starting = [f for f in ready if not f.done()]
        if not running and (board.exhausted() or not starting):
            return
        done, _ = wait([*running, *starting], return_when=FIRST_COMPLETED)
        for future in done:
            if future not in running:
                continue  # a worker came up
            index = running.pop(future)
            try:
                board.put(index, True, future.result())
            except BaseException as exc:  # the job's own error, BrokenProcessPool, cancelled
                board.put(index, False, exc)
