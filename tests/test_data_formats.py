"""Source formats (text lines, JSONL, gzip, Parquet), tokenizer files, and bad input named
by its place."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.test_data import read_records
from workloads import data, input
from workloads.config import DatasetConfig, PipelineConfig
from workloads.data import DatasetError
from workloads.documents import ReadOptions, iter_documents
from workloads.sources import SourceFile

TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (3 + i % 5) for i in range(40)]


def cfg(path: Path, **kw) -> DatasetConfig:
    return DatasetConfig(sources=[str(path)], **{"seq_len": 16, "num_shards": 2, **kw})


def documents(path: Path, **kw) -> list[bytes]:
    src = SourceFile(str(path), path.name, path.stat().st_size, path.stat().st_mtime_ns)
    with open(path, "rb") as fh:
        return list(iter_documents(fh, src, ReadOptions.of(cfg(path, **kw))))


def all_tokens(result: data.ShardResult) -> dict[str, np.ndarray]:
    """Each split's stream as stored (records overlap by one token)."""
    out = {}
    for split in ("train", "eval"):
        records = read_records(result.dataset_dir, result.manifest, split)
        out[split] = np.concatenate([records[0], records[1:, 1:].ravel()])
    return out


def whole_documents(stream: np.ndarray, eod: int) -> list[list[int]]:
    """The documents ended by an EOD in a token stream (a cut-off tail is dropped)."""
    ends = np.flatnonzero(stream == eod)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[a:b].tolist() for a, b in zip(starts, ends, strict=True)]


def write_jsonl(path: Path, rows: list, opener=open) -> Path:
    with opener(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_text_lines_are_documents(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"first line\r\n\n   \nsecond line\nthird, no newline")
    want = [b"first line", b"second line", b"third, no newline"]
    assert documents(path, text_unit="line") == want
    assert documents(path) == [path.read_bytes()]  # text_unit="file": the whole file
    big = tmp_path / "big.txt"
    big.write_text("\n".join(TEXTS))
    m = data.shard_dataset(cfg(big, text_unit="line", eval_fraction=0.2), tmp_path / "o").manifest
    # One file, yet both splits: the split is per line-document.
    assert m["splits"]["train"]["documents"] + m["splits"]["eval"]["documents"] == len(TEXTS)
    assert m["splits"]["eval"]["documents"] > 0
    assert m["splits"]["train"]["bytes"] + m["splits"]["eval"]["bytes"] == sum(map(len, TEXTS))


def test_jsonl_and_jsonl_gz_give_the_field_of_each_line(tmp_path):
    rows = [{"id": i, "body": t} for i, t in enumerate(TEXTS)]
    plain = write_jsonl(tmp_path / "a.jsonl", rows)
    packed = write_jsonl(tmp_path / "a.jsonl.gz", rows, opener=gzip.open)
    want = [t.encode() for t in TEXTS]
    assert documents(plain, format="jsonl", text_field="body") == want
    assert documents(packed, format="jsonl", text_field="body") == want
    result = data.shard_dataset(
        cfg(packed, format="jsonl", text_field="body", eval_fraction=0.2), tmp_path / "out"
    )
    splits = result.manifest["splits"]
    assert splits["train"]["documents"] + splits["eval"]["documents"] == len(TEXTS)
    assert result.manifest["options"]["text_field"] == "body"
    # Every complete document in the stored stream is one of the lines' texts.
    whole = [bytes(d) for d in whole_documents(all_tokens(result)["train"], 256)]
    assert whole and set(whole) <= set(want)


def test_parquet_string_and_binary_columns_over_row_groups(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table({"text": TEXTS, "raw": [t.encode() for t in TEXTS], "n": range(40)})
    pq.write_table(table, path, row_group_size=7)
    want = [t.encode() for t in TEXTS]
    assert documents(path, format="parquet") == want
    assert documents(path, format="parquet", text_field="raw") == want
    m = data.shard_dataset(cfg(path, format="parquet", eval_fraction=0.2), tmp_path / "o").manifest
    assert m["splits"]["train"]["documents"] + m["splits"]["eval"]["documents"] == 40


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            ['{"text": "ok"}', '{"text": "fine"}', '{"text": "broken'],
            r"a\.jsonl:3: malformed JSON: Unterminated string starting at column 10$",
        ),
        (['{"text": "ok"}', '{"body": "x"}'], r"a\.jsonl:2: no field 'text' \(fields: body\)"),
        (['{"text": 5}'], r"a\.jsonl:1: field 'text' is a number, not a string"),
        (['["text"]'], r"a\.jsonl:1: expected a JSON object, got an array"),
        (['{"text": "\\ud800"}'], r"a\.jsonl:1: field 'text' holds an unpaired surrogate"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, rows, message):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError, match=message):
        data.shard_dataset(cfg(path, format="jsonl"), tmp_path / "out")


