"""`tpupipe shard`: shard a corpus to ArrayRecord without running the pipeline.

    tpupipe shard --source corpus/ --out .tpupipe/datasets
    tpupipe shard --source 'gs://bucket/c4/*.jsonl.gz' --format jsonl --text-field text \\
        --out /data/datasets --workers 8

Prints the dataset directory on stdout; exits 0 when the dataset is complete (written now or
found cached), 1 on bad input (the message names the file and line, row or offset) or an
--out that is not a writable directory, 2 on invalid options, 3 when a worker process died
(out of memory?: run again). A run failed on bad input leaves nothing under --out; a killed
one, or one whose worker died, leaves its finished work for the next run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from workloads.config import DatasetConfig

# Command-line flag -> DatasetConfig field, for the options given on the command line.
_FLAGS = {
    "format": "--format",
    "text_unit": "--text-unit",
    "text_field": "--text-field",
    "tokenizer": "--tokenizer",
    "errors": "--errors",
    "seq_len": "--seq-len",
    "num_shards": "--num-shards",
    "eval_fraction": "--eval-fraction",
    "max_bytes": "--max-bytes",
    "workers": "--workers",
}


def add_parser(sub: Any) -> None:
    """Add the `shard` subcommand to the `tpupipe` subparsers."""
    cmd = sub.add_parser("shard", help="shard a corpus to ArrayRecord (cached by fingerprint)")
    cmd.add_argument(
        "--source",
        dest="sources",
        action="append",
        required=True,
        metavar="PATH",
        help="file, directory, glob, gs:// prefix or 'stdlib' (repeatable)",
    )
    cmd.add_argument(
        "--out", required=True, help="datasets directory; the dataset goes in OUT/<fingerprint>/"
    )
    cmd.add_argument(
        "--format",
        choices=["auto", "text", "jsonl", "parquet"],
        help="auto (default): by each file's name (.jsonl/.ndjson[.gz]: jsonl, "
        ".parquet/.pq: parquet, else text)",
    )
    cmd.add_argument(
        "--text-unit",
        choices=["file", "line"],
        help="text files: one document per file (default) or per line",
    )
    cmd.add_argument("--text-field", metavar="NAME", help="JSONL field / Parquet column")
    cmd.add_argument("--tokenizer", metavar="FILE", help="Hugging Face tokenizer.json")
    cmd.add_argument("--errors", choices=["strict", "replace"], help="invalid UTF-8 handling")
    cmd.add_argument("--seq-len", type=int)
    cmd.add_argument("--num-shards", type=int)
    cmd.add_argument("--eval-fraction", type=float)
    cmd.add_argument("--max-bytes", type=int)
    cmd.add_argument(
        "--workers",
        type=int,
        help="processes that shard, this one included (default: one per CPU; this one alone "
        "under 32 MiB)",
    )


def run(args: argparse.Namespace) -> int:
    """Run `tpupipe shard`; returns the exit code."""
    given = {field: getattr(args, field) for field in _FLAGS if getattr(args, field) is not None}
    try:
        cfg = DatasetConfig(sources=args.sources, **given)
    except ValidationError as exc:
        print("invalid options:", file=sys.stderr)
        for err in exc.errors():
            flag = _FLAGS.get(str(err["loc"][0]), "--source") if err["loc"] else "options"
            print(f"  {flag}: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    from workloads.listing import check_out_root
    from workloads.sources import DatasetError

    try:  # an option conflict (exit 2), not bad input: checked before any source is read
        check_out_root(cfg.sources, args.out)
    except DatasetError as exc:
        print(f"invalid options:\n  --out: {exc}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    # Imports Prefect (~2 s): only when there is work to do.
    from infra.gcp.clients import CredentialsError
    from tasks.prepare import shard_corpus
    from workloads.shard_pool import WorkerDied

    bars: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        TaskProgressColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    ) as view:

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                unit = "bytes" if stage == "tokenize" else "records"
                bars[stage] = view.add_task(f"{stage} ({unit})", total=total)
            view.update(bars[stage], completed=done, total=total)

        try:
            result = shard_corpus(cfg, args.out, progress=progress)
        except (DatasetError, WorkerDied) as exc:
            view.stop()
            print(f"sharding failed: {exc}", file=sys.stderr)
            return 3 if isinstance(exc, WorkerDied) else 1
        except CredentialsError as exc:  # gs:// sources without usable credentials
            view.stop()
            print(f"sharding failed: cannot read gs:// sources: {exc}", file=sys.stderr)
            return 1
    splits = result.manifest["splits"]
    state = "found (cached)" if result.cached else "written"
    print(
        f"dataset {state}: {splits['train']['records']} train / {splits['eval']['records']} "
        f"eval sequences of {result.manifest['seq_len']} tokens",
        file=sys.stderr,
    )
    print(result.dataset_dir)
    return 0
