"""How a landing treats the rows of its run that are already stored: the same in every sink.

A completed run's landing is the run's result. Its `runs` row and eval rows replace the
stored ones, and stored eval rows it lacks go. Its step rows replace the stored rows of the
same steps, and stored step rows past its final step go; a stored step at or before its
final step that it lacks is kept. Why: a run's step rows come from its run directory's
`metrics.jsonl`, where every step up to the final one has a row once the run finished
(a step trained again after a resume is written again). A landing lacking some is reading
a damaged file (cut short, rewritten, lost with a disk), and the stored rows are the ones
that file held when they landed. Making the stored rows exactly the landing's deleted them:
a finished run rerun over a `metrics.jsonl` cut to 5 lines lost 7 of its 12 step rows. For
the same reason the `runs` row keeps its stored `train_loss_first` and `train_loss_last`
(`RunRow.local_fields`) when the landing has no row for the first or final step.

A failed run's landing (an error, Ctrl-C, SIGTERM) records how this invocation ended, and
only adds and updates: step and eval rows it does not have stay, and the `runs` row keeps
the stored results (`RunRow.result_fields`) it has no value for. A rerun of a finished run
that is stopped before it evaluates again thus leaves the run's evaluation and summary
numbers as they were, with its row failed and the signal as its error, as its exit code
says; running it again lands it completed.

Either way the `runs` row keeps the earliest `started_at` (`RunRow.earliest_fields`): every
invocation of a run name lands its row again. Except a `fresh` landing, of a run whose
directory was made anew (deleted, then run again under the same name: see
`tasks.run_owner.earlier_life`): its rows replace every stored row of the run, which were
another run's, and nothing of them is kept, `started_at` included.
"""

from __future__ import annotations

from typing import NamedTuple

from infra.metrics.rows import RunRow, StepMetricRow, TableRow


class LandingRule(NamedTuple):
    """What one landing does to the stored rows of its run in one table."""

    # Stored rows of the run that the landing does not have are deleted when they match
    # this: "all", "none", or an int n for "step > n".
    deletes: str | int
    # Columns a NULL in the new row does not overwrite: the stored value stays.
    kept: tuple[str, ...]
    # Whether the model's `earliest_fields` keep the stored value when it is earlier.
    earliest: bool = True

    def where(self, prefix: str = "") -> str | None:
        """The delete's SQL condition on a stored row (`prefix`: its table alias and a dot),
        or None when nothing is deleted."""
        if self.deletes == "none":
            return None
        if self.deletes == "all":
            return "TRUE"
        return f"{prefix}step > {int(self.deletes)}"


def landing_rule(model: type[TableRow], run: RunRow, fresh: bool = False) -> LandingRule:
    """The rule for landing `run`'s rows of `model`'s table (see the module docstring)."""
    if fresh:
        return LandingRule("all", (), earliest=False)
    if run.status != "completed":
        return LandingRule("none", model.result_fields)
    if model is StepMetricRow:
        # A completed row without a final step (direct sink users) cannot say which stored
        # steps lie past the run's end: it deletes none.
        return LandingRule("none" if run.final_step is None else run.final_step, ())
    return LandingRule("all", model.local_fields)
