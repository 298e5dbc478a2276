"""Compressed sources: gzip, zstd, bzip2 and xz are read by their content, whatever the name."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pyarrow as pa
import pytest

from tests.test_data_formats import TEXTS, cfg, documents
from workloads import data
from workloads.data import DatasetError

LINES = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
CODECS = {
    ".gz": gzip.compress,
    ".zst": lambda b: pa.compress(b, "zstd", asbytes=True),
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
}


@pytest.mark.parametrize("suffix", CODECS)
def test_compressed_jsonl_and_text_read_as_their_decompressed_bytes(tmp_path, suffix):
    pack = CODECS[suffix]
    path = tmp_path / f"a.jsonl{suffix}"
    # Two members/frames back to back, as `cat a.gz b.gz` makes: both are read.
    path.write_bytes(pack(LINES[:1000]) + pack(LINES[1000:]))
    want = [t.encode() for t in TEXTS]
    assert documents(path) == want  # format "auto" looks through the suffix: JSONL
    # Misnamed: the content decides, so a zstd file called .txt is still decompressed.
    misnamed = tmp_path / "notes.txt"
    misnamed.write_bytes(pack(b"\xef\xbb\xbfone text document"))
    assert documents(misnamed) == [b"one text document"]  # and its BOM is not text
    result = data.shard_dataset(cfg(path, eval_fraction=0.2), tmp_path / "out")
    splits = result.manifest["splits"]
    assert splits["train"]["documents"] + splits["eval"]["documents"] == len(TEXTS)


@pytest.mark.parametrize("suffix", CODECS)
def test_a_truncated_or_corrupt_compressed_file_names_the_file(tmp_path, suffix):
    packed = CODECS[suffix](LINES)
    path = tmp_path / f"a.jsonl{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DatasetError, match=rf"cannot read dataset source .*a\.jsonl\{suffix}"):
        documents(path)


def test_invalid_utf8_in_a_compressed_file_counts_decompressed_bytes(tmp_path):
    path = tmp_path / "a.txt.zst"
    path.write_bytes(CODECS[".zst"](b"0123456789\xff"))
    with pytest.raises(DatasetError, match="byte offset 10 of the zstd-decompressed file"):
        documents(path)


def test_zstd_that_starts_with_a_skippable_frame_is_zstd(tmp_path):
    # pzstd writes a skippable frame (magic 0x184D2A50-5F, then a 4-byte size) before the
    # data frames; read as text, the compressed bytes would become "documents".
    for magic in (0x184D2A50, 0x184D2A5F):
        path = tmp_path / f"{magic:x}.jsonl.zst"
        skippable = magic.to_bytes(4, "little") + (4).to_bytes(4, "little") + b"\0\0\0\0"
        path.write_bytes(skippable + CODECS[".zst"](LINES))
        assert documents(path) == [t.encode() for t in TEXTS]


def test_text_that_only_looks_like_a_magic_number_stays_text(tmp_path):
    path = tmp_path / "b.txt"
    path.write_bytes(b"BZh9 is how a bzip2 stream starts, yet this is prose")
    assert documents(path) == [path.read_bytes()]
