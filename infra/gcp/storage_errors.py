"""Cloud Storage's errors on reading an object, as the `OSError`s the `infra.storage.Storage`
protocol promises.

The library's exceptions are no `OSError`, and their message names the object only
percent-encoded inside the request URL ("403 GET .../o/data%2Fbrack%5B1%5D.txt?alt=media:
{...}"): a 403 reading a `gs://` source left `tpupipe shard` with a traceback, from this
process or through a sharding worker's pool. As an `OSError` naming the object, the
workload code, which imports no cloud SDK, names the source and the reason
(`workloads.sources.unreadable`), as it does for a local file.
"""

from __future__ import annotations

import errno
import json
import re

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from infra.gcp.gcs import split_uri

# What a storage call raises once its retries are over (the library retries 429, 5xx and
# dropped connections): a refusal, another error it does not retry, or its deadline.
FINAL_ERRORS = (gexc.GoogleAPICallError, gexc.RetryError, auth_exceptions.GoogleAuthError)

_RENEW = "renew them (gcloud auth application-default login)"
_REQUEST = re.compile(r"^[A-Z]+ \S+: ")  # "GET https://...?alt=media: " of an API error


def read_error(uri: str, exc: Exception) -> OSError:
    """`exc`, raised reading the object `uri`, as an `OSError` with `uri` as `filename`
    and the reason, in the server's own words, as `strerror`.

    Args:
        uri: The object, `gs://bucket/name`.
        exc: One of `FINAL_ERRORS`.

    Returns:
        A `PermissionError` for a refusal (403, 401, unusable credentials), saying what to
        grant or renew; an `OSError` (EIO) for any other error.
    """
    if isinstance(exc, gexc.Forbidden):
        bucket, _ = split_uri(uri)
        why = (
            f"permission denied (403): {_reason(exc)}; the identity reading it needs "
            f"storage.objects.get on bucket {bucket}: grant it roles/storage.objectViewer "
            "there (docs/gcp.md)"
        )
        return PermissionError(errno.EACCES, why, uri)
    if isinstance(exc, gexc.Unauthorized):
        return PermissionError(
            errno.EACCES, f"credentials refused (401): {_reason(exc)}; {_RENEW}", uri
        )
    if isinstance(exc, gexc.RetryError):  # retried until its deadline
        last = f"; last error: {_reason(exc.cause)}" if exc.cause else ""
        return OSError(errno.EIO, f"{exc.message}{last}", uri)
    if isinstance(exc, gexc.GoogleAPICallError):  # e.g. 400 on a requester-pays bucket
        return OSError(errno.EIO, f"failed ({exc.code}): {_reason(exc)}", uri)
    # google-auth's own: the credentials could not be refreshed.
    return PermissionError(errno.EACCES, f"credentials unusable: {_reason(exc)}; {_RENEW}", uri)


def _reason(exc: BaseException) -> str:
    """The server's words: the message of a JSON error answer, else the exception's own
    without the request ("GET <url>: ") the library puts in front of it."""
    try:
        said = str(json.loads(exc.response.text)["error"]["message"])  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError, KeyError):
        said = _REQUEST.sub("", str(getattr(exc, "message", "") or exc)) or type(exc).__name__
    return said.rstrip(".")  # a clause of a longer message
