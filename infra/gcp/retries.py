"""Retry policies that say when they retry.

google-api-core's `Retry` backs off in silence: a TPU create retried for five minutes, or a
BigQuery landing answered 503 again and again, showed nothing until it gave up. Each policy
built here logs every failed attempt it is about to retry, as a warning of `infra.retries`
(`tasks.logs` shows it in the flow run's logs in the Prefect UI).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from google.api_core import retry as gretry

log = logging.getLogger("infra.retries")


def logged_retry(
    what: str,
    predicate: Callable[[Exception], bool],
    *,
    initial: float = 1.0,
    maximum: float = 30.0,
    timeout: float = 300.0,
) -> gretry.Retry:
    """A `Retry` of `predicate`'s errors, with exponential back-off from `initial` to
    `maximum` seconds for `timeout` seconds in all, logging each error it retries as
    "`what`: <error>; retrying (for up to <timeout> s)"."""

    def note(exc: Exception) -> None:
        log.warning("%s: %s; retrying (for up to %.0f s)", what, _one_line(exc), timeout)

    return gretry.Retry(
        predicate=predicate, initial=initial, maximum=maximum, timeout=timeout, on_error=note
    )


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
