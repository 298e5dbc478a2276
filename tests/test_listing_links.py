"""Symlinks in a corpus that lead nowhere: dangling, pointing at themselves, in a cycle, or
through a file. A walk or glob meeting one skips it, one named outright is refused by name.

A link pointing at itself (`ln -s loop corpus/loop`) crashed `tpupipe shard` and `tpupipe
validate` with a raw `OSError: [Errno 40] Too many levels of symbolic links` for the entries
`corpus`, `corpus/**`, `corpus/*/` and `corpus/*/*.txt`, while `corpus/*` and
`file://.../corpus` skipped it, as every entry skips a dangling link.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main as cli_main
from infra.storage import source_storage
from tests.helpers import REPO
from tests.test_data import make_corpus
from workloads import data
from workloads.data import DatasetError

ENTRIES = ["", "/**", "/**/*.txt", "/*/", "/*/*.txt", "/*", "/s*/*.txt"]


def _link(at: Path, how: str) -> None:
    """A link at `at` that leads nowhere, made the way `how` says."""
    if how == "self":
        at.symlink_to(at.name)
    elif how == "cycle":
        other = at.with_name(at.name + ".other")
        at.symlink_to(other.name)
        other.symlink_to(at.name)
    elif how == "through-a-file":
        at.symlink_to(at.parent / "doc0.txt" / "x")
    else:
        at.symlink_to(at.parent / "gone")


def _keys(entry: str) -> list[str]:
    store = source_storage([entry]) if "://" in entry else None
    return [f.key for f in data.resolve_sources([entry], store)]


@pytest.mark.parametrize("how", ["self", "cycle", "through-a-file", "dangling"])
def test_walks_and_globs_skip_a_link_leading_nowhere(tmp_path, how):
    corpus = make_corpus(tmp_path)
    (corpus / "sub" / "doc0.txt").write_text("a file for the link through a file")
    entries = [f"{corpus}{tail}" for tail in ENTRIES] + [f"file://{corpus}"]
    want = {entry: _keys(entry) for entry in entries}
    # In each place a walk or a glob meets it: named as a document, as a directory.
    for where in (corpus, corpus / "sub"):
        _link(where / "bad.txt", how)
        _link(where / "baddir", how)
    for entry in entries:
        assert _keys(entry) == want[entry], entry


@pytest.mark.parametrize("how", ["self", "cycle", "through-a-file", "dangling"])
def test_a_link_leading_nowhere_named_outright_is_refused_naming_it(tmp_path, how):
    corpus = make_corpus(tmp_path)
    _link(corpus / "bad.txt", how)
    with pytest.raises(DatasetError, match=r"bad\.txt is not readable"):
        data.resolve_sources([str(corpus / "bad.txt")])
    # A glob through it matches nothing, as a glob through any file does.
    with pytest.raises(DatasetError, match=r"bad\.txt/\*' matches no file"):
        data.resolve_sources([str(corpus / "bad.txt" / "*")])


def test_validate_and_shard_read_a_corpus_holding_a_link_to_itself(tmp_path, capsys):
    corpus = make_corpus(tmp_path)
    (corpus / "loop").symlink_to("loop")
    config = str(REPO / "configs" / "tiny.yaml")
    assert cli_main(["validate", "--config", config, "--set", f"dataset.sources=[{corpus}]"]) == 0
    assert "6 local file(s)" in capsys.readouterr().out
    shard = ["shard", "--source", str(corpus), "--out", str(tmp_path / "ds"), "--workers", "1"]
    assert cli_main([*shard, "--seq-len", "16", "--num-shards", "1"]) == 0
