"""Planning a sharding run: units of work over the source files, and each split's stream.

A split's token stream is the concatenation, in unit order, of the units' spill files for
that split. Its records are cut into shards of contiguous blocks (`train-0000i-of-0000N`,
one `eval` shard), so every shard's content follows from the totals alone, and shards can be
written in parallel.
"""

from __future__ import annotations

from workloads.config import DatasetConfig
from workloads.documents import ReadOptions
from workloads.manifest import SPLITS
from workloads.packing import ShardJob, UnitJob
from workloads.sources import DatasetError, SourceFile, SourceStore
from workloads.tokens import TokenizerSpec

MIN_UNIT_BYTES, MAX_UNIT_BYTES, UNITS_TARGET = 1 << 20, 256 << 20, 32


def plan_units(
    files: list[SourceFile],
    cfg: DatasetConfig,
    tokenizer: TokenizerSpec,
    work: str,
    store: SourceStore | None,
    unit_bytes: int | None,
) -> list[UnitJob]:
    """Group the files, in order, into units of about `unit_bytes` (default: 1/32 of the
    corpus, clamped to 1-256 MiB); a unit is one worker's job."""
    if unit_bytes is None:
        total = sum(f.size for f in files)
        unit_bytes = min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // UNITS_TARGET))
    groups: list[list[SourceFile]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size >= unit_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += f.size
    read = ReadOptions.of(cfg)
    return [
        UnitJob(i, tuple(g), read, cfg.eval_fraction, tokenizer, work, store)
        for i, g in enumerate(groups)
    ]


def plan_splits(
    units: list[UnitJob],
    metas: list[dict],
    cfg: DatasetConfig,
    tokenizer: TokenizerSpec,
    directory: str,
) -> dict:
    """Each split's stream (spill-file parts in unit order), totals, and shard jobs.

    Raises:
        DatasetError: No text at all, fewer than two documents, or a split too short for
            its shards.
    """
    splits = {}
    for split in SPLITS:
        parts = [
            (str(u.path(split)), 0, m[split]["tokens"])
            for u, m in zip(units, metas, strict=True)
            if m[split]["tokens"]
        ]
        totals = {k: sum(m[split][k] for m in metas) for k in ("tokens", "documents", "bytes")}
        last = next((m[split] for m in reversed(metas) if m[split]["documents"]), None)
        splits[split] = {"parts": parts, "last": last, **totals}
    docs = splits["train"]["documents"] + splits["eval"]["documents"]
    if not splits["train"]["bytes"] + splits["eval"]["bytes"]:
        # Else the shards would hold nothing but end-of-document ids, and look fine.
        raise DatasetError(
            f"dataset sources {cfg.sources!r} contain no text: {docs} document(s), all empty"
        )
    if docs < 2:
        # max_bytes keeps whole files: a small one can leave a single document.
        cut = f" within dataset.max_bytes = {cfg.max_bytes}" if cfg.max_bytes else ""
        raise DatasetError(
            f"dataset sources {cfg.sources!r} give {docs} document(s){cut}; train and eval "
            "each need at least one"
        )
    for empty, other in (("eval", "train"), ("train", "eval")):
        if not splits[empty]["documents"]:
            if not splits[other]["last"]["last_bytes"]:
                # The user put nothing empty in this split: the move did, and the check
                # below said "the eval split's 1 document(s) are all empty".
                raise DatasetError(
                    f"no document goes to {empty} by its key's hash at eval_fraction="
                    f"{cfg.eval_fraction}, and the last {other} document, which then moves "
                    f"there, is empty: raise eval_fraction, or remove the empty document(s) "
                    "at the end of the sources"
                )
            move_last_document(splits[other], splits[empty])
    for split in SPLITS:
        s = splits[split]
        if not s["bytes"]:
            # Its sequences would be end-of-document ids only: training on them teaches
            # nothing, and evaluation divided by zero bytes after the whole run had trained.
            raise DatasetError(
                f"the {split} split's {s['documents']} document(s) are all empty (no text): "
                "remove the empty documents from the sources, or change eval_fraction so "
                f"the split gets some text (eval_fraction={cfg.eval_fraction})"
            )
    for split, shards in (("train", cfg.num_shards), ("eval", 1)):
        s = splits[split]
        records = max(0, (s["tokens"] - 1) // cfg.seq_len)
        if records < shards:
            # The eval split always has one shard: num_shards does not change its needs.
            advice = (
                f"(num_shards={cfg.num_shards}); add text, lower seq_len or lower num_shards"
                if split == "train"
                else f"(eval_fraction={cfg.eval_fraction}); add text, lower seq_len or raise "
                "eval_fraction"
            )
            # Both splits' sizes: documents go to eval by a hash of their key, so with
            # few documents one large one can take most of the text either way.
            sizes = ", ".join(
                f"{name} {splits[name]['tokens']} tokens in {splits[name]['documents']} document(s)"
                for name in SPLITS
            )
            raise DatasetError(
                f"the {split} split has {records} sequence(s) of seq_len={cfg.seq_len}, "
                f"fewer than its {shards} shard(s) {advice} ({sizes})"
            )
        bounds = [records * i // shards for i in range(shards + 1)]
        s["records"] = records
        s["jobs"] = [
            ShardJob(
                directory=directory,
                name=f"{split}-{i:05d}-of-{shards:05d}.arrayrecord",
                parts=tuple(s["parts"]),
                dtype=tokenizer.dtype,
                seq_len=cfg.seq_len,
                first=bounds[i],
                count=bounds[i + 1] - bounds[i],
            )
            for i in range(shards)
        ]
    return splits


def move_last_document(src: dict, dst: dict) -> None:
    """Move the last document of split `src` to the end of split `dst` (no re-reading: the
    unit summary says how many tokens and bytes it has)."""
    path, offset, length = src["parts"][-1]
    n, nbytes = src["last"]["last_tokens"], src["last"]["last_bytes"]
    src["parts"][-1] = (path, offset, length - n)
    dst["parts"].append((path, offset + length - n, n))
    for key, value in (("tokens", n), ("documents", 1), ("bytes", nbytes)):
        src[key] -= value
        dst[key] += value


def lopsided_split(manifest: dict, eval_fraction: float) -> str | None:
    """A warning when the eval split holds far more of a dataset's tokens than
    `eval_fraction` asked for (over 3x it, and 10 points above), else None.

    Why: documents go to eval whole, by a hash of their key, so a corpus of few documents,
    one of them large, can put most of its text in eval. `tiny.yaml`'s stdlib sample at
    eval_fraction 0.05 put 70% of its sequences there, and nothing said so: the run
    trained on a third of what the user meant it to.
    """
    splits = manifest["splits"]
    tokens = {split: splits[split]["tokens"] for split in SPLITS}
    share = tokens["eval"] / (sum(tokens.values()) or 1)
    if share <= max(3 * eval_fraction, eval_fraction + 0.1):
        return None
    documents = sum(splits[split]["documents"] for split in SPLITS)
    return (
        f"the eval split holds {share:.0%} of the dataset's tokens ({splits['eval']['records']} "
        f"eval / {splits['train']['records']} train sequences) at dataset.eval_fraction = "
        f"{eval_fraction:g}: documents go to eval whole (by a hash of their key, or the "
        "last one when no key falls below the fraction), and its "
        f"{splits['eval']['documents']} eval document(s) of {documents} are that large. For "
        "a split nearer the fraction, split large files into documents (a document per "
        "line or JSONL record) or give more of them (a larger dataset.max_bytes)"
    )


def split_entries(splits: dict, seq_len: int) -> dict:
    """The manifest's `splits`: shards, counts and packing figures of each split."""
    out = {}
    for split in SPLITS:
        s = splits[split]
        slots = s["records"] * seq_len
        out[split] = {
            "shards": s["shards"],
            "records": s["records"],
            "documents": s["documents"],
            "tokens": s["tokens"],  # EOD included
            "bytes": s["bytes"],  # UTF-8 text: bits per byte divides by this
            # Documents are packed back to back, so every target slot holds a real token
            # (padding 0); only the stream's tail beyond the last full record is dropped.
            "packing": {
                "slots": slots,
                "real_tokens": slots,
                "efficiency": 1.0 if slots else 0.0,
                "dropped_tokens": s["tokens"] - 1 - slots,
            },
        }
    return out
