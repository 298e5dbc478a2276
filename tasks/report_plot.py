"""The report's PNG: the loss curve above, the attempt timeline below (one bar per attempt,
coloured by goodput bucket), so where the time and the money went is visible at a glance."""

from __future__ import annotations

import io

from etils import epath

from tasks.report import REPORT_PNG, RunReport, origin
from workloads.rundir import write_bytes_atomic

# One colour per bucket: productive green, waste in warm colours, set-up in cool ones.
COLOURS = {
    "provisioning": "#9ecae1",
    "startup": "#3182bd",
    "restore": "#756bb1",
    "productive": "#31a354",
    "lost": "#de2d26",
    "teardown": "#fd8d3c",
}


def write_report_png(report: RunReport, path: str | None = None) -> str:
    """Draw the report's PNG and write it (local or gs://).

    Args:
        report: the run's report (`tasks.report.load_report`).
        path: where to write it (default: `report.png` in the run directory).

    Returns:
        The path written.
    """
    # Imported here: matplotlib costs a second, and only this command draws.
    import matplotlib

    matplotlib.use("Agg")  # no display needed, on a laptop or a worker
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.5), dpi=100, layout="constrained")
    loss_ax, time_ax = fig.subplots(2, 1, height_ratios=(3, 2))
    _loss(loss_ax, report)
    _timeline(time_ax, report)
    good, ledger = report.ledger.goodput, report.ledger
    ratio = "n/a" if good.goodput is None else f"{good.goodput:.1%}"
    # "\$": a bare "$" pair would start matplotlib's math text.
    cost = "not priced" if ledger.cost_usd is None else f"\\${ledger.cost_usd:.2f}"
    per_m = ledger.cost_per_million_tokens
    per_m_text = "" if per_m is None else f", \\${per_m:.2f} per 1M training tokens"
    fig.suptitle(f"{report.run_id}: goodput {ratio}, {cost}{per_m_text}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    out = epath.Path(path) if path else epath.Path(report.run_dir) / REPORT_PNG
    write_bytes_atomic(out, buffer.getvalue())  # a full disk left a 0-byte report.png
    return str(out)


def _loss(ax, report: RunReport) -> None:
    rows = sorted((m for m in report.metrics if m.get("loss") is not None), key=lambda m: m["step"])
    if rows:
        ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], label="train loss")
    ev = report.evaluation or {}
    if ev.get("loss") is not None:
        ax.scatter([ev["step"]], [ev["loss"]], color="C3", zorder=3, label="eval loss")
    if not rows and ev.get("loss") is None:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend()
    ax.set(xlabel="step", ylabel="cross-entropy loss")
    ax.grid(alpha=0.3)


def _timeline(ax, report: RunReport) -> None:
    attempts = report.ledger.attempts
    if not attempts:
        ax.text(0.5, 0.5, "no attempts recorded", ha="center", va="center", transform=ax.transAxes)
        return
    t0 = origin(report.ledger)
    for a in attempts:
        y = a.timeline.attempt
        for segment in a.timeline.segments:
            if segment.seconds > 0:
                ax.broken_barh(
                    [(segment.start - t0, segment.seconds)],
                    (y - 0.35, 0.7),
                    facecolors=COLOURS[segment.bucket],
                )
        if a.billed_from is not None:  # the billing window, as a rule under the bar
            ax.hlines(y + 0.42, a.billed_from - t0, a.billed_to - t0, colors="black", lw=1.5)
        end = max((s.end for s in a.timeline.segments), default=a.timeline.ended)
        ax.annotate(
            a.timeline.outcome or "running?",
            (end - t0, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    handles = [
        _patch(colour, bucket)
        for bucket, colour in COLOURS.items()
        if any(s.bucket == bucket for a in attempts for s in a.timeline.segments)
    ]
    handles.append(_rule("billed"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=4, fontsize=8)
    numbers = [a.timeline.attempt for a in attempts]
    ax.set_yticks(numbers)
    ax.set_ylim(min(numbers) - 0.6, max(numbers) + 0.7)
    ax.invert_yaxis()  # attempt 1 on top
    ax.set(xlabel="seconds from the first provisioning request", ylabel="attempt")
    ax.grid(axis="x", alpha=0.3)


def _patch(colour: str, label: str):
    """A legend entry of one colour."""
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label)


def _rule(label: str):
    """A legend entry for the billing window's rule."""
    from matplotlib.lines import Line2D

    return Line2D([], [], color="black", lw=1.5, label=label)
