"""A trial's chips: held from the sweep's chip limit, asked for in a way a stopped sweep
can walk away from.

A request for chips (`prefect.concurrency.sync.concurrency`) waits until they are granted,
however long another sweep holds them. A sweep stopped meanwhile never ended: the threads
its trials waited in are joined when the interpreter exits, so even a second signal, which
lands the sweep's rows, left the process running until the other sweep let go of its
chips. Requests here wait `CHIP_POLL_S` at a time, and a trial whose sweep has stopped
asks no more.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from contextlib import ExitStack

from prefect.concurrency.sync import concurrency

# How long one request for chips waits before the trial looks again whether its sweep was
# stopped. Prefect makes the requests for one limit one after another, so the trials
# waiting in one process ask about once a second in all, and a trial sees the stop within
# a second per trial waiting before it (a sweep waits in at most its thread pool's few).
CHIP_POLL_S = 1.0


def hold_chips(chips: ExitStack, limit: str, count: int, stopped: Callable[[], bool]) -> bool:
    """Hold `count` chips of the global concurrency limit `limit` until `chips` closes;
    False, holding none, once `stopped()` says the sweep stopped before they were granted.

    Raises:
        Exception: no admission (the limit deleted since planning, the API unreachable).
    """
    while not stopped():
        try:
            # strict: a limit deleted since planning must stop the trial, not run it
            # unlimited. Chips granted after the timeout are given back by Prefect.
            chips.enter_context(
                concurrency(limit, occupy=count, strict=True, timeout_seconds=CHIP_POLL_S)
            )
            return True
        except TimeoutError:
            continue
    return False


class _TimeoutsAreNotErrors(logging.Filter):
    """Leaves out Prefect's error log of a request for chips that timed out ("Service
    'ConcurrencySlotAcquisitionWithLeaseService' failed to process item ..."): here that
    is how a trial waits (`hold_chips`), not a failure, and it was logged every second a
    trial waited. The record's last argument is the request, whose last item is the future
    its caller waits on; any other record, and any other error, is logged as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        request = args[-1] if args else None
        future = request[-1] if isinstance(request, tuple) and request else None
        if not isinstance(future, concurrent.futures.Future) or not future.done():
            return True
        return future.cancelled() or not isinstance(future.exception(), TimeoutError)


logging.getLogger("prefect._internal.concurrency").addFilter(_TimeoutsAreNotErrors())