def test_utf8_checked_a_chunk_at_a_time_finds_what_a_whole_decode_finds(monkeypatch):
    # Large documents are checked by the megabyte (a whole decode of a 120 MB mixed-script
    # document made a str of up to 4 bytes per character); here chunks of 5 bytes, so
    # characters of 2-4 bytes straddle them everywhere.
    from workloads import documents_text

    monkeypatch.setattr(documents_text, "_UTF8_CHUNK", 5)
    text = "ascii é ß 中文 😀 mixed ∑ text 🎉 end".encode()
    bad = [text[:7] + b"\xff" + text[7:], text[:-1], text + b"\xc3", b"\xed\xa0\x80" + text]
    for raw in (text, *(text[:cut] for cut in range(len(text))), *bad):
        try:
            raw.decode("utf-8")
            valid = True
        except UnicodeDecodeError as exc:
            valid, offset = False, exc.start
        assert documents_text._valid_utf8(raw) is valid
        if valid:
            assert documents_text.utf8(raw, "f", 100, "strict") is raw
        else:  # the offset is the whole decode's, in the file
            with pytest.raises(DatasetError, match=f"invalid UTF-8 at byte offset {100 + offset} "):
                documents_text.utf8(raw, "f", 100, "strict")


def test_invalid_utf8_names_file_and_byte_offset_unless_replaced(tmp_path):
    text = tmp_path / "bad.txt"
    text.write_bytes(b"hello \xff world")
    with pytest.raises(DatasetError, match=r"bad\.txt: invalid UTF-8 at byte offset 6 of the file"):
        documents(text)
    # The fix named both ways of asking for it: a config's field and `tpupipe shard`'s flag.
    with pytest.raises(DatasetError, match=r"dataset\.errors=replace, or --errors replace with"):
        documents(text)
    assert documents(text, errors="replace") == ["hello \ufffd world".encode()]
    lines = tmp_path / "bad.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: invalid UTF-8 at byte offset 30 "):
        documents(lines, format="jsonl")
    assert documents(lines, format="jsonl", errors="replace")[1] == "caf\ufffd".encode()
    assert documents(lines, format="jsonl", errors="replace", text_field="text")[0] == b"fine"
    (tmp_path / "good.txt").write_text("x" * 400)
    result = data.shard_dataset(
        DatasetConfig(
            sources=[str(tmp_path / "*.txt")],
            seq_len=8,
            num_shards=1,
            errors="replace",
            eval_fraction=0.4,
        ),
        tmp_path / "out",
    )
    assert result.manifest["options"]["errors"] == "replace"


