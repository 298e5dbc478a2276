"""The cost ledger's arithmetic on a recorded events.jsonl, and the price table it uses.

Expected figures are worked out here by hand from the recorded event times (see the
comments), not taken from the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main as cli_main
from tasks.goodput import compute_goodput, read_events
from tasks.ledger import billing_window, compute_ledger, tokens_per_step
from tasks.pricing import (
    Price,
    PriceTableError,
    load_price_table,
    price_for,
    reprice,
)
from tests.helpers import REPO, TABLE, attempt_events, eight_then_four, priced, tiny_config
from workloads.config import PipelineConfig
from workloads.config_file import ConfigError, load_config

RECORDED = Path(__file__).parent / "data" / "events-three-attempts.jsonl"
# Billing windows of the recorded run. On-demand: from the create request that produced
# the slice to its deletion (attempt 2's failed create at 50-52 bills nothing).
ON_DEMAND_S = (46 - 0) + (97 - 60) + (151 - 100)  # 134 s
# Spot: from READY to deletion (a queued spot request has no node while it waits).
SPOT_S = (46 - 10) + (97 - 70) + (151 - 105)  # 109 s
# Steps that count: 0->20 (attempt 2 resumed from attempt 1's step 20), 20->30, 30->60.
STEPS = 20 + 10 + 30
TOKENS_PER_STEP = 16 * 32  # configs/tiny.yaml: train.batch_size x dataset.seq_len


def gcp(capacity: str = "on-demand", zone: str = "us-east5-a", tpu: str = "v5p-8", **cost):
    return PipelineConfig.model_validate(
        {
            "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "slice": {
                "provider": "gcp",
                "accelerator_type": tpu,
                "zone": zone,
                "runtime_version": "v2-alpha-tpuv5",
                "wheel": "gs://bkt/tpupipe-0.1.0-py3-none-any.whl",
                "capacity": capacity,
            },
            "train": {"batch_size": 16},
            "storage": {"root": "gs://bkt/p"},
            "cost": cost,
        }
    )


@pytest.fixture
def table_file(tmp_path) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(TABLE)
    return path


def test_on_demand_ledger_of_the_recorded_run(tmp_path, table_file):
    config = tiny_config(
        tmp_path,
        "cost.priced_as=v5litepod-8",
        "cost.region=us-central1",
        f"cost.price_table={table_file}",
    )
    price = price_for(config)
    assert (price.chips, price.usd_per_chip_hour, price.as_of) == (8, 2.0, "2026-01-02")
    events = read_events(RECORDED)
    ledger = compute_ledger(events, price, tokens_per_step(config))

    assert [a.billed_s for a in ledger.attempts] == [46, 37, 51]
    assert ledger.chip_hours == pytest.approx(8 * ON_DEMAND_S / 3600)  # 0.29778
    assert ledger.cost_usd == pytest.approx(8 * ON_DEMAND_S / 3600 * 2.0)  # $0.59556
    assert [a.cost_usd for a in ledger.attempts] == pytest.approx(
        [8 * 46 / 3600 * 2.0, 8 * 37 / 3600 * 2.0, 8 * 51 / 3600 * 2.0]
    )
    assert [a.timeline.steps_kept for a in ledger.attempts] == [20, 10, 30]
    assert ledger.steps == STEPS and ledger.tokens == STEPS * TOKENS_PER_STEP == 30_720
    per_million = 8 * ON_DEMAND_S / 3600 * 2.0 / 30_720 * 1e6  # $19.3866
    assert ledger.cost_per_million_tokens == pytest.approx(per_million)
    # The goodput stands alongside, unchanged by pricing.
    assert ledger.goodput.seconds == compute_goodput(events).seconds
    assert ledger.goodput.goodput == pytest.approx(70 / 151)


def test_spot_bills_from_ready_and_pays_the_spot_price(tmp_path, table_file):
    config = tiny_config(
        tmp_path,
        "cost.priced_as=v5litepod-8",
        "cost.region=us-central1",
        "cost.capacity=spot",
        f"cost.price_table={table_file}",
    )
    price = price_for(config)
    assert (price.capacity, price.usd_per_chip_hour) == ("spot", 0.5)
    ledger = compute_ledger(read_events(RECORDED), price, TOKENS_PER_STEP)
    assert ledger.chip_hours == pytest.approx(8 * SPOT_S / 3600)
    assert ledger.cost_usd == pytest.approx(8 * SPOT_S / 3600 * 0.5)  # $0.12111
    assert ledger.cost_per_million_tokens == pytest.approx(8 * SPOT_S / 3600 * 0.5 / 30_720 * 1e6)


def test_billing_window_edges():
    attempt = [
        {"time": 5, "event": "provision_requested"},
        {"time": 6, "event": "provision_failed"},
        {"time": 9, "event": "provision_requested"},
        {"time": 12, "event": "provision_ready"},
        {"time": 40, "event": "attempt_ended", "outcome": "failed"},
    ]
    assert billing_window(attempt, "on-demand") == (9, 40)  # no `deleted`: to its end
    assert billing_window(attempt, "reserved") == (9, 40)
    assert billing_window(attempt, "spot") == (12, 40)
    assert billing_window(attempt[:2], "on-demand") is None  # no slice ever existed
    price = Price(8, "on-demand", None, None, 1.0, "x")
    ledger = compute_ledger([{**e, "attempt": 1} for e in attempt[:2]], price, 1)
    assert (ledger.chip_hours, ledger.cost_usd, ledger.cost_per_million_tokens) == (0, 0, None)


def test_an_unpriced_local_run_has_chip_hours_but_no_cost(tmp_path):
    price = price_for(tiny_config(tmp_path))
    assert price.usd_per_chip_hour is None and "not priced: a local slice" in price.source
    ledger = compute_ledger(read_events(RECORDED), price, TOKENS_PER_STEP)
    assert ledger.chip_hours == pytest.approx(8 * ON_DEMAND_S / 3600)  # 8 local devices
    assert ledger.cost_usd is None and ledger.cost_per_million_tokens is None
    assert all(a.cost_usd is None for a in ledger.attempts) and ledger.tokens == 30_720


def test_gcp_prices_come_from_the_shipped_table_by_zone_and_capacity():
    table = load_price_table()
    assert table.source.startswith("https://") and table.read_on.isoformat() == "2026-11-22"
    assert set(table.families) == {"v4", "v5p", "v5litepod", "v6e"}
    on_demand = price_for(gcp())
    assert (on_demand.chips, on_demand.region, on_demand.usd_per_chip_hour) == (4, "us-east5", 4.2)
    assert price_for(gcp("spot")).usd_per_chip_hour == 1.68
    reserved = price_for(gcp("reserved"))
    assert reserved.usd_per_chip_hour == 4.2 and "reserved: priced on-demand" in reserved.source
    # A committed-use rate given in the config beats the table.
    assert price_for(gcp("reserved", usd_per_chip_hour=2.5)).usd_per_chip_hour == 2.5
    # No figure for that region: not priced, and saying so (never a guess).
    unknown = price_for(gcp(zone="asia-east1-c", tpu="v6e-8"))
    assert unknown.usd_per_chip_hour is None
    assert "no on_demand price for v6e in asia-east1" in unknown.source


def test_a_bad_price_table_names_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TABLE.replace("spot: 0.5", "spot: -1").replace("v5litepod", "v9"))
    with pytest.raises(PriceTableError) as err:
        load_price_table(bad)
    msg = str(err.value)
    assert f"{bad}: families.v9.[key]: Input should be 'v4', 'v5p'" in msg  # no such family
    assert f"{bad}: families.v9.us-central1.spot: Input should be greater than 0" in msg
    with pytest.raises(PriceTableError, match=r"cost.price_table = '.*missing.yaml': cannot"):
        load_price_table(tmp_path / "missing.yaml")
    (tmp_path / "huge.yaml").write_text(TABLE.replace("spot: 0.5", "spot: 1.0e+305"))
    with pytest.raises(PriceTableError, match=r"huge\.yaml: .*spot: .*less than or equal to"):
        load_price_table(tmp_path / "huge.yaml")  # a long run's cost was inf: no landing
    (tmp_path / "junk.yaml").write_text("source: [unclosed\n")
    with pytest.raises(PriceTableError, match=r"junk\.yaml: not valid YAML"):
        load_price_table(tmp_path / "junk.yaml")


def test_cost_config_errors_name_their_fields(tmp_path):
    tiny = REPO / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"cost.usd_per_chip_hour: .*less than or equal to"):
        load_config(tiny, ["cost.usd_per_chip_hour=1e305"])
    with pytest.raises(ConfigError, match=r"cost.priced_as = 'v5litepod-8' needs cost.region"):
        load_config(tiny, ["cost.priced_as=v5litepod-8"])
    with pytest.raises(ConfigError, match=r"cost.priced_as 'v9-8' is not one of"):
        load_config(tiny, ["cost.priced_as=v9-8", "cost.region=us-central1"])
    with pytest.raises(ConfigError, match=r"cost.region 'Iowa' is not a region name"):
        load_config(tiny, ["cost.region=Iowa"])
    # Only for cost.priced_as: set alone, they were ignored in silence.
    for field in ("region=us-central1", "capacity=spot"):
        with pytest.raises(ConfigError, match=rf"cost.{field.split('=')[0]} = .* applies only"):
            load_config(tiny, [f"cost.{field}"])
    with pytest.raises(ConfigError, match=r"--set: cost.usd_per_chip_hour: .*greater than 0"):
        load_config(tiny, ["cost.usd_per_chip_hour=0"])
    with pytest.raises(ValueError, match=r"cost.priced_as = 'v5litepod-8' is for local slices"):
        gcp(priced_as="v5litepod-8", region="us-central1")


def test_cli_validate_reads_the_price_table(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TABLE.replace("read_on: 2026-01-02", "read_on: someday"))
    tiny = str(REPO / "configs" / "tiny.yaml")
    assert cli_main(["validate", "--config", tiny, "--set", f"cost.price_table={bad}"]) == 2
    assert f"{bad}: read_on: Input should be a valid date" in capsys.readouterr().err


def test_steps_restored_after_a_stepless_attempt_are_paid_for_once():
    # Attempt 1 saves step 10; attempt 2 is preempted in start-up; attempt 3 resumes from
    # 10 and trains 11-20. All 20 steps count, none twice.
    events = [
        *attempt_events(1, 0, 0, 10, "preempted"),
        {"time": 20, "attempt": 2, "event": "provision_requested"},
        {"time": 22, "attempt": 2, "event": "provision_ready"},
        {"time": 26, "attempt": 2, "event": "attempt_ended", "outcome": "preempted"},
        *attempt_events(3, 30, 10, 20, "completed"),
    ]
    ledger = compute_ledger(events, Price(8, "on-demand", None, None, 2.0, "x"), 512)
    assert [a.timeline.steps_kept for a in ledger.attempts] == [10, 0, 10]
    assert ledger.steps == 20 and ledger.tokens == 20 * 512
    assert [a.billed_s for a in ledger.attempts] == [16, 26 - 20, 46 - 30]


def test_a_rerun_bills_each_invocation_s_attempts():
    # An old ledger whose second invocation restarted at attempt 1: two attempts billed
    # for 16 s each, not one merged attempt billed from its last request (16 s in all).
    events = [
        *attempt_events(1, 0, 0, 10, "preempted"),
        *attempt_events(1, 1000, 10, 20, "completed"),
    ]
    ledger = compute_ledger(events, Price(8, "on-demand", None, None, 2.0, "x"), 512)
    assert [a.timeline.attempt for a in ledger.attempts] == [1, 2]
    assert [a.billed_s for a in ledger.attempts] == [16, 16]
    assert ledger.chip_hours == pytest.approx(8 * 32 / 3600) and ledger.steps == 20


def test_each_attempt_is_billed_at_the_slice_and_price_it_ran_with(tmp_path, table_file):
    eight, four = eight_then_four(tmp_path, table_file)
    # Each attempt is billed 16 s (requested at t0, deleted at t0 + 16).
    first = priced(attempt_events(1, 0, 0, 10, "preempted"), eight)
    events = [*first, *priced(attempt_events(2, 100, 10, 20, "completed"), four)]
    # The run's config.json is the rerun's now: it prices only what recorded no price.
    ledger = compute_ledger(events, price_for(four), 512)
    assert [a.price.chips for a in ledger.attempts] == [8, 4]
    assert [a.chip_hours for a in ledger.attempts] == pytest.approx([8 * 16 / 3600, 4 * 16 / 3600])
    assert [a.cost_usd for a in ledger.attempts] == pytest.approx(
        [8 * 16 / 3600 * 2.0, 4 * 16 / 3600 * 3.0]
    )
    assert ledger.chip_hours == pytest.approx(12 * 16 / 3600)
    assert ledger.cost_usd == pytest.approx((8 * 2.0 + 4 * 3.0) * 16 / 3600)
    assert ledger.price == price_for(four)  # the last attempt's
    # The rerun of the finished run makes no attempt: attempt 1 keeps its price.
    alone = compute_ledger(first, price_for(four), 512)
    assert (alone.price.chips, alone.chip_hours) == (8, pytest.approx(8 * 16 / 3600))
    assert alone.cost_usd == pytest.approx(8 * 16 / 3600 * 2.0)
    # Re-priced with another cost section: each attempt on the slice it ran on.
    cost = four.cost.model_copy(update={"priced_as": None, "usd_per_chip_hour": 5.0})
    flat = four.model_copy(update={"cost": cost})
    again = compute_ledger(events, price_for(flat), 512, lambda e: reprice(flat, e))
    assert [a.price.chips for a in again.attempts] == [8, 4]
    assert again.cost_usd == pytest.approx(12 * 16 / 3600 * 5.0)


def test_attempts_recorded_without_a_price_are_billed_at_the_config(tmp_path, table_file):
    # A ledger of an older version: no attempt recorded its price.
    eight, four = eight_then_four(tmp_path, table_file)
    first = attempt_events(1, 0, 0, 10, "preempted")
    old = [*first, *attempt_events(2, 100, 10, 20, "completed")]
    ledger = compute_ledger(old, price_for(four), 512)
    assert [a.price for a in ledger.attempts] == [price_for(four)] * 2
    assert ledger.cost_usd == pytest.approx(4 * 32 / 3600 * 3.0)
    # An unpriced attempt leaves the run unpriced, not a partial sum passed for its cost.
    mixed = [*priced(first, eight), *old[len(first) :]]
    unpriced = compute_ledger(mixed, price_for(tiny_config(tmp_path)), 512)
    assert [a.price.chips for a in unpriced.attempts] == [8, 8]
    assert unpriced.attempts[0].cost_usd == pytest.approx(8 * 16 / 3600 * 2.0)
    assert unpriced.cost_usd is None and unpriced.chip_hours == pytest.approx(16 * 16 / 3600)
