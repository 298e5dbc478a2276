"""Local workload processes get an allocator that does not fault XLA's buffers in anew."""

from __future__ import annotations

import json
import sys
import time

import pytest

from infra.slices import LocalSliceProvider, SliceSpec, SliceState
from infra.slices.allocator import allocator_env, find_tcmalloc


@pytest.fixture
def libdir(tmp_path):
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"\x7fELF")
    return [str(tmp_path / "missing"), str(tmp_path)]


def test_tcmalloc_is_preloaded_when_installed(libdir):
    env = allocator_env({"PATH": "/bin"}, dirs=libdir)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{libdir[1]}/libtcmalloc_minimal.so.4"}


def test_without_tcmalloc_glibc_uses_huge_pages_and_keeps_other_tunables(tmp_path):
    dirs = [str(tmp_path)]
    assert allocator_env({}, dirs=dirs)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert allocator_env(mine, dirs=dirs)["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's choice stands
    assert allocator_env(chosen, dirs=dirs) == chosen


def test_the_users_preload_or_system_choice_is_left_alone(libdir):
    theirs = {"LD_PRELOAD": "/opt/jemalloc.so"}
    assert allocator_env(theirs, dirs=libdir) == theirs
    system = {"TPUPIPE_MALLOC": "system"}
    assert allocator_env(system, dirs=libdir) == system
    with pytest.raises(ValueError, match="TPUPIPE_MALLOC='tc'"):
        allocator_env({"TPUPIPE_MALLOC": "tc"}, dirs=libdir)


@pytest.mark.skipif(find_tcmalloc() is None, reason="libtcmalloc-minimal4 is not installed")
def test_a_local_slices_workload_runs_on_tcmalloc(tmp_path):
    provider = LocalSliceProvider(tmp_path / "registry")
    out = tmp_path / "maps.json"
    code = (
        "import json, sys; maps = open('/proc/self/maps').read();"
        f"json.dump('tcmalloc' in maps, open({str(out)!r}, 'w'))"
    )
    provider.create(
        SliceSpec(
            name="alloc",
            devices=1,
            command=[sys.executable, "-c", code],
            log_path=str(tmp_path / "alloc.log"),
        )
    )
    while provider.status("alloc").state is SliceState.READY:
        time.sleep(0.02)
    assert provider.status("alloc").exit_code == 0
    assert json.loads(out.read_text()) is True
