"""The cost ledger of a run: chip-hours and dollars per attempt, next to goodput, and what
the money bought (tokens trained, cost per million of them). Pure functions over the
events of `events.jsonl`; no Prefect.

Billing window of an attempt, in chip-hours = chips × window ÷ 3600:

- It starts when a node can exist. For on-demand and reserved slices that is the create
  request that produced the slice (the last `provision_requested` before
  `provision_ready`): the node's creation and the wait for READY are counted, so a slow
  create weighs on the run's cost. For spot slices it is `provision_ready`: a spot request
  is a queued resource, which has no node and costs nothing while it waits for capacity,
  and READY is the ledger's first sign of the node. So queued spot waits are never billed
  (they still count as provisioning badput, in time).
- It ends when the attempt deleted its slice (`deleted`), so teardown lag is billed. A
  slice the attempt left standing (its orchestrator was killed, or its delete failed) is
  billed until a later orchestrator deleted it: a rerun's delete before it creates its
  slice, the next attempt's, the flow's teardown (of a finished run too), its crash and
  cancellation hooks, or the reaper (`tasks.teardown`) records `leftover_deleted` with the
  attempt's number, read from the slice's `attempt` label, and the slice's state; when that
  stood for a live node (READY or CREATING; TERMINATED too: a local slice's workload had
  ended, and a TPU node whose workload ended stays READY until deleted; a stopped gcp
  node, also TERMINATED, errs high) the window ends there, past `attempt_ended` (the node
  ran on after the attempt ended); the later of the two when an attempt has both. A copy
  found PREEMPTED was billed no more since a time nobody saw: its window ends with the
  attempt, and errs low by any time the node stayed READY after it. An attempt with
  neither (its slice was already gone; the reaper, with another storage root than the
  run's, deleted it: it knows a slice's run id and root hash, so it finds only the run
  directories under its own root; or the slice has no `attempt` label, made by an older
  version) is billed to its end (`attempt_ended`, else its last event), and errs low by
  the node's time after that.
- A node that came up after its orchestrator died (killed during the create, or while a
  spot request waited) has no `provision_ready`; deleted READY by a later orchestrator,
  it is billed from the request (on demand) or its workload's first event (spot) to that
  deletion.
- Failed creates and the back-off between them bill nothing: no node existed.

Chips and price are the attempt's own: it records them when it asks for its slice
(`tasks.pricing.attempt_pricing`, on `provision_requested`), since a rerun may run on
another slice, priced otherwise, and must not re-price the attempts before it. An attempt
recorded by an older version, without that record, is billed at the run's current config.

Google bills Cloud TPU "while your TPU node is in a READY state" (cloud.google.com/tpu/
pricing), so the ledger errs high where it counts a node that may not be READY yet or any
more (an on-demand node being created; a preempted node until it is deleted, a left one
too); it never counts time when no node can exist. It errs low only on a node that no
orchestrator of the run deleted (see above). Tokens trained are the steps that count (the
goodput's productive steps: work a checkpoint kept, each step once) × global batch ×
sequence length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tasks.attempts import LEFTOVER_DELETED, by_attempt, timed
from tasks.goodput import AttemptTimeline, Goodput, attempt_timelines, compute_goodput
from tasks.pricing import Price, recorded_price
from workloads.config import PipelineConfig

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class AttemptCost:
    """One attempt's timeline with its billing window, chip-hours and cost."""

    timeline: AttemptTimeline
    price: Price  # what the attempt ran on and is charged at (chips, USD per chip-hour)
    billed_from: float | None  # None: no slice was ever ready in this attempt
    billed_to: float | None
    chip_hours: float
    cost_usd: float | None  # None: the run is not priced

    @property
    def billed_s(self) -> float:
        """Seconds of the billing window."""
        if self.billed_from is None or self.billed_to is None:
            return 0.0
        return self.billed_to - self.billed_from


@dataclass(frozen=True)
class Ledger:
    """A run's cost next to its goodput. `price` is the last attempt's (the config's when
    there is none); `chip_hours` and `cost_usd` sum each attempt at its own price."""

    price: Price
    goodput: Goodput
    attempts: list[AttemptCost]
    tokens_per_step: int
    steps: int  # optimizer steps that count
    chip_hours: float
    cost_usd: float | None
    first_event: float | None = None  # epoch seconds of the run's first recorded event

    @property
    def tokens(self) -> int:
        """Training tokens the kept steps consumed."""
        return self.steps * self.tokens_per_step

    @property
    def cost_per_million_tokens(self) -> float | None:
        """USD per 1M training tokens (None when not priced or nothing was kept)."""
        if self.cost_usd is None or self.tokens <= 0:
            return None
        return self.cost_usd / self.tokens * 1e6


