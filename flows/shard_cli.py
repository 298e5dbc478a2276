"""`tpupipe shard`: shard a corpus to ArrayRecord without running the pipeline.

    tpupipe shard --source corpus/ --out .tpupipe/datasets
    tpupipe shard --source 'gs://bucket/c4/*.jsonl.gz' --format jsonl --text-field text \\
        --out /data/datasets --workers 8
    tpupipe shard --source corpus/ --out gs://bucket/datasets   # sharded locally, uploaded

Prints the dataset directory on stdout; exits 0 when the dataset is complete (written now or
found cached), 1 on bad input (the message names the file and line, row or offset), an
--out that is not a writable directory, or a gs:// one whose bucket does not exist or
refused the upload, 2 on invalid options, 3 when a worker process died
(out of memory?: run again); Ctrl-C, SIGTERM and SIGHUP stop it with one line (130, 143,
129). A run failed on bad input leaves nothing under --out; a killed or stopped one, or one
whose worker died, leaves its finished work for the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from flows.local_run import SIGNAL_EXITS, quiet_interrupt
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
    """Run `tpupipe shard`; returns the exit code.

    Ctrl-C, SIGTERM and SIGHUP stop it with one line on stderr, not a traceback: by then the
    worker processes are gone and the finished work is kept for the next run. SIGTERM and
    SIGHUP exit 143 and 129 (`flows.local_run` raises them as `SystemExit`); Ctrl-C's
    KeyboardInterrupt goes on up, so the process ends as Python ends on one: killed by
    SIGINT once cleaned up (130 in a shell), which also stops a shell script running it
    (bash goes on after a command that exited 130 by itself).
    """
    try:
        return _run(args)
    except KeyboardInterrupt:
        _say_stopped("Ctrl-C")
        sys.excepthook = quiet_interrupt  # the line above says it all
        raise
    except SystemExit as exc:
        if exc.code in SIGNAL_EXITS:
            _say_stopped(SIGNAL_EXITS[exc.code])
        raise


def _say_stopped(what: str) -> None:
    message = f"sharding stopped by {what}; run it again to go on (finished work is reused)"
    with contextlib.suppress(OSError):  # stderr went with the terminal or the pipe reading it
        print(message, file=sys.stderr)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Handle Ctrl-C, SIGTERM and SIGHUP only once the block is done. Their handlers, not
    their delivery, are held off: blocking them in this thread still let another thread
    (numpy's BLAS pool) take one, and its handler ran here all the same."""
    caught: list[int] = []
    held = {
        signum: signal.signal(signum, lambda got, _: caught.append(got))
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if callable(signal.getsignal(signum))  # ignored (nohup) or default: left as it is
    }
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        if caught:
            signal.raise_signal(caught[0])  # its handler runs now


def _run(args: argparse.Namespace) -> int:
    given = {field: getattr(args, field) for field in _FLAGS if getattr(args, field) is not None}
    try:
        cfg = DatasetConfig(sources=args.sources, **given)
    except ValidationError as exc:
        print("invalid options:", file=sys.stderr)
        for err in exc.errors():
            flag = _FLAGS.get(str(err["loc"][0]), "--source") if err["loc"] else "options"
            print(f"  {flag}: {err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    from workloads.config_infra import place_problem
    from workloads.listing import check_out_root
    from workloads.sources import DatasetError

    remote = args.out.startswith("gs://")
    # Option conflicts (exit 2), not bad input: checked before any source is read.
    if (problem := place_problem(args.out, "--out")) is not None:
        print(f"invalid options:\n  {problem}", file=sys.stderr)
        return 2
    try:
        if not remote:
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

    from workloads.shard_pool import WorkerDied
    from workloads.splits import lopsided_split

    # Imported only when there is work to do. Signals wait for the import: pydantic
    # serializers run in it turn a KeyboardInterrupt or SystemExit into a
    # PydanticSerializationError (a traceback, exit 1), and a SystemExit in a C
    # extension's module init (duckdb's, when this imported Prefect) aborted the
    # interpreter (SIGABRT).
    with _signals_deferred():
        from infra.gcp.clients import CredentialsError
        from tasks.corpus import shard_corpus
        from tasks.remote import out_bucket, publish_shards

    out_root, bucket = args.out, None
    if remote:  # sharded in the local cache, as a run does, then published, manifest last
        try:
            bucket = out_bucket(args.out)
        except (CredentialsError, DatasetError) as exc:
            print(f"sharding failed: {_without_block_hint(exc)}", file=sys.stderr)
            return 1
        from workloads.dataset_cache import cache_root

        out_root = cache_root()

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
            result = shard_corpus(cfg, out_root, progress=progress)
            if bucket is not None:
                result = publish_shards(result, args.out, bucket)
        except (DatasetError, WorkerDied) as exc:
            view.stop()
            print(f"sharding failed: {exc}", file=sys.stderr)
            return 3 if isinstance(exc, WorkerDied) else 1
        except CredentialsError as exc:  # gs:// sources without usable credentials
            view.stop()
            reason = _without_block_hint(exc)
            print(f"sharding failed: cannot read gs:// sources: {reason}", file=sys.stderr)
            return 1
    splits = result.manifest["splits"]
    state = "found (cached)" if result.cached else "written"
    print(
        f"dataset {state}: {splits['train']['records']} train / {splits['eval']['records']} "
        f"eval sequences of {result.manifest['seq_len']} tokens",
        file=sys.stderr,
    )
    if lopsided := lopsided_split(result.manifest, cfg.eval_fraction):
        print(f"warning: {lopsided}", file=sys.stderr)
    print(result.dataset_dir)
    return 0


def _without_block_hint(exc: BaseException) -> str:
    """The credentials error without its hint of `credentials_block`, a config field
    this command has no option for."""
    return str(exc).removesuffix(", or set credentials_block")
