"""`tpupipe shard` and the shard task's progress artifact."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from flows.cli import main
from tasks.prepare import ArtifactProgress
from tests.test_data import make_corpus
from workloads import data


def test_shard_command_writes_then_finds_the_dataset(tmp_path, capsys):
    corpus = make_corpus(tmp_path)
    argv = ["shard", "--source", str(corpus), "--out", str(tmp_path / "ds"), "--seq-len", "16"]
    assert main([*argv, "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    dataset_dir = out.strip()
    assert Path(dataset_dir).parent == tmp_path / "ds"
    assert data.load_manifest(dataset_dir)["seq_len"] == 16
    assert "dataset written" in err
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == dataset_dir and "dataset found (cached)" in err


def test_an_eval_split_far_larger_than_eval_fraction_is_warned_of(tmp_path, capsys):
    # probe T: tiny.yaml's stdlib sample at eval_fraction 0.05 put 70% of its sequences in
    # eval (one large file's hash fell below it), and nothing said so.
    from workloads.packing import in_eval

    names = [f"doc{i}.txt" for i in range(200)]
    held_out = next(n for n in names if in_eval(n, 0.05))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in [n for n in names if not in_eval(n, 0.05)][:9]:
        (corpus / name).write_text(f"{name} " * 40)
    (corpus / held_out).write_text("the one large document " * 400)
    argv = ["shard", "--source", str(corpus), "--seq-len", "16", "--eval-fraction", "0.05"]
    assert main([*argv, "--out", str(tmp_path / "ds")]) == 0
    err = capsys.readouterr().err
    said = re.search(r"warning: the eval split holds (\d+)% of the dataset's tokens", err)
    assert said and int(said[1]) > 60, err
    assert "dataset.eval_fraction = 0.05" in err and "its 1 eval document(s) of 10" in err
    (corpus / held_out).write_text("a smaller document " * 4)
    assert main([*argv, "--out", str(tmp_path / "ds2")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_shard_command_imports_neither_prefect_nor_jax(tmp_path):
    # Their imports (0.6-0.8 s each) had made `tpupipe shard` of the 31 MB stdlib corpus
    # with two workers take 3.0 s end to end, against 0.75 s without them.
    from tests.helpers import heavy_modules_after

    corpus, out = str(make_corpus(tmp_path)), str(tmp_path / "ds")
    command = f"['shard', '--source', {corpus!r}, '--out', {out!r}, '--workers', '2']"
    assert heavy_modules_after(f"from flows.cli import main\nassert main({command}) == 0") == []


def test_shard_command_shows_the_warnings_of_the_projects_loggers(tmp_path):
    # Without Prefect imported, the root logger has no handler, and the project's run-log
    # handler had kept Python from printing the records no handler takes: a shard
    # deleted was rebuilt without a word (/tmp/s34/probeA/repro_shard_warnings.sh).
    import os
    import subprocess
    import sys

    corpus, out = make_corpus(tmp_path), tmp_path / "ds"
    argv = [sys.executable, "-m", "flows.cli", "shard", "--source", str(corpus), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    assert subprocess.run(argv, env=env, capture_output=True, timeout=120).returncode == 0
    (shard,) = out.glob("*/train-00000-of-*.arrayrecord")
    shard.unlink()
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    said = f"dataset shard {shard} is missing or not the size its manifest records; building"
    assert said in again.stderr and "dataset written" in again.stderr
    assert again.stderr.count(said) == 1


def test_shard_command_exit_codes_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    out = str(tmp_path / "ds")
    assert main(["shard", "--source", str(bad), "--out", out, "--format", "jsonl"]) == 1
    assert f"sharding failed: {bad}:2: no field 'text'" in capsys.readouterr().err
    assert main(["shard", "--source", str(bad), "--out", out, "--seq-len", "4"]) == 2
    assert "--seq-len: Input should be greater than or equal to 8" in capsys.readouterr().err
    assert main(["shard", "--source", str(tmp_path / "none"), "--out", out]) == 1
    assert "none' matches no file" in capsys.readouterr().err


def test_artifact_progress_spans_both_stages_and_throttles():
    sent = []

    def fake(description: str) -> ArtifactProgress:
        def update(artifact_id, progress):
            assert artifact_id == f"id-{description}"
            sent.append(progress)

        return ArtifactProgress(description, lambda **kw: f"id-{kw['description']}", update)

    bar = fake("sharding")
    for done in range(0, 1001):
        bar("tokenize", done, 1000)
    for done in range(0, 101):
        bar("write", done, 100)
    assert sent == sorted(sent) and sent[-1] == 100.0
    assert 40.0 in sent  # the end of the tokenize stage
    assert len(sent) <= 52  # at most one update per 2 percent, not one per call
    bar.finish()
    assert sent[-1] == 100.0 and sent.count(100.0) == 1
    fake("a cache hit").finish()
    assert sent[-1] == 100.0 and sent.count(100.0) == 2


def test_shard_command_names_an_out_that_is_not_a_directory_and_bad_json(tmp_path, capsys):
    corpus = make_corpus(tmp_path)
    (tmp_path / "file").write_text("")
    argv = ["shard", "--source", str(corpus), "--out", str(tmp_path / "file"), "--seq-len", "16"]
    assert main(argv) == 1
    assert f"sharding failed: the datasets directory {tmp_path / 'file'} is not a directory" in (
        capsys.readouterr().err
    )
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "ok"}\n{"text": "x", "d": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    out = tmp_path / "ds"
    assert main(["shard", "--source", str(deep), "--out", str(out), "--format", "jsonl"]) == 1
    assert f"sharding failed: {deep}:2: unreadable JSON: nested too deeply" in (
        capsys.readouterr().err
    )
    assert not out.exists()  # nothing half-written left behind


def test_a_blank_source_is_an_invalid_option_in_the_cli_and_the_config(tmp_path, capsys):
    out = str(tmp_path / "ds")
    # An unset variable (--source "$CORPUS") must not shard the current directory.
    assert main(["shard", "--source", "", "--out", out]) == 2
    assert "--source: source 1 is '', which names nothing" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text("dataset:\n  sources: [stdlib, ' ']\n")
    assert main(["validate", "--config", str(config)]) == 2
    assert "c.yaml:2: dataset.sources: source 2 is ' ', which names nothing" in (
        capsys.readouterr().err
    )
    assert not Path(out).exists()


@pytest.mark.parametrize(
    ("out", "said"),
    [
        ("", "--out is empty"),  # an unset variable: the dataset went into the working directory
        (" ", "--out is empty"),
        ("~/ds", "--out '~/ds' starts with ~, which is not expanded here"),  # it made ./~/ds
        ("$DATA/ds", "--out '$DATA/ds' holds $DATA, an environment variable"),  # ./$DATA/ds
        ("s3://b/ds", "--out 's3://b/ds': s3:// is not supported"),
        ("gs://", "--out 'gs://' names no bucket"),
    ],
)
def test_shard_command_refuses_an_out_as_storage_root_is_refused(
    tmp_path, capsys, monkeypatch, out, said
):
    corpus = make_corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["shard", "--source", str(corpus), "--out", out]) == 2
    assert capsys.readouterr().err.startswith(f"invalid options:\n  {said}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_shard_command_refuses_an_out_that_is_the_source(tmp_path, capsys):
    corpus = make_corpus(tmp_path)
    argv = ["shard", "--source", str(corpus), "--out", str(corpus), "--workers", "1"]
    assert main(argv) == 2  # an option conflict, as the README's exit codes say: not bad input
    err = capsys.readouterr().err
    assert err.startswith("invalid options:\n  --out: the datasets directory")
    assert f"datasets directory {corpus} is dataset source '{corpus}'" in err
    assert sorted(p.name for p in corpus.iterdir()) == ["doc0.txt", "doc2.txt", "doc4.txt", "sub"]


def test_a_worker_that_dies_exits_3_with_one_line(tmp_path, capsys, monkeypatch):
    import os

    import tasks.corpus
    from tests.test_shard_pool import dies_in_a_worker
    from workloads.shard_pool import worker_pool

    def shard_corpus(cfg, out, progress=None):
        with worker_pool(2) as run:
            list(run(dies_in_a_worker, [(os.getpid(), str(tmp_path / "died"))] * 20))

    monkeypatch.setattr(tasks.corpus, "shard_corpus", shard_corpus)
    corpus = make_corpus(tmp_path)
    assert main(["shard", "--source", str(corpus), "--out", str(tmp_path / "ds")]) == 3
    err = capsys.readouterr().err
    assert "sharding failed: a sharding worker process died (out of memory?); run again" in err
    assert "Traceback" not in err


class _FullDisk:
    """A spill file on a full disk: every write fails with ENOSPC."""

    def __init__(self, path):
        self.name = path

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_a_full_disk_while_tokenizing_names_the_spill_file(tmp_path, capsys, monkeypatch):
    # It gave a raw traceback ending in an OSError naming no file, exit 1 (writing shards
    # on a full disk names the shard).
    from workloads import packing

    monkeypatch.setattr(packing, "open", lambda path, mode: _FullDisk(path), raising=False)
    err = one_line_failure(tmp_path, capsys)
    spill = r"cannot write the tokenize spill file \S+/unit-00000\.\w+\.tmp: No space left"
    assert re.search(rf"sharding failed: {spill} on device\n", err), err


def one_line_failure(tmp_path, capsys) -> str:
    """`tpupipe shard` of a small corpus, which must fail with exit 1 and no traceback;
    returns what it printed on stderr."""
    out = tmp_path / "ds"
    argv = ["shard", "--source", str(make_corpus(tmp_path)), "--out", str(out), "--seq-len", "16"]
    assert main([*argv, "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


class _FullDiskWriter:
    """The ArrayRecord writer on a full disk, failing as the real one does."""

    def __init__(self, path, options):
        self.path = path

    def write(self, record):
        raise RuntimeError(f"write() failed: No space left on device; writing {self.path}")

    def close(self):
        pass


def test_a_full_disk_while_writing_shards_names_the_shard(tmp_path, capsys, monkeypatch):
    # The writer's RuntimeError went up as a raw traceback, exit 1.
    from workloads import packing

    monkeypatch.setattr(packing, "ArrayRecordWriter", _FullDiskWriter)
    err = one_line_failure(tmp_path, capsys)
    shard = r"cannot write the shard \S+/\S*(train|eval)-00000\S*: write\(\) failed: No space"
    assert re.search(rf"sharding failed: {shard} left on device", err), err
    assert not (tmp_path / "ds").exists()  # the unfinished dataset is gone: nothing trusts it


def test_a_full_disk_while_writing_the_manifest_names_it(tmp_path, capsys, monkeypatch):
    # A raw traceback ending in an OSError naming no file, exit 1, and .tmp-manifest.json,
    # .work/ and the shards were left behind.
    from workloads import manifest

    real_open = open

    def full_once_written(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        if "manifest" in str(path) and "w" in mode:
            handle.write = lambda text: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, "No space left on device")
            )
        return handle

    monkeypatch.setattr(manifest, "open", full_once_written, raising=False)
    err = one_line_failure(tmp_path, capsys)
    assert re.search(
        r"sharding failed: cannot write the manifest \S+/manifest\.json: No space", err
    )
    assert not (tmp_path / "ds").exists()  # nothing half-made is left to trust or to fill