def billing_window(events: list[dict], capacity: str) -> tuple[float, float] | None:
    """(start, end) epoch seconds one attempt's slice is billed for; see the module
    docstring. None when no slice became ready in the attempt.

    Args:
        events: the events of one attempt, in time order (its `leftover_deleted` too).
        capacity: `slice.capacity` ('on-demand', 'spot' or 'reserved').
    """
    ready = [e["time"] for e in events if e["event"] == "provision_ready"]
    if not ready:
        return _unseen_node_window(events, capacity)
    if capacity == "spot":
        start = ready[-1]
    else:
        requests = [
            e["time"]
            for e in events
            if e["event"] == "provision_requested" and e["time"] <= ready[-1]
        ]
        start = requests[-1] if requests else ready[-1]
    # The last of each kind; a leftover found no longer READY had stopped billing before
    # its deletion (see the module docstring).
    kinds = {e["event"]: e["time"] for e in events if _billed_until(e)}
    # The later deletion: a copy left after the attempt's own delete ran on until then.
    deletions = [kinds[k] for k in ("deleted", LEFTOVER_DELETED) if k in kinds]
    end = max(deletions, default=kinds.get("attempt_ended", timed(events)[-1]["time"]))
    return start, max(end, start)


def _unseen_node_window(events: list[dict], capacity: str) -> tuple[float, float] | None:
    """The window of a node that came up after its orchestrator died (killed while its
    create ran, or while its spot request was queued), so no `provision_ready` says when,
    and that a later orchestrator deleted READY: on demand from the request, spot from the
    node's workload's first event (the node was READY by then; none: nothing to bill).
    None when no such deletion says a node existed."""
    left = [e["time"] for e in events if e["event"] == LEFTOVER_DELETED and _billed_until(e)]
    if not left:
        return None
    if capacity == "spot":
        seen = [e["time"] for e in timed(events) if e.get("source") == "workload"]
    else:
        seen = [e["time"] for e in events if e["event"] == "provision_requested"]
    start = (seen[0] if capacity == "spot" else seen[-1]) if seen else left[-1]
    return start, max(left[-1], start)


# States of a left copy that stood for a billed node until its deletion: one being created
# or READY, and TERMINATED, which is how a local slice says its workload ended: a TPU node
# whose workload ended (killed with its orchestrator, or finished) stays READY, billed,
# until it is deleted. A PREEMPTED node was not billed any more.
BILLED_LEFTOVER_STATES = frozenset({"READY", "CREATING", "TERMINATED"})


def _billed_until(event: dict) -> bool:
    """Whether an event can end its attempt's billing window: any but a `leftover_deleted`
    of a copy no longer billed (one without a state, from before it was recorded, can)."""
    if event["event"] != LEFTOVER_DELETED:
        return True
    return event.get("state", "READY") in BILLED_LEFTOVER_STATES


def compute_ledger(
    events: list[dict],
    price: Price,
    tokens_per_step: int,
    price_of: Callable[[dict], Price] = recorded_price,
) -> Ledger:
    """The run's ledger from its events.

    Args:
        events: every event of the run (any order).
        price: the price of an attempt that recorded none (an older version's), with the
            chip count: the run's config's (`tasks.pricing.price_for`).
        tokens_per_step: training tokens per optimizer step (global batch × seq_len).
        price_of: an attempt's price from the event that recorded it (default: the price
            recorded; `tasks.pricing.reprice` to re-price the run with another cost).

    Returns:
        Per-attempt billing windows, chip-hours and cost; run totals; tokens that count.
    """
    groups = by_attempt(events)
    attempts = []
    for line in attempt_timelines(events):
        group = groups[line.attempt]
        record = next((e for e in group if "price" in e), None)
        own = price if record is None else price_of(record)
        window = billing_window(group, own.capacity)
        seconds = window[1] - window[0] if window else 0.0
        chip_hours = own.chips * seconds / SECONDS_PER_HOUR
        usd = own.usd_per_chip_hour
        attempts.append(
            AttemptCost(
                timeline=line,
                price=own,
                billed_from=window[0] if window else None,
                billed_to=window[1] if window else None,
                chip_hours=chip_hours,
                cost_usd=None if usd is None else chip_hours * usd,
            )
        )
    # Not priced if any attempt is not: a partial sum would pass for the run's cost.
    if attempts:
        priced = all(a.cost_usd is not None for a in attempts)
    else:
        priced = price.usd_per_chip_hour is not None
    return Ledger(
        price=attempts[-1].price if attempts else price,
        goodput=compute_goodput(events),
        attempts=attempts,
        tokens_per_step=tokens_per_step,
        steps=sum(a.timeline.steps_kept for a in attempts),
        chip_hours=sum(a.chip_hours for a in attempts),
        cost_usd=sum(a.cost_usd or 0.0 for a in attempts) if priced else None,
        first_event=min((e["time"] for e in events), default=None),
    )


def tokens_per_step(config: PipelineConfig) -> int:
    """Training tokens per optimizer step: the global batch of packed sequences (packing
    leaves no padding, see README) × their length."""
    return config.train.batch_size * config.dataset.seq_len
