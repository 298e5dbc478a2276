"""Reading `gs://` dataset sources through `infra.storage.GCSStorage` on the GCS emulator:
what each object costs in requests and bytes, an object replaced while it is read, and one
the reader may not read (through `gcs_proxy.DenyingProxy`)."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from google.cloud.storage import Blob

from infra.storage import READ_CHUNK, GCSStorage
from tests.emulator.gcs_proxy import DENIED_MESSAGE, DenyingProxy
from tests.helpers import REPO
from tests.test_data import cfg_for
from workloads import data
from workloads.documents import ReadOptions, iter_documents
from workloads.sources import DatasetError, SourceFile, open_source

pytestmark = pytest.mark.emulator


def jsonl(n_bytes: int, tag: str = "doc") -> bytes:
    """About `n_bytes` of JSONL, every line a distinct document."""
    line_len = len(json.dumps({"text": f"{tag} 0000000 " + "x" * 80})) + 1
    return "".join(
        json.dumps({"text": f"{tag} {i:07d} " + "x" * 80}) + "\n"
        for i in range(n_bytes // line_len)
    ).encode()


def put(client, bucket: str, name: str, body: bytes) -> None:
    client.bucket(bucket).blob(name).upload_from_string(body)


def source(store: GCSStorage, uri: str) -> SourceFile:
    (obj,) = store.list(uri)
    return SourceFile(obj.uri, uri.rsplit("/", 1)[1], obj.size, obj.generation)


@contextlib.contextmanager
def media_gets(
    client, after_first: Callable[[], None] | None = None
) -> Iterator[list[tuple[int, int]]]:
    """(status, body bytes) of every object download made through `client` inside the
    block; `after_first` runs once the first download has been answered."""
    http = client._http
    real = http.request
    seen: list[tuple[int, int]] = []

    def request(method, url, *args, **kwargs):
        response = real(method, url, *args, **kwargs)
        if method == "GET" and "alt=media" in url:
            seen.append((response.status_code, int(response.headers.get("Content-Length", 0))))
            if len(seen) == 1 and after_first is not None:
                after_first()
        return response

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(http, "request", request)
        yield seen


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_an_object_is_downloaded_once_in_one_get_per_chunk(gcs_client, bucket, compressed):
    # Was: a 5.9 MB plain object took 4 GETs and 3x its size (the codec sniff and the BOM
    # check each read a little, then seeked back, dropping the buffer); gzip 2x.
    body = jsonl(3 * 2**20)
    stored = gzip.compress(body, 1) if compressed else body
    store = GCSStorage(gcs_client)
    name = "c/a.jsonl.gz" if compressed else "c/a.jsonl"
    put(gcs_client, bucket, name, stored)
    src = source(store, f"gs://{bucket}/{name}")
    with media_gets(gcs_client) as gets, open_source(src, store) as fh:
        docs = list(iter_documents(fh, src, ReadOptions("jsonl")))
    assert len(docs) == body.count(b"\n")
    assert gets == [(206, len(stored))]  # one chunk: the whole object, once
    assert len(stored) < READ_CHUNK


def test_a_small_compressed_object_costs_one_get_and_no_416(gcs_client, bucket):
    # Was ~140 GETs, each ending in HTTP 416: every read at the end of the object asked
    # the server for bytes past it.
    body = gzip.compress(jsonl(100_000), 6)
    put(gcs_client, bucket, "c/small.jsonl.gz", body)
    store = GCSStorage(gcs_client)
    src = source(store, f"gs://{bucket}/c/small.jsonl.gz")
    with media_gets(gcs_client) as gets, open_source(src, store) as fh:
        assert len(list(iter_documents(fh, src, ReadOptions("jsonl")))) > 500
    assert gets == [(206, len(body))]


def test_iterating_lines_does_not_read_byte_by_byte(gcs_client, bucket):
    # A reader without peek/readline is iterated through read(1): one call per byte
    # (16,776,999 for 16 MiB), which made a plain gs:// object 4x slower than a local one.
    body = jsonl(200_000)
    put(gcs_client, bucket, "c/lines.jsonl", body)
    store = GCSStorage(gcs_client)
    src = source(store, f"gs://{bucket}/c/lines.jsonl")
    reads = 0

    def count(frame, event, arg):
        nonlocal reads
        if event == "call" and frame.f_code.co_name in {"read", "read1", "readinto", "peek"}:
            reads += 1

    with open_source(src, store) as fh:
        sys.setprofile(count)
        try:
            lines = sum(1 for _ in fh)
        finally:
            sys.setprofile(None)
    assert lines == body.count(b"\n") > 1000
    assert reads < lines // 10  # those of the HTTP stack, per GET; none per line or byte


def replace_with(client, bucket: str, name: str, body: bytes) -> Callable[[], None]:
    return lambda: put(client, bucket, name, body)


def test_an_object_replaced_mid_read_is_reported_as_changed(gcs_client, bucket):
    # The emulator's download URL names no generation, so the second chunk came from the
    # new, shorter object: a silent end of file at the chunk boundary (the dataset cut),
    # or "malformed JSON" when the boundary fell inside a line. Now a range that comes
    # back short is a change.
    body = jsonl(READ_CHUNK + 2**20)
    put(gcs_client, bucket, "c/big.jsonl", body)
    store = GCSStorage(gcs_client)
    src = source(store, f"gs://{bucket}/c/big.jsonl")
    replace = replace_with(gcs_client, bucket, "c/big.jsonl", b'{"text": "replaced"}\n')
    with (
        media_gets(gcs_client, after_first=replace),
        open_source(src, store) as fh,
        pytest.raises(DatasetError) as err,
    ):
        list(iter_documents(fh, src, ReadOptions("jsonl")))
    assert str(err.value) == f"dataset source {src.uri} changed since it was listed; run again"


def test_a_generation_pinned_read_of_a_replaced_object_fails_the_shard_run_as_changed(
    tmp_path, gcs_client, bucket
):
    # Real GCS's mediaLink names the generation, so reading on after a replacement gets
    # 404; that google.api_core NotFound reached the user as a traceback. Here the URL is
    # built from the blob's path and generation, as on real GCS, and the new object is
    # longer: only the generation tells the two apart.
    body = jsonl(READ_CHUNK + 2**20)
    put(gcs_client, bucket, "c/big.jsonl", body)
    replace = replace_with(gcs_client, bucket, "c/big.jsonl", body + jsonl(2**20, "new"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Blob, "media_link", property(lambda self: None))
        with (
            media_gets(gcs_client, after_first=replace) as gets,
            pytest.raises(DatasetError) as err,
        ):
            data.shard_dataset(
                cfg_for(f"gs://{bucket}/c/", workers=1, format="jsonl"),
                tmp_path / "out",
                store=GCSStorage(gcs_client),
            )
    uri = f"gs://{bucket}/c/big.jsonl"
    assert str(err.value) == f"dataset source {uri} changed since it was listed; run again"
    assert gets[-1][0] == 404


REFUSED = "c/brack[1].txt"  # percent-encoded in every URL: c%2Fbrack%5B1%5D.txt
REQUESTER_PAYS = "Bucket is a requester pays bucket but no user project provided."
# `tpupipe` of this checkout, run as its script runs it.
TPUPIPE = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())"]


DENIED = r"permission denied \(403\): .*; .*storage\.objects\.get.*objectViewer"


def parquet(text: str) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [text]}), out)
    return out.getvalue().to_pybytes()


@pytest.mark.parametrize(
    ("answer", "metadata", "fmt", "expected"),
    [
        (403, True, "text", DENIED),
        (403, False, "text", DENIED),
        (403, False, "parquet", DENIED),  # not "not a readable Parquet file"
        (400, False, "text", r"failed \(400\): " + re.escape(REQUESTER_PAYS[:-1]) + "$"),
    ],
    ids=["403-on-open", "403-mid-read", "403-parquet", "400-mid-read"],
)
def test_a_refused_read_names_the_object_and_why(
    gcs_emulator, gcs_client, bucket, monkeypatch, answer, metadata, fmt, expected
):
    # A 403 on the download was a raw google.api_core Forbidden naming the object only
    # percent-encoded in a URL (`tpupipe shard`: a traceback, no "sharding failed:").
    from infra.gcp.clients import storage_client

    put(gcs_client, bucket, REFUSED, parquet("some text") if fmt == "parquet" else b"text\n")
    message = DENIED_MESSAGE if answer == 403 else REQUESTER_PAYS
    reason = "forbidden" if answer == 403 else "required"
    with DenyingProxy(gcs_emulator, REFUSED, answer, reason, message, metadata) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        store = GCSStorage(storage_client("test-project"))
        src = source(store, f"gs://{bucket}/{REFUSED}")
        with pytest.raises(DatasetError) as err, open_source(src, store) as fh:
            list(iter_documents(fh, src, ReadOptions(fmt)))
    assert proxy.refused  # the refusal was met, not some other failure
    text = str(err.value)
    assert text.startswith(f"cannot read dataset source gs://{bucket}/{REFUSED}: ")
    assert re.search(expected, text) and "%5B" not in text


@pytest.mark.parametrize("workers", [1, 2])
def test_tpupipe_shard_exits_1_naming_an_object_it_may_not_read(
    gcs_emulator, gcs_client, bucket, tmp_path, workers
):
    # Read in this process (1 worker) or in a forkserver worker (2): there the raw
    # Forbidden came back through the pool, as a traceback too.
    put(gcs_client, bucket, "c/a.txt", b"a line of text\n" * 80_000)  # a unit of its own
    put(gcs_client, bucket, REFUSED, b"some text\n")
    # With 2 workers this process reads c/a.txt, held until the refusal was sent: the
    # worker process is the one that meets it.
    with DenyingProxy(gcs_emulator, REFUSED, hold_others=workers == 2) as proxy:
        argv = ["shard", "--source", f"gs://{bucket}/c/", "--out", str(tmp_path / "out")]
        done = subprocess.run(
            [*TPUPIPE, *argv, "--workers", str(workers)],
            cwd=REPO,
            env={**os.environ, "STORAGE_EMULATOR_HOST": proxy.url},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "%5B" not in done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("sharding failed:")]
    assert line.startswith(
        f"sharding failed: cannot read dataset source gs://{bucket}/{REFUSED}: "
        "permission denied (403)"
    )
    assert "roles/storage.objectViewer" in line
    assert proxy.refused and proxy.refused_while_held == (workers == 2)
