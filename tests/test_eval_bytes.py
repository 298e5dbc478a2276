"""Bits per byte divides by the bytes of the text evaluation scored, not the eval split's
average bytes per token (workloads/eval_bytes.py)."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.test_data_formats import TEXTS, cfg
from workloads import data, input
from workloads.eval_bytes import ScoredBytes
from workloads.vocab import EOD_TOKEN


def test_byte_tokens_are_one_byte_each_and_eod_and_padding_none():
    counter = ScoredBytes({"kind": "bytes", "vocab_size": 257, "eod_token": EOD_TOKEN}, 9.9)
    targets = np.array([[104, 105, EOD_TOKEN, 33], [1, 2, 3, 4]])
    weights = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.float32)  # row 2: a padding row
    counter.add(targets, weights)
    assert counter.total == 3


def byte_level_bpe(path) -> str:
    """A GPT-2 style tokenizer: every byte has a token, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    tok.save(str(path))
    return str(path)


def _scored(dataset_dir: str, batches: int) -> tuple[float, int]:
    info = input.dataset_info(dataset_dir)
    counter, tokens = ScoredBytes(info.tokenizer, info.bytes_per_token), 0
    for batch in input.eval_batches(dataset_dir, 1, batches):
        counter.add(batch["targets"], batch["weights"])
        tokens += int(batch["weights"].sum())
    return counter.total, tokens


def test_a_bpe_datasets_scored_bytes_are_those_of_the_scored_text(tmp_path):
    # Prose the tokenizer was trained on (several bytes a token) in the first files, then
    # text it barely compresses: the first records are not the split's average. Bits per
    # byte over a prefix used the split's bytes per token, 17-70% off in a probe.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"a{i}.txt").write_text("lorem ipsum dolor sit amet " * 40)
        (corpus / f"b{i}.txt").write_text(
            "".join(chr(0x4E00 + (j * 7919) % 2000) for j in range(300))
        )
    tok = byte_level_bpe(tmp_path / "tokenizer.json")
    result = data.shard_dataset(cfg(corpus, tokenizer=tok, eval_fraction=0.4), tmp_path / "out")
    ev = result.manifest["splits"]["eval"]
    # Over the whole split, the decoded bytes are the split's own count (less the first
    # token, which no record predicts, and the dropped tail).
    every, _ = _scored(result.dataset_dir, 10**6)
    assert 0.995 < every / ev["bytes"] <= 1
    # Over the first record alone: the prose's bytes per token, far from the average.
    first, first_tokens = _scored(result.dataset_dir, 1)
    split_average = ev["bytes"] / ev["tokens"]
    assert first / first_tokens > 1.3 * split_average


def test_a_tokenizer_file_gone_falls_back_to_the_splits_average(tmp_path, caplog):
    entry = {"kind": "huggingface", "vocab_size": 301, "eod_token": 300,
             "path": str(tmp_path / "gone.json"), "sha256": "0" * 64}  # fmt: skip
    counter = ScoredBytes(entry, 2.5)
    counter.add(np.array([[1, 2, 300, 4]]), np.ones((1, 4), np.float32))
    assert counter.total == 10.0
    assert "average bytes per token (2.500)" in caplog.text and "gone.json" in caplog.text
