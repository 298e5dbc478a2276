"""Bad input found by QA: each must fail with a `DatasetError` naming its place, or be read
correctly, and a failed run must leave nothing in the output directory."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.test_data import cfg_for, make_corpus
from tests.test_data_formats import TEXTS, cfg, documents, write_jsonl
from workloads import data, packing
from workloads.config import DatasetConfig
from workloads.data import DatasetError

ROWS = [{"text": t} for t in TEXTS]


def test_a_source_growing_while_read_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "log.jsonl", ROWS)
    real_iter = packing.iter_documents

    def appended_meanwhile(fh, src, opts):
        for n, doc in enumerate(real_iter(fh, src, opts)):
            if n == 1:  # a writer appends while the file is read
                with open(path, "a") as out:
                    out.write(json.dumps({"text": "late"}) + "\n")
            yield doc

    monkeypatch.setattr(packing, "iter_documents", appended_meanwhile)
    with pytest.raises(DatasetError, match=r"log\.jsonl changed while reading"):
        data.shard_dataset(cfg(path, format="jsonl"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # created by the run, removed with its clutter


def test_globstar_does_not_follow_directory_links_and_files_count_once(tmp_path):
    corpus = make_corpus(tmp_path)
    (corpus / "sub" / "back").symlink_to("..")  # a loop: `**` through it never ends
    (corpus / "zz.txt").symlink_to(corpus / "doc0.txt")  # the same file, another name
    (tmp_path / "alias").symlink_to(corpus)
    keys = [f.key for f in data.resolve_sources([str(corpus / "**" / "*.txt")])]
    assert keys == [
        "doc0.txt",
        "doc2.txt",
        "doc4.txt",
        "sub/doc1.txt",
        "sub/doc3.txt",
        "sub/doc5.txt",
    ]
    for entries in ([str(corpus)], [str(corpus / "**")], [str(corpus), str(tmp_path / "alias")]):
        assert len(data.resolve_sources(entries)) == 6, entries


@pytest.mark.parametrize("view", [False, True])
def test_parquet_string_column_with_invalid_utf8_is_checked(tmp_path, view):
    values = [t.encode() for t in TEXTS]
    values[7] = b"bad \xff\xfe here"
    offsets = pa.array([0, *itertools.accumulate(map(len, values))], pa.int32())
    column = pa.Array.from_buffers(  # a writer that skipped validation
        pa.string(), len(values), [None, offsets.buffers()[1], pa.py_buffer(b"".join(values))]
    )
    if view:
        column = column.cast(pa.string_view())
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": column}), path, row_group_size=5)
    with pytest.raises(
        DatasetError, match=r"bad\.parquet: row 8: column 'text': invalid UTF-8 at byte offset 4"
    ):
        documents(path, format="parquet")
    docs = documents(path, format="parquet", errors="replace")
    assert docs[7] == "bad \ufffd\ufffd here".encode() and docs[8] == values[8]


def test_parquet_dictionary_view_and_large_columns_are_read(tmp_path):
    want = [t.encode() for t in TEXTS]
    columns = {
        "dict": pa.array(TEXTS).dictionary_encode(),
        "view": pa.array(TEXTS, pa.string_view()),
        "large": pa.array(TEXTS, pa.large_string()),
        "binview": pa.array(want, pa.binary_view()),
    }
    path = tmp_path / "kinds.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=7)
    for name in columns:
        assert documents(path, format="parquet", text_field=name) == want, name
    m = data.shard_dataset(cfg(path, format="parquet", text_field="dict"), tmp_path / "o").manifest
    assert m["splits"]["train"]["documents"] + m["splits"]["eval"]["documents"] == len(TEXTS)


def test_sources_of_only_empty_documents_have_no_text(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 300)
    with pytest.raises(DatasetError, match=r"contain no text: 300 document\(s\), all empty"):
        data.shard_dataset(cfg(path, format="jsonl"), tmp_path / "out")


def test_a_split_whose_documents_are_all_empty_is_refused_before_training(tmp_path):
    # Every document the eval split draws is empty, the rest have text: the eval split's
    # sequences were end-of-document ids only, and evaluation divided by its zero bytes
    # once the whole run had trained.
    rows = [
        {"text": "" if packing.in_eval(f"docs.jsonl#{n}", 0.1) else "some text " * 5}
        for n in range(400)
    ]
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    with pytest.raises(DatasetError, match=r"the eval split's \d+ document\(s\) are all empty"):
        data.shard_dataset(cfg(path, format="jsonl", eval_fraction=0.1), tmp_path / "out")


def test_an_empty_last_document_the_eval_split_would_get_by_default_is_named(tmp_path):
    # No key hashes into eval, so the last train document moves there: here an empty
    # one, and the run said "the eval split's 1 document(s) are all empty", though the
    # user put nothing empty in eval.
    n = next(
        n
        for n in range(20, 200)
        if not any(packing.in_eval(f"d.jsonl#{i}", 0.01) for i in range(n + 1))
    )
    path = write_jsonl(
        tmp_path / "d.jsonl", [*[{"text": f"document {i} " * 4} for i in range(n)], {"text": ""}]
    )
    with pytest.raises(
        DatasetError,
        match=r"no document goes to eval by its key's hash at eval_fraction=0.01, and the last "
        r"train document, which then moves there, is empty",
    ):
        data.shard_dataset(
            cfg(path, format="jsonl", eval_fraction=0.01, num_shards=1), tmp_path / "out"
        )
    # The same documents with the empty one elsewhere: the moved document has text.
    path.write_text(
        path.read_text().splitlines()[-1]
        + "\n"
        + "\n".join(path.read_text().splitlines()[:-1])
        + "\n"
    )
    data.shard_dataset(
        cfg(path, format="jsonl", eval_fraction=0.01, num_shards=1), tmp_path / "out"
    )


def test_jsonl_with_old_mac_line_endings_says_why_it_is_one_line(tmp_path):
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b'{"text": "first"}\r{"text": "second"}\r')
    with pytest.raises(DatasetError, match=r"cr\.jsonl:1: malformed JSON: .*holds '\\r' line"):
        data.shard_dataset(cfg(path, format="jsonl"), tmp_path / "out")


def test_an_archive_or_utf16_text_given_as_text_is_refused_naming_it(tmp_path):
    import tarfile

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text("some real text\n" * 50)
    with tarfile.open(tmp_path / "corpus.tar.gz", "w:gz") as tar:  # gzip is unwrapped
        tar.add(corpus, arcname="corpus")
    (tmp_path / "u16.txt").write_bytes("Hello, world\n".encode("utf-16-le") * 40)  # no BOM
    for name, where in (("corpus.tar.gz", "of the gzip-decompressed file"), ("u16.txt", "of")):
        with pytest.raises(DatasetError, match=rf"{name} does not look like text: .* {where}"):
            data.shard_dataset(cfg(tmp_path / name, seq_len=8), tmp_path / "out")
    # Stray NUL bytes in real text are still text.
    (corpus / "0.txt").write_bytes(b"some real text\0\n" * 50)
    assert data.shard_dataset(cfg(corpus, seq_len=8, num_shards=1), tmp_path / "out").manifest


def test_an_out_directory_that_is_a_file_is_named(tmp_path):
    corpus = make_corpus(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DatasetError, match=r"datasets directory .*file is not a directory"):
        data.shard_dataset(cfg_for(corpus), tmp_path / "file")
    with pytest.raises(DatasetError, match=r"datasets directory .*file is not a directory"):
        data.shard_dataset(cfg_for(corpus), tmp_path / "file" / "deeper")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_out_directory_is_named(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(DatasetError, match=r"cannot write the dataset directory .*ro/"):
        data.shard_dataset(cfg_for(make_corpus(tmp_path)), tmp_path / "ro")


# Five documents, the fourth one the tokenizer below cannot encode, blank lines between
# them: a line number is not a document number.
_DOCS = ["hello world", "world", "hello", "hello x", "world hello"]
_LINES = (
    b"\n\n".join(d.encode() for d in _DOCS[:2])
    + b"\n \r\n"
    + b"\n".join(d.encode() for d in _DOCS[2:])
)  # documents on lines 1, 3, 5, 6, 7
_JSONL = b"\xef\xbb\xbf" + b"\n\n".join(json.dumps({"text": d}).encode() for d in _DOCS)


@pytest.mark.parametrize(
    ("name", "options", "place"),
    [
        ("a.jsonl", {"format": "jsonl"}, r"a\.jsonl:7: "),
        ("a.jsonl.gz", {"format": "jsonl"}, r"a\.jsonl\.gz:7: "),
        ("a.txt", {"text_unit": "line"}, r"a\.txt:6: "),
        ("a.txt", {}, r"a\.txt: "),
        ("a.parquet", {"format": "parquet"}, r"a\.parquet: row 4: column 'text': "),
    ],
)
def test_a_tokenizer_that_cannot_encode_a_document_names_its_line_or_row(
    tmp_path, name, options, place
):
    # It named "document N", the Nth non-blank line, where every other error of the format
    # names the line (JSONL, text lines) or the row (Parquet).
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # "<unk>" is not in the vocabulary
    tok.save(str(tmp_path / "tok.json"))
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": _DOCS}), path, row_group_size=2)
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(_JSONL))
    else:
        path.write_bytes(_JSONL if "jsonl" in name else _LINES)
    with pytest.raises(DatasetError, match=place + r"tokenizer file .*tok\.json cannot encode"):
        data.shard_dataset(
            cfg(path, tokenizer=str(tmp_path / "tok.json"), **options), tmp_path / "o"
        )


def test_corrupt_gzip_names_the_file(tmp_path):
    packed = bytearray(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    packed[12] ^= 0xFF  # the deflate stream's first bytes
    (tmp_path / "c.jsonl.gz").write_bytes(bytes(packed))
    with pytest.raises(DatasetError, match=r"cannot read dataset source .*c\.jsonl\.gz: "):
        documents(tmp_path / "c.jsonl.gz", format="jsonl")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": 1' + "0" * 5000 + "}", r"a\.jsonl:41: field 'text' is a number, not a string"),
        (
            '{"text": "x", "d": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"a\.jsonl:41: unreadable JSON: nested too deeply",
        ),
    ],
)
def test_json_beyond_pythons_limits_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    with open(path, "a") as fh:
        fh.write(line + "\n")
    with pytest.raises(DatasetError, match=message):
        data.shard_dataset(cfg(path, format="jsonl"), tmp_path / "out")


def test_an_integer_past_pythons_limit_in_another_field_is_no_error(tmp_path):
    # Valid JSON, refused: "unreadable JSON: Exceeds the limit (4300 digits) for integer
    # string conversion", for a field the dataset never reads.
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "kept", "id": 1' + "0" * 5000 + '}\n{"text": "next", "id": 7}\n')
    assert documents(path, format="jsonl") == [b"kept", b"next"]


def test_a_leading_byte_order_mark_is_not_text(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "f.txt").write_bytes(bom + b"one\ntwo\n")
    assert documents(tmp_path / "f.txt") == [b"one\ntwo\n"]
    assert documents(tmp_path / "f.txt", text_unit="line") == [b"one", b"two"]
    lines = bom + b'{"text": "a"}\n{"text": "b"}\n'
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    for name in ("a.jsonl", "a.jsonl.gz"):
        assert documents(tmp_path / name, format="jsonl") == [b"a", b"b"], name
    (tmp_path / "bad.txt").write_bytes(bom + b"ok \xff")  # offsets still count the mark
    with pytest.raises(DatasetError, match=r"bad\.txt: invalid UTF-8 at byte offset 6 "):
        documents(tmp_path / "bad.txt")


def test_a_fifo_or_device_named_as_a_source_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null.txt").symlink_to("/dev/null")
    (tmp_path / "pipe.txt").symlink_to(tmp_path / "fifo")
    for name, kind in (("fifo", "a FIFO"), ("null.txt", "a device"), ("pipe.txt", "a FIFO")):
        with pytest.raises(DatasetError, match=rf"{name} is {kind}, not a regular file"):
            data.resolve_sources([str(tmp_path / name)])
    # Found by a walk or a glob, they are skipped like sockets (not documents).
    (tmp_path / "doc.txt").write_text("text")
    for entry in (str(tmp_path), str(tmp_path / "*")):
        assert [f.key for f in data.resolve_sources([entry])] == ["doc.txt"]


def test_a_failed_run_leaves_nothing_behind(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*ROWS, {"body": "no text"}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "other").mkdir()  # another dataset: kept
    for out in (tmp_path / "out", tmp_path / "new" / "deeper"):
        with pytest.raises(DatasetError, match=r"bad\.jsonl:41: no field 'text'"):
            data.shard_dataset(cfg(bad, format="jsonl", workers=2), out, unit_bytes=1)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["other"]
    assert not (tmp_path / "new").exists()


def test_a_run_waiting_for_a_failed_run_locks_the_new_directory(tmp_path):
    from workloads.outdir import claimed

    directory = tmp_path / "out" / "fp"
    entered, failed, locked = threading.Event(), [], []

    def failing() -> None:
        try:
            with claimed(directory):
                entered.set()
                time.sleep(0.3)  # the other run is waiting on the lock meanwhile
                raise DatasetError("bad input")
        except DatasetError:
            failed.append(True)

    def waiting() -> None:
        entered.wait()
        with claimed(directory):
            locked.append((directory / ".lock").is_file())

    threads = [threading.Thread(target=failing), threading.Thread(target=waiting)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Not compared in order: the waiting run may take the lock before the failed one's
    # handler runs (it did on a loaded machine).
    assert failed == [True] and locked == [True]


def test_an_out_directory_inside_a_source_directory_is_not_read(tmp_path):
    corpus = make_corpus(tmp_path)
    out = corpus / "datasets"
    for entry in (corpus, corpus / "**"):
        first = data.shard_dataset(cfg_for(entry), out)
        again = data.shard_dataset(cfg_for(entry), out)
        assert again.cached and again.dataset_dir == first.dataset_dir, entry
        assert len(first.manifest["sources"]) == 6


def test_a_short_eval_split_advises_eval_fraction_not_num_shards(tmp_path):
    corpus = make_corpus(tmp_path)
    with pytest.raises(DatasetError, match=r"eval split .*\(eval_fraction=.*raise eval_fraction"):
        data.shard_dataset(cfg_for(corpus, seq_len=1024, eval_fraction=1e-9), tmp_path / "o")


def test_too_few_documents_within_max_bytes_names_it(tmp_path):
    # "give 1 document(s)" named the sources alone, where max_bytes had kept one file.
    corpus = make_corpus(tmp_path)
    with pytest.raises(DatasetError, match=r"give 1 document\(s\) within dataset.max_bytes = 1;"):
        data.shard_dataset(cfg_for(corpus, max_bytes=1), tmp_path / "o")


def test_hidden_files_and_directories_are_not_corpus(tmp_path):
    from infra.storage import source_storage

    corpus = make_corpus(tmp_path)
    (corpus / ".git" / "objects").mkdir(parents=True)
    (corpus / ".git" / "objects" / "ab").write_bytes(b"x\x9c\xff\xfe binary")
    (corpus / "sub" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1\xff")
    visible = sorted(f.key for f in data.resolve_sources([str(corpus / "**" / "*.txt")]))
    assert len(visible) == 6
    uri = f"file://{corpus}/"
    for entries, store in (([str(corpus)], None), ([uri], source_storage([uri]))):
        assert sorted(f.key for f in data.resolve_sources(entries, store)) == visible, entries
    # Named outright, or by a pattern that asks for dot-names, a hidden file is read.
    named = data.resolve_sources([str(corpus / "sub" / ".DS_Store")])
    assert [f.key for f in named] == [".DS_Store"]
    keys = [f.key for f in data.resolve_sources([f"{uri}sub/.*"], source_storage([uri]))]
    assert keys == [".DS_Store"]
    # The shards are those of the corpus without them (strict UTF-8 would refuse them).
    result = data.shard_dataset(cfg_for(corpus), tmp_path / "out")
    assert len(result.manifest["sources"]) == 6


def test_a_short_train_split_shows_both_splits_sizes(tmp_path):
    # One large document hashed into eval leaves train short: the message shows where the
    # text went, so the user sees that eval_fraction, not the corpus size, is the lever.
    (tmp_path / "c.txt").write_text("short one\nshort two\n" + "w" * 5000 + "\n")
    cfg = DatasetConfig(
        sources=[str(tmp_path / "c.txt")], text_unit="line", seq_len=64, eval_fraction=0.3
    )
    assert [packing.in_eval(f"c.txt#{n}", 0.3) for n in range(3)] == [False, False, True]
    with pytest.raises(DatasetError) as err:
        data.shard_dataset(cfg, tmp_path / "out")
    message = str(err.value)
    assert re.search(r"train \d+ tokens in \d document\(s\), eval \d+ tokens in \d", message)
    train, evals = (int(n) for n in re.findall(r"(\d+) tokens", message))
    assert train + evals == 5000 + len("short one") + len("short two") + 3  # text + EODs


def test_an_out_directory_that_is_a_source_directory_is_refused(tmp_path):
    # The corpus and its datasets would share one directory (the next run's corpus).
    corpus = make_corpus(tmp_path)
    (tmp_path / "alias").symlink_to(corpus)
    for entry, out in ((corpus, corpus), (corpus, tmp_path / "alias"), (corpus / "*.txt", corpus)):
        message = f"datasets directory {out} is dataset source '{entry}' "
        with pytest.raises(DatasetError, match=re.escape(message)):
            data.shard_dataset(cfg_for(entry), out)
    assert sorted(p.name for p in corpus.iterdir()) == ["doc0.txt", "doc2.txt", "doc4.txt", "sub"]
    # An out directory that holds the sources is fine: `--source corpus --out .`.
    for entry in (corpus / "sub", corpus / "sub" / "*.txt"):
        result = data.shard_dataset(cfg_for(entry, eval_fraction=0.4), corpus)
        assert Path(result.dataset_dir).parent == corpus


def test_a_dataset_directory_left_in_a_source_is_not_corpus(tmp_path):
    corpus = make_corpus(tmp_path)
    first = data.shard_dataset(cfg_for(corpus), corpus / "ds")  # allowed: walks skip it
    # A run killed before its manifest: shards already renamed, `.lock` and `.work/`.
    killed = corpus / "old" / "0123456789abcdef"
    (killed / ".work").mkdir(parents=True)
    (killed / ".lock").write_text("")
    (killed / "train-00000-of-00001.arrayrecord").write_bytes(b"\xff\xfe\x00binary")
    # A file merely called manifest.json is corpus like any other.
    (corpus / "app").mkdir()
    (corpus / "app" / "manifest.json").write_text('{"name": "app", "fingerprint": "x"}')
    want = sorted([*(s["key"] for s in first.manifest["sources"]), "app/manifest.json"])
    for entry in (corpus, corpus / "**", corpus / "**" / "*"):
        assert sorted(f.key for f in data.resolve_sources([str(entry)])) == want, entry
    deeper = sorted(f.key for f in data.resolve_sources([str(corpus / "*" / "*")]))
    assert deeper == ["app/manifest.json", "sub/doc1.txt", "sub/doc3.txt", "sub/doc5.txt"]
    # Another out: the datasets left in the corpus are not read (strict UTF-8 would fail).
    again = data.shard_dataset(cfg_for(corpus), tmp_path / "other")
    assert sorted(s["key"] for s in again.manifest["sources"]) == want
    with pytest.raises(DatasetError, match=r"is a tpupipe dataset directory .*not a corpus"):
        data.resolve_sources([first.dataset_dir])


def test_the_default_corpus_shards_as_it_is_and_a_users_corpus_stays_strict(tmp_path):
    # The nightly deployment and a UI run that gives no dataset use the default config:
    # strict decoding refused the 4 deliberately non-UTF-8 test files of the stdlib.
    result = data.shard_dataset(DatasetConfig(), tmp_path / "out")
    assert result.manifest["splits"]["train"]["records"] > 0
    corpus = make_corpus(tmp_path)
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.txt: invalid UTF-8 at byte offset 3"):
        data.shard_dataset(DatasetConfig(sources=[str(corpus)], seq_len=16), tmp_path / "u")
    strict = DatasetConfig(sources=["stdlib"], errors="strict")
    with pytest.raises(DatasetError, match="invalid UTF-8"):  # asked for: still strict
        data.shard_dataset(strict, tmp_path / "s")
