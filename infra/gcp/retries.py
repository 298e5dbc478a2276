"""Retry policies that say when they retry, and what for.

google-api-core's `Retry` backs off in silence: a TPU create retried for five minutes, or a
BigQuery landing answered 503 again and again, showed nothing until it gave up. Each policy
built here logs every failed attempt it is about to retry, as a warning of `infra.retries`
(`tasks.logs` shows it in the flow run's logs in the Prefect UI). The warning names what
was being done (`doing`) and the deadline of the copy in use: a copy with a shorter one
(`with_timeout`, a stopped run's landing) said the original's 300 s.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator

from google.api_core import exceptions as gexc
from google.api_core import retry as gretry

log = logging.getLogger("infra.retries")

_DOING: contextvars.ContextVar[str | None] = contextvars.ContextVar("doing", default=None)


@contextlib.contextmanager
def doing(place: str) -> Iterator[None]:
    """Name `place` ("landing run r1 into p.metrics") in the retry warnings of the calls
    made inside the block."""
    token = _DOING.set(place)
    try:
        yield
    finally:
        _DOING.reset(token)


class _Note:
    """The warning of one retried error; its deadline comes from the policy in use."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, exc: Exception, timeout: float | None = None) -> None:
        place = _DOING.get()
        what = f"{self.what} ({place})" if place else self.what
        limit = f"for up to {timeout:.3g} s" if timeout is not None else "without a deadline"
        log.warning("%s: %s; retrying (%s)", what, _one_line(exc), limit)


class LoggedRetry(gretry.Retry):
    """A `Retry` whose copies (`with_timeout`, `with_delay`) keep its warning, each saying
    its own deadline."""

    def __call__(self, func: Callable, on_error: Callable | None = None) -> Callable:
        """Wrap `func` as `Retry` does, its warnings saying this copy's deadline."""
        note = self._on_error
        if not isinstance(note, _Note):
            return super().__call__(func, on_error)
        said = gretry.Retry(
            predicate=self._predicate,
            initial=self._initial,
            maximum=self._maximum,
            multiplier=self._multiplier,
            timeout=self._timeout,
            on_error=functools.partial(note, timeout=self._timeout),
        )
        return said(func)


def logged_retry(
    what: str,
    predicate: Callable[[Exception], bool],
    *,
    initial: float = 1.0,
    maximum: float = 30.0,
    timeout: float = 300.0,
) -> LoggedRetry:
    """A `Retry` of `predicate`'s errors, with exponential back-off from `initial` to
    `maximum` seconds for `timeout` seconds in all, logging each error it retries as
    "`what` (<place>): <error>; retrying (for up to <timeout> s)"."""
    return LoggedRetry(
        predicate=predicate, initial=initial, maximum=maximum, timeout=timeout, on_error=_Note(what)
    )


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def concurrent_update(exc: Exception) -> bool:
    """Whether BigQuery cancelled a transaction because another one changed the same table
    at once ("Transaction is aborted due to concurrent update against table ..."): its
    changes were rolled back, and running it again is how BigQuery means it to be met."""
    return isinstance(exc, gexc.GoogleAPICallError) and "concurrent update" in str(exc).lower()