def test_bad_parquet_names_file_column_and_row(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["a", "b", None], "n": [1, 2, 3]}), path)
    with pytest.raises(DatasetError, match=r"a\.parquet: no column 'text' \(columns: body, n\)"):
        documents(path, format="parquet")
    with pytest.raises(DatasetError, match=r"a\.parquet: column 'n' has type int64, not text"):
        documents(path, format="parquet", text_field="n")
    # Rows count from 1, like JSONL lines: the third row.
    with pytest.raises(DatasetError, match=r"a\.parquet: row 3: column 'body' is null"):
        documents(path, format="parquet", text_field="body")
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok", b"caf\xe9"], pa.binary())}), raw)
    with pytest.raises(
        DatasetError, match=r"raw\.parquet: row 2: column 'text': invalid UTF-8 at byte offset 3"
    ):
        documents(raw, format="parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"junk\.parquet: not a readable Parquet file"):
        documents(tmp_path / "junk.parquet", format="parquet")


def test_a_parquet_column_named_with_a_dot_is_taken_before_a_struct_path(tmp_path):
    # pyarrow selects columns by dotted path, so a name would also pick struct meta's child
    # `text`, listed first here: the column is read by its index instead.
    path = tmp_path / "both.parquet"
    structs = pa.array([{"text": "from the struct"}] * len(TEXTS))
    pq.write_table(pa.table({"meta": structs, "meta.text": TEXTS}), path, row_group_size=7)
    assert documents(path, text_field="meta.text") == [t.encode() for t in TEXTS]
    result = data.shard_dataset(cfg(path, text_field="meta.text", workers=1), tmp_path / "o")
    splits = result.manifest["splits"]
    assert splits["train"]["bytes"] + splits["eval"]["bytes"] == sum(map(len, TEXTS))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_parquet_column_name_given_twice_is_named_and_leaves_nothing(tmp_path, workers):
    path = tmp_path / "dup.parquet"
    twice = pa.Table.from_arrays([pa.array(TEXTS), pa.array(TEXTS)], names=["text", "text"])
    pq.write_table(twice, path)
    message = r"dup\.parquet: column 'text' appears 2 times"
    with pytest.raises(DatasetError, match=message):
        data.shard_dataset(cfg(path, workers=workers), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # no partial .work directory left behind
    nested = pa.array([{"text": t} for t in TEXTS], pa.struct([("text", pa.string())] * 2))
    pq.write_table(pa.table({"meta": nested}), path)
    with pytest.raises(DatasetError, match=r"dup\.parquet: column 'meta\.text' appears 2 times"):
        documents(path, text_field="meta.text")


def test_a_lone_cr_does_not_end_a_line_and_the_error_says_so(tmp_path):
    # Lines end at "\n" (a "\r\n" ending counts as one); splitting at "\r" too would
    # change the bytes of datasets already built, so a CR-only file is one line.
    path = tmp_path / "mac.txt"
    path.write_bytes(b"\r".join(t.encode() for t in TEXTS) + b"\r")
    assert documents(path, text_unit="line") == [path.read_bytes()]  # bytes unchanged
    message = r"give 1 document\(s\).*mac\.txt has '\\r' line endings and no '\\n'"
    with pytest.raises(DatasetError, match=message):
        data.shard_dataset(cfg(path, text_unit="line"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_only_the_cr_of_a_crlf_ending_is_part_of_the_line_break(tmp_path):
    # "a\r\r\n" is the line "a\r": stripping every "\r" before the "\n" lost text.
    path = tmp_path / "crcrlf.txt"
    path.write_bytes(b"row one\r\r\nrow two\r\r\n\r\r\n\r\nrow three\r\r\r\n")
    assert documents(path, text_unit="line") == [b"row one\r", b"row two\r", b"row three\r\r"]
    assert documents(path) == [path.read_bytes()]  # a whole file keeps every byte
    # In JSONL a "\r" after the object is whitespace, and one in its text stays text.
    rows = tmp_path / "crcrlf.jsonl"
    rows.write_bytes(b'{"text": "one\\r"}\r\r\n\r\r\n{"text": "two"}\r\n')
    assert documents(rows, format="jsonl") == [b"one\r", b"two"]


def bpe_tokenizer(path: Path, extra: tuple[str, ...] = ()) -> Path:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", *extra])
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(path))
    return path


def test_hugging_face_tokenizer_file(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(TEXTS):
        (corpus / f"{i:02d}.txt").write_text(t)
    tok_path = bpe_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_path))
    eod = tok.get_vocab_size(with_added_tokens=True)
    result = data.shard_dataset(
        cfg(corpus, tokenizer=str(tok_path), eval_fraction=0.2), tmp_path / "out"
    )
    m = result.manifest
    assert m["tokenizer"]["kind"] == "huggingface" and m["tokenizer"]["eod_token"] == eod
    assert m["tokenizer"]["vocab_size"] == eod + 1 and m["record"]["dtype"] == "uint16"
    # The stored stream decodes back to whole documents, one per EOD.
    docs = [tok.decode(d) for d in whole_documents(all_tokens(result)["train"], eod)]
    assert docs and set(docs) <= set(TEXTS)
    ev = m["splits"]["eval"]
    info = input.dataset_info(result.dataset_dir)
    assert info.vocab_size == eod + 1 and info.bytes_per_token == ev["bytes"] / ev["tokens"] > 1
    # The fingerprint follows the file's content, not its name.
    other = str(shutil.copy(tok_path, tmp_path / "renamed.json"))
    same = data.shard_dataset(cfg(corpus, tokenizer=other, eval_fraction=0.2), tmp_path / "out")
    assert same.cached and same.dataset_dir == result.dataset_dir


def test_a_tokenizer_files_truncation_and_padding_are_turned_off(tmp_path):
    # Hub tokenizer.json files often set both, for an inference model's context: documents
    # were cut to 8 tokens, or padded with [PAD] that was packed as text, and the manifest
    # still said packing efficiency 1.0.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(TEXTS):
        (corpus / f"{i:02d}.txt").write_text(t)
    plain_path = bpe_tokenizer(tmp_path / "plain.json", extra=("[PAD]",))
    plain = Tokenizer.from_file(str(plain_path))
    eod = plain.get_vocab_size(with_added_tokens=True)
    expected = {tuple(plain.encode(t).ids) for t in TEXTS}
    assert min(map(len, expected)) > 8
    built = {}
    for name, setting in [
        ("truncation", lambda t: t.enable_truncation(8)),
        ("padding", lambda t: t.enable_padding(length=96, pad_token="[PAD]")),
    ]:
        tok = Tokenizer.from_file(str(plain_path))
        setting(tok)
        tok.save(str(tmp_path / f"{name}.json"))
        options = cfg(corpus, tokenizer=str(tmp_path / f"{name}.json"), eval_fraction=0.2)
        result = data.shard_dataset(options, tmp_path / "out")
        stream = all_tokens(result)["train"]
        assert {tuple(d) for d in whole_documents(stream, eod)} <= expected, name
        assert result.manifest["tokenizer"]["ignores"] == [name]
        built[name] = result.dataset_dir
    # Without such settings the manifest and the fingerprint are as they were.
    result = data.shard_dataset(cfg(corpus, tokenizer=str(plain_path)), tmp_path / "out")
    assert "ignores" not in result.manifest["tokenizer"]
    assert result.dataset_dir not in built.values()


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(6):
        (corpus / f"{d}.txt").write_text(" ".join(words[69_000 + d * 100 :][:100]))
    result = data.shard_dataset(cfg(corpus, tokenizer=str(tmp_path / "big.json")), tmp_path / "o")
    assert result.manifest["record"]["dtype"] == "uint32"
    assert result.manifest["tokenizer"]["eod_token"] == 70_000
    batch = next(input.train_iterator(result.dataset_dir, batch_size=2, seed=0))
    assert batch["inputs"].max() >= 69_000 and batch["inputs"].max() <= 70_000


def test_a_vocabulary_with_gaps_in_its_ids_gets_an_eod_past_its_largest_id(tmp_path):
    # 11 entries, ids 0-8, 10 and 11: EOD was 11, the id of "[UNK]", and sharding failed
    # ("emitted id 11 outside its vocabulary") only on a corpus with an unknown word.
    vocab = {**{c: i for i, c in enumerate("abcdefghi")}, "j": 10, "[UNK]": 11}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "gap.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(6):
        (corpus / f"{d}.txt").write_text("a b c j zzz " * 20)  # zzz: [UNK], id 11
    result = data.shard_dataset(cfg(corpus, tokenizer=str(tmp_path / "gap.json")), tmp_path / "o")
    assert result.manifest["tokenizer"]["eod_token"] == 12
    batch = next(input.train_iterator(result.dataset_dir, batch_size=2, seed=0))
    assert {10, 11} <= set(batch["inputs"].ravel().tolist())  # "j" and "[UNK]" as they are


def test_a_tokenizer_file_changed_during_sharding_is_refused(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(TEXTS):
        (corpus / f"{i:02d}.txt").write_text(t)
    # A tokenizer of its own: one already loaded in this process would not be read again.
    tok_path = bpe_tokenizer(tmp_path / "tokenizer.json", extra=("[CHANGED]",))
    real_resolve = data.resolve_sources

    def resolve_then_retrain(*args, **kw):
        files = real_resolve(*args, **kw)
        tok_path.write_text(tok_path.read_text() + "\n")  # after the fingerprint's sha256
        return files

    monkeypatch.setattr(data, "resolve_sources", resolve_then_retrain)
    with pytest.raises(DatasetError, match=r"tokenizer\.json changed during sharding"):
        data.shard_dataset(cfg(corpus, tokenizer=str(tok_path)), tmp_path / "out")


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"tokenizer file .*missing\.json cannot be read"):
        data.load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text('{"not": "a tokenizer"}')
    # tokenizers' own words were "expected `,` or `}` at line 1 column 7": a syntax error?
    junk = r"junk\.json is not a tokenizers JSON file: it is JSON, but not a tokenizer: it "
    with pytest.raises(DatasetError, match=junk + r"has no 'model' \(its keys: not\)$"):
        data.load_tokenizer(tmp_path / "junk.json")
    (tmp_path / "cut.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(DatasetError, match=r"cut\.json is not a tokenizers JSON file: EOF"):
        data.load_tokenizer(tmp_path / "cut.json")
    with pytest.raises(ValueError, match="never downloaded"):
        DatasetConfig(tokenizer="hf://gpt2")


def test_format_auto_reads_each_file_by_its_name(tmp_path):
    """A directory of mixed files needs no --format: .jsonl(.gz)/.ndjson are JSON lines,
    .parquet/.pq Parquet, anything else (here .txt, .py, .json) one text document."""
    rows = [{"text": t} for t in TEXTS[:10]]
    write_jsonl(tmp_path / "a.jsonl.gz", rows, opener=gzip.open)
    write_jsonl(tmp_path / "b.NDJSON", rows[:3])
    pq.write_table(pa.table({"text": TEXTS[10:20]}), tmp_path / "c.pq")
    (tmp_path / "d.txt").write_text(TEXTS[20])
    (tmp_path / "e.json").write_text(json.dumps({"text": "a JSON file is text"}))
    assert DatasetConfig().format == "auto"
    want = {
        "a.jsonl.gz": [t.encode() for t in TEXTS[:10]],
        "b.NDJSON": [t.encode() for t in TEXTS[:3]],
        "c.pq": [t.encode() for t in TEXTS[10:20]],
        "d.txt": [TEXTS[20].encode()],
        "e.json": [(tmp_path / "e.json").read_bytes()],
    }
    for name, docs in want.items():
        assert documents(tmp_path / name) == docs, name
    result = data.shard_dataset(cfg(tmp_path, eval_fraction=0.2), tmp_path / "out")
    splits = result.manifest["splits"]
    assert splits["train"]["documents"] + splits["eval"]["documents"] == 25
    # Files of several formats: both the field and the text unit change the bytes.
    assert result.manifest["options"]["format"] == "auto"
    assert {"text_field", "text_unit"} <= result.manifest["options"].keys()
    # Files of one format: the same dataset as that format given outright (same cache).
    only_jsonl = cfg(tmp_path / "*.jsonl.gz", eval_fraction=0.2)
    auto = data.shard_dataset(only_jsonl, tmp_path / "out")
    given = data.shard_dataset(only_jsonl.model_copy(update={"format": "jsonl"}), tmp_path / "out")
    assert given.cached and given.dataset_dir == auto.dataset_dir
    assert "text_unit" not in auto.manifest["options"]
    # An explicit format still applies to every file: JSON lines read as text are text.
    assert documents(tmp_path / "a.jsonl.gz", format="text") == [
        gzip.decompress((tmp_path / "a.jsonl.gz").read_bytes())
    ]
    with pytest.raises(DatasetError, match=r"c\.pq: row 1: column 'body'|no column 'body'"):
        data.shard_dataset(cfg(tmp_path / "c.pq", text_field="body"), tmp_path / "o2")


def test_a_dotted_text_field_reads_nested_json_and_struct_columns(tmp_path):
    rows = [{"meta": {"body": t}, "a.b": str(i)} for i, t in enumerate(TEXTS[:5])]
    lines = write_jsonl(tmp_path / "n.jsonl", rows)
    assert documents(lines, text_field="meta.body") == [t.encode() for t in TEXTS[:5]]
    # A key that holds the dot itself is a field of that name, not a path.
    assert documents(lines, text_field="a.b") == [str(i).encode() for i in range(5)]
    structs = [{"body": t, "n": 1} for t in TEXTS[:5]]
    table = pa.table({"meta": pa.array([*structs, None]), "id": range(6)})
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=2)
    with pytest.raises(DatasetError, match=r"n\.parquet: row 6: column 'meta.body' is null"):
        documents(tmp_path / "n.parquet", text_field="meta.body")
    pq.write_table(table.slice(0, 5), tmp_path / "n.parquet", row_group_size=2)
    assert documents(tmp_path / "n.parquet", text_field="meta.body") == [
        t.encode() for t in TEXTS[:5]
    ]
    for field, message in (
        ("meta.n", r"column 'meta.n' has type int64, not text"),
        ("meta.nope", r"no column 'meta.nope' \(columns: meta, id\)"),
        ("id.x", r"no column 'id.x'"),
    ):
        with pytest.raises(DatasetError, match=message):
            documents(tmp_path / "n.parquet", text_field=field)
    missing = r"n\.jsonl:1: no field 'meta.nope' \(fields: a.b, meta\)"
    with pytest.raises(DatasetError, match=missing):
        documents(lines, text_field="meta.nope")


def test_options_that_do_not_fit_the_format_are_refused():
    with pytest.raises(ValueError, match=re.escape("text_unit = 'line' applies to")):
        DatasetConfig(format="jsonl", text_unit="line")
    # The worker count never changes the training hash (`config._NOT_TRAINING`), though a
    # config sent as JSON keeps it.
    assert json.loads(DatasetConfig(workers=3).model_dump_json())["workers"] == 3
    three = PipelineConfig(dataset={"workers": 3})
    assert three.config_hash() == PipelineConfig().config_hash()


def test_bad_input_found_by_a_worker_process_is_raised_with_its_place(tmp_path):
    for i in range(4):
        write_jsonl(tmp_path / f"{i}.jsonl", [{"text": t} for t in TEXTS])
    (tmp_path / "3.jsonl").write_text('{"text": "ok"}\n{"text": 1}\n')
    corpus = DatasetConfig(
        sources=[str(tmp_path / "*.jsonl")], format="jsonl", seq_len=16, workers=2
    )
    with pytest.raises(DatasetError, match=r"3\.jsonl:2: field 'text' is a number"):
        data.shard_dataset(corpus, tmp_path / "out", unit_bytes=1)
