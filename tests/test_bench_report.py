"""`make bench`'s report: every figure becomes a row holding the two measurements it
divides, and the goal check reads the goal's direction."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("run_all", REPO / "bench" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)
spec = importlib.util.spec_from_file_location("matmuls", REPO / "bench" / "matmuls.py")
matmuls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matmuls)

# One output of each benchmark, in the shape each writes with --out.
RESULTS = {
    "shard": {
        "corpus_mb": 31.5,
        "plain_mb_s": 500.0,
        "plain_cold_mb_s": 140.0,
        "shard_1_worker_mb_s": 60.0,
        "shard_2_workers_mb_s": 90.0,
        "shard_2_workers_cold_mb_s": 70.0,
        "ratio_shard_to_plain_warm": 0.18,
        "ratio_shard_to_plain_cold": 0.5,
        "speedup_1_to_2_workers": 1.5,
        "loader_batches_s": 1000.0,
        "train_step_s": 0.1,
        "loader_over_training": 100.0,
        "writer_only_mb_s": 175.0,
        "writer_only_over_plain_warm": 0.35,
        "pinned_1_worker_s_per_core": [0.55, 0.4],
        "ideal_speedup_1_to_2_on_these_cores": 1.727,
        "serial_s_of_best_1_worker_run": 0.1,
        "best_1_worker_s": 0.5,
        "amdahl_speedup_1_to_2": 1.667,
        "scaled_corpus_mb": 126.0,
        "scaled_speedup_1_to_2_workers": 1.75,
        "scaled_1_worker_mb_s": 80.0,
        "scaled_2_workers_mb_s": 140.0,
    },
    "workload": {
        "model": "small",
        "checkpoint_every": 10,
        "peak_flops_per_s": 3e11,
        "minimal_tokens_per_s": 2000.0,
        "minimal_writes_tokens_per_s": 1900.0,
        "textbook": {"tokens_per_s": 1800.0, "flops_per_s": 1.8e11},
        "matmuls": {"flops_per_s": 2.9e11, "seconds": 0.6, "flops": 1.7e11},
        "runs": {
            "cold_no_ckpt": {"tokens_per_s": 2000.0, "flops_per_token": 8e7, "compile_s": 5.0},
            "ckpt": {"tokens_per_s": 1980.0, "flops_per_token": 8e7, "compile_s": 0.5},
            "warm_cache": {"tokens_per_s": 2000.0, "flops_per_token": 8e7, "compile_s": 0.5},
            "ckpt_2": {"tokens_per_s": 1990.0, "flops_per_token": 8e7, "compile_s": 0.5},
            "system_malloc": {"tokens_per_s": 1600.0, "flops_per_token": 8e7, "compile_s": 0.5},
        },
        "allocator": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
        "best": {"no_ckpt_tokens_per_s": 2000.0, "ckpt_tokens_per_s": 1990.0},
        "figures": {
            "model_flops_over_matmul_peak": 8e7 * 2000.0 / 3e11,
            "workload_over_minimal_loop": 1.0,
            "async_ckpt_over_none": 0.99,
            "warm_compile_over_cold": 0.1,
            "textbook_flops_over_matmul_peak": 0.6,
            "system_malloc_over_chosen": 0.8,
            "plain_writes_over_none": 0.95,
            "model_matmuls_over_matmul_peak": 2.9e11 / 3e11,
            "workload_over_its_matmuls": 8e7 * 2000.0 / 2.9e11,
        },
    },
    "goodput": {
        "sigterm_every_s": 120.0,
        "attempts": 2,
        "wall_s": 200.0,
        "goodput": 0.92,
        "seconds": {"productive": 184.0},
    },
    "pipeline": {"steps": 150, "flow_s": 15.0, "direct_s": 14.0, "flow_over_direct": 1.071},
    "sweep": {
        "trials": 6,
        "parallel": 2,
        "wall_s": 70.0,
        "ideal_s": 60.0,
        "wall_over_ideal": 1.167,
    },
}


def test_every_benchmark_gives_rows_with_numerator_reference_and_goal():
    rows = [row for name in run_all.SUITE for row in run_all.ROWS[name](RESULTS[name])]
    assert len(rows) == 20
    by_figure = {row["figure"]: row for row in rows}
    flops = by_figure["model FLOP/s ÷ matmul peak (small model, f32, 1 device)"]
    assert flops["value"] == 0.533 and flops["met"] is False
    assert flops["numerator"]["measured"] == 160.0 and flops["reference"]["measured"] == 300.0
    # "<=" goals are met from below, ">=" goals from above; exactly the goal meets it.
    assert by_figure["resume compile time, warm cache ÷ cold"]["met"] is True
    sweep = next(r for r in rows if r["figure"].startswith("sweep wall"))
    assert sweep["met"] is False
    cold = by_figure["sharding ÷ plain read-and-write (cold cache)"]
    assert cold["value"] == 0.5 and cold["met"] is True
    loader = by_figure["loader ÷ training consumption (demo config)"]
    assert loader["reference"]["measured"] == 10.0  # batches/s, from the step time
    # Reference rows carry no goal and are neither met nor missed.
    textbook = by_figure["textbook Flax NNX decoder, same dimensions ÷ matmul peak"]
    assert textbook["value"] == 0.6 and textbook["goal"] is None and textbook["met"] is None
    assert textbook["numerator"]["measured"] == 180.0
    malloc = by_figure["workload on the system malloc ÷ on tcmalloc_minimal"]
    assert malloc["value"] == 0.8 and malloc["goal"] is None
    assert malloc["numerator"]["measured"] == 1600
    ckpt = by_figure["async checkpoints every 10 steps ÷ none (tokens/s)"]
    assert ckpt["numerator"]["measured"] == 1990 and ckpt["reference"]["measured"] == 2000
    floor = by_figure[
        "minimal loop writing its state every 10 steps in the background ÷ without (tokens/s)"
    ]
    assert floor["value"] == 0.95 and floor["met"] is None
    assert floor["numerator"]["measured"] == 1900 and floor["reference"]["measured"] == 2000
    ceiling = by_figure["the step's matmuls timed alone ÷ matmul peak (the first row's ceiling)"]
    assert ceiling["value"] == 0.967 and ceiling["met"] is None
    assert ceiling["numerator"]["measured"] == 290.0
    share = by_figure["workload model FLOP/s ÷ its matmuls alone (share of the step in matmuls)"]
    assert share["value"] == 0.552 and share["reference"]["measured"] == 290.0
    writer = by_figure["ArrayRecord writer alone ÷ plain read-and-write (warm cache)"]
    assert writer["value"] == 0.35 and writer["met"] is None
    ideal = next(r for r in rows if r["figure"].startswith("ideal 1 → 2 worker speed-up"))
    assert ideal["numerator"]["measured"] == 0.55 and ideal["reference"]["measured"] == 0.4
    amdahl = next(r for r in rows if "(Amdahl)" in r["figure"])  # 0.5 s of which 0.1 serial
    assert amdahl["value"] == 1.667 and amdahl["met"] is None
    assert amdahl["reference"]["measured"] == 0.3 and "serial 0.1 s" in amdahl["reference"]["what"]
    scaled = next(r for r in rows if "copied to 126.0 MB" in r["figure"])
    assert scaled["value"] == 1.75 and scaled["met"] is None
    assert scaled["numerator"]["measured"] == 140.0 and scaled["reference"]["measured"] == 80.0


def test_reference_rows_read_as_references_in_markdown():
    rows = run_all.ROWS["workload"](RESULTS["workload"])
    report = {"date": "d", "commit": "c", "machine": "m", "wall_s": 1.0, "loadavg": [0, 0]}
    text = run_all.markdown({**report, "rows": rows, "failed": {}})
    assert "(2048² f32 matmul GFLOP/s) | reference | — |" in text
    # A result written before the textbook reference existed still gives its rows.
    old = {**RESULTS["workload"]}
    old.pop("textbook")
    old.pop("matmuls")
    newer = (
        "system_malloc_over_chosen",
        "plain_writes_over_none",
        "model_matmuls_over_matmul_peak",
        "workload_over_its_matmuls",
    )
    old["figures"] = {k: v for k, v in old["figures"].items() if k not in newer}
    old.pop("best")
    assert len(run_all.ROWS["workload"](old)) == 4


def test_markdown_has_one_line_per_row_and_names_failures():
    rows = run_all.ROWS["pipeline"](RESULTS["pipeline"])
    report = {
        "date": "2026-11-22",
        "commit": "abc1234",
        "machine": "2 cores",
        "wall_s": 60.0,
        "loadavg": [0.5, 1.0],
        "rows": rows,
        "failed": {"sweep": "Traceback: boom"},
    }
    text = run_all.markdown(report)
    assert "| pipeline flow ÷ its stages called directly (150 tiny steps) | **1.071** |" in text
    assert "15.0 (flow wall s) | 14.0 (sum of stages s) | <= 1.10 | yes |" in text
    assert "**sweep failed to run:**" in text and "boom" in text
    json.dumps(report)  # the JSON report holds the same structure


@pytest.mark.parametrize(
    "model", [{"size": "tiny"}, {"size": "small"}, {"size": "base"}, {"d_model": 96, "n_heads": 3}]
)
def test_the_step_matmuls_benchmark_counts_the_models_flops(model):
    # bench/matmuls.py counts these shapes as the MFU ceiling: they must be the work the
    # MFU figure counts, for any dimensions, or the ceiling compares different things.
    from workloads.config import ModelConfig
    from workloads.perf import model_flops_per_token

    cfg = ModelConfig(**model, max_seq_len=512)
    for batch, seq in ((8, 256), (3, 512)):
        shapes = matmuls.step_matmuls(
            cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_layers, 257, batch, seq
        )
        total = sum(matmuls.flops(s, dims) * times for s, dims, times in shapes)
        assert total == model_flops_per_token(cfg, 257, seq) * batch * seq
