"""Sources and datasets a user may not read: `tpupipe shard` names the directory and exits 1,
with no traceback and nothing left out silently.

Each run is a `tpupipe shard` process without the permission-bypassing capabilities (root's
own included, through `setpriv`), so the file modes below mean what they mean to a user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_data import make_corpus

CAPS = "-dac_override,-dac_read_search"
TPUPIPE = Path(sys.executable).with_name("tpupipe")


def shard(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`tpupipe shard ARGS` in `cwd` as a process the file modes apply to."""
    cmd = [str(TPUPIPE), "shard", *args, "--seq-len", "16", "--num-shards", "1"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file modes do not apply")
        cmd = ["setpriv", f"--bounding-set={CAPS}", f"--inh-caps={CAPS}", *cmd]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def failed_naming(out: subprocess.CompletedProcess, message: str) -> bool:
    return out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr


@pytest.fixture()
def two_dirs(tmp_path):
    """corpus/a and corpus/b with text files; b cannot be listed (mode 300)."""
    corpus = make_corpus(tmp_path)
    for name in ("a", "b"):
        (corpus / name).mkdir()
        for i in range(6):
            (corpus / name / f"doc{i}.txt").write_text(f"{name}{i} " * 300)
    (corpus / "b").chmod(0o300)
    yield corpus
    (corpus / "b").chmod(0o700)


def test_a_glob_through_an_unreadable_directory_is_refused_naming_it(tmp_path, two_dirs):
    # `glob` would skip corpus/b and shard corpus/a alone, losing b's files without a word.
    for pattern in ("corpus/*/*.txt", "corpus/b/*.txt"):
        out = shard(tmp_path, "--source", pattern, "--out", "ds")
        assert failed_naming(out, "dataset source directory corpus/b is not readable"), out
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())
    # A pattern that does not reach it still shards.
    assert shard(tmp_path, "--source", "corpus/a/*.txt", "--out", "ds").returncode == 0


def test_a_dataset_directory_that_cannot_be_read_is_named(tmp_path):
    make_corpus(tmp_path)
    first = shard(tmp_path, "--source", "corpus", "--out", "ds")
    assert first.returncode == 0, first.stderr
    dataset = Path(first.stdout.strip().splitlines()[-1])
    dataset = dataset if dataset.is_absolute() else tmp_path / dataset
    dataset.chmod(0o000)  # as another user's run with a umask of 077 leaves it
    try:
        out = shard(tmp_path, "--source", "corpus", "--out", "ds")
    finally:
        dataset.chmod(0o755)
    assert failed_naming(out, f"cannot read the dataset directory ds/{dataset.name}"), out
    assert "Permission denied" in out.stderr


def test_a_link_into_a_directory_that_cannot_be_searched_is_refused_naming_it(tmp_path):
    # A walk gave a raw PermissionError traceback for it, and `corpus/*` left it out of the
    # dataset without a word (`os.path.isfile` answered False).
    make_corpus(tmp_path)
    private = tmp_path / "private"
    private.mkdir()
    (private / "x.txt").write_text("private " * 300)
    (tmp_path / "corpus" / "x.txt").symlink_to(private / "x.txt")
    private.chmod(0o600)  # listable, not searchable: the link's target cannot be looked at
    try:
        for entry in ("corpus", "corpus/*", "corpus/**/*.txt"):
            out = shard(tmp_path, "--source", entry, "--out", "ds")
            assert failed_naming(out, "x.txt is not readable: Permission denied"), (entry, out)
    finally:
        private.chmod(0o700)
