"""Moving a checkpoint step a run must not trust out of `checkpoints/`, never deleting it:
to `quarantine/<step>-<time>/`, with the reason beside it, on local disks, across
filesystems and on GCS (re-exported by workloads/checkpoint.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time

from etils import epath

from workloads.ckpt_manager import checkpoint_dir

# The logger these lines had before the split, so their records are unchanged.
log = logging.getLogger("workloads.checkpoint")

QUARANTINED = "QUARANTINED.txt"  # the reason, in a quarantined step's folder
COMMIT_MARKER = "commit_success.txt"  # what marks a step committed on GCS (orbax)


def quarantine(run_dir: str, step: int, reason: str) -> epath.Path:
    """Move a checkpoint a run must not trust to `quarantine/<step>-<time>/`, with the
    reason in `QUARANTINED.txt` there.

    Never deletes: a person may want to look at what went wrong.
    """
    source = checkpoint_dir(run_dir) / str(step)
    target = epath.Path(run_dir) / "quarantine" / f"{step}-{int(time.time())}"
    if "://" not in str(run_dir):
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(source, target)  # atomic
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            _move_across_filesystems(source, target, reason)
        else:
            (target / QUARANTINED).write_text(reason + "\n")
    else:
        # GCS has no folders: a folder exists once an object is in it (moving a step to a
        # quarantine/ that did not exist failed, and every rerun failed on the same step),
        # and a rename is a copy and a delete per object anyway. The commit marker moves
        # first, so a move cut short leaves a step orbax no longer counts as committed.
        (target / QUARANTINED).write_text(reason + "\n")
        for child in sorted(source.iterdir(), key=lambda p: p.name != COMMIT_MARKER):
            child.rename(target / child.name)
    log.warning("checkpoint step %d quarantined to %s: %s", step, target, reason)
    return target


def _move_across_filesystems(source: epath.Path, target: epath.Path, reason: str) -> None:
    """Move a step's folder to `target` on another filesystem (`checkpoints/` a symlink to
    another mount made every rename fail with EXDEV, so the bad step was never moved and
    every rerun failed on it), so that no moment shows half a checkpoint as a whole one.

    The copy, with its reason, is made under a hidden name beside `target` and renamed to
    it once whole: a copy cut short is never a quarantined step, and the step stays whole
    in `checkpoints/`, quarantined again by the next run. Only then is the step renamed
    out of `checkpoints/` (on its own filesystem: atomic) to a hidden name orbax counts
    as no step, and deleted there: a deletion cut short leaves that folder, never a step.
    """
    for stale in target.parent.glob(f".{source.name}-*.partial"):  # copies cut short
        shutil.rmtree(stale, ignore_errors=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copytree(source, partial, symlinks=True)
    (partial / QUARANTINED).write_text(reason + "\n")
    os.rename(partial, target)
    moved_out = source.with_name(f".{source.name}.quarantined-{target.name}")
    os.rename(source, moved_out)
    try:
        shutil.rmtree(moved_out)
    except OSError as exc:  # the step is out of checkpoints/ and copied: nothing is at risk
        log.warning("could not delete %s, a copy of %s: %s", moved_out, target, exc)
