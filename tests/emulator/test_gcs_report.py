"""`tpupipe report`'s run lookup in gs:// on the GCS emulator: a missing run is named with
the runs there (a listing that fails is not "no runs"; see tests/test_ui_probe.py)."""

from __future__ import annotations

import pytest

from workloads.rundir import RunDir

pytestmark = pytest.mark.emulator


def test_an_unknown_run_in_gs_names_the_runs_there(gcs_client, bucket):
    from tasks.report import RunNotFound, find_run_dir

    root = f"gs://{bucket}/root"
    with pytest.raises(RunNotFound, match="no runs there"):
        find_run_dir(root, "r1")  # nothing under the root yet
    RunDir(f"{root}/runs/r1").write_status("training", step=1)
    assert find_run_dir(root, "r1") == f"{root}/runs/r1"
    with pytest.raises(RunNotFound, match=r"runs there: r1\)"):
        find_run_dir(root, "r2")
