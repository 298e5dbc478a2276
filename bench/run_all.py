"""`make bench`: every benchmark under bench/, one table of side-by-side ratios.

    .venv/bin/python bench/run_all.py [--only shard,workload] [--results-dir bench/results]

Each benchmark runs as its own process with the arguments below (sized so the whole suite
takes under 15 minutes on 2 cores) and writes its JSON; this script turns them into one
row per figure: the ratio, the two measurements it divides (each with what it is), and the
goal. The result goes to `<results-dir>/<date>.json` and `<date>.md` (a rerun on the same
day replaces them). Every figure is a ratio of two things measured in the same run, because
these machines are shared: absolute speeds say more about the neighbours than the code.

The exit status is 1 if a benchmark failed to run, not when a goal is missed: the table
says which goals are met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# name -> the arguments it runs with in the suite.
SUITE: dict[str, list[str]] = {
    "shard": ["--repeats", "2"],
    "workload": ["--steps", "40"],
    "goodput": ["--every", "120", "--steps", "1200"],
    "pipeline": ["--steps", "150", "--repeats", "2"],
    "sweep": ["--trials", "6", "--parallel", "2", "--steps", "100"],
}


MET_CELL = {True: "yes", False: "no", None: "—"}  # None: a reference row, no goal


def _row(figure, value, numerator, reference, goal=None) -> dict:
    """One table row: `value` = numerator ÷ reference, each given as (what, measured).
    Without a goal the row is a reference that helps read the others (`met` is None)."""
    met = None
    if goal is not None:
        op, target = goal.split()
        met = value >= float(target) if op == ">=" else value <= float(target)
    return {
        "figure": figure,
        "value": round(value, 3),
        "numerator": {"what": numerator[0], "measured": numerator[1]},
        "reference": {"what": reference[0], "measured": reference[1]},
        "goal": goal,
        "met": met,
    }


def shard_rows(r: dict) -> list[dict]:
    """Rows of bench/shard.py."""
    mb = r["corpus_mb"]
    return [
        _row(
            "sharding ÷ plain read-and-write (warm cache)",
            r["ratio_shard_to_plain_warm"],
            ("sharding, 2 workers, MB/s", r["shard_2_workers_mb_s"]),
            (f"read + write + fsync of the same {mb} MB, MB/s", r["plain_mb_s"]),
            ">= 0.5",
        ),
        _row(
            "sharding ÷ plain read-and-write (cold cache)",
            r["ratio_shard_to_plain_cold"],
            ("sharding, 2 workers, MB/s", r["shard_2_workers_cold_mb_s"]),
            ("read + write + fsync, MB/s", r["plain_cold_mb_s"]),
            ">= 0.5",
        ),
        _row(
            "sharding speed-up, 1 → 2 workers",
            r["speedup_1_to_2_workers"],
            ("2 workers, MB/s", r["shard_2_workers_mb_s"]),
            ("1 worker, MB/s", r["shard_1_worker_mb_s"]),
            ">= 1.7",
        ),
        *(
            [
                _row(
                    "ideal 1 → 2 worker speed-up on these two cores (1 worker pinned to each)",
                    r["ideal_speedup_1_to_2_on_these_cores"],
                    ("slower core, s", max(r["pinned_1_worker_s_per_core"])),
                    ("faster core, s", min(r["pinned_1_worker_s_per_core"])),
                )
            ]
            if r.get("ideal_speedup_1_to_2_on_these_cores")
            else []
        ),
        *(
            [
                _row(
                    "most 2 workers can give with the 1-worker run's serial part (Amdahl)",
                    r["amdahl_speedup_1_to_2"],
                    ("1-worker run, s", r["best_1_worker_s"]),
                    (
                        f"its serial {r['serial_s_of_best_1_worker_run']} s + the rest ÷ 2, s",
                        round(r["best_1_worker_s"] / r["amdahl_speedup_1_to_2"], 3),
                    ),
                )
            ]
            if r.get("amdahl_speedup_1_to_2")
            else []
        ),
        *(
            [
                _row(
                    f"sharding speed-up, 1 → 2 workers, the corpus copied to "
                    f"{r['scaled_corpus_mb']} MB",
                    r["scaled_speedup_1_to_2_workers"],
                    ("2 workers, MB/s", r["scaled_2_workers_mb_s"]),
                    ("1 worker, MB/s", r["scaled_1_worker_mb_s"]),
                )
            ]
            if r.get("scaled_speedup_1_to_2_workers")
            else []
        ),
        _row(
            "loader ÷ training consumption (demo config)",
            r["loader_over_training"],
            ("loader, batches/s", r["loader_batches_s"]),
            ("demo train step, batches/s", round(1 / r["train_step_s"], 2)),
            ">= 20",
        ),
        _row(
            "ArrayRecord writer alone ÷ plain read-and-write (warm cache)",
            r["writer_only_over_plain_warm"],
            ("writing the same records from memory, MB/s", r["writer_only_mb_s"]),
            ("read + write + fsync, MB/s", r["plain_mb_s"]),
        ),
    ]


def workload_rows(r: dict) -> list[dict]:
    """Rows of bench/workload.py."""
    f, runs = r["figures"], r["runs"]
    cold, ckpt, warm = runs["cold_no_ckpt"], runs["ckpt"], runs["warm_cache"]
    # Each side's better run where the benchmark ran two (older results: one each).
    best = r.get("best", {})
    none_s = best.get("no_ckpt_tokens_per_s", cold["tokens_per_s"])
    ckpt_s = best.get("ckpt_tokens_per_s", ckpt["tokens_per_s"])
    achieved = cold["flops_per_token"] * none_s
    return [
        _row(
            f"model FLOP/s ÷ matmul peak ({r['model']} model, f32, 1 device)",
            f["model_flops_over_matmul_peak"],
            ("workload model GFLOP/s", round(achieved / 1e9, 1)),
            ("2048² f32 matmul GFLOP/s", round(r["peak_flops_per_s"] / 1e9, 1)),
            ">= 0.80",
        ),
        *(
            [
                _row(
                    "textbook Flax NNX decoder, same dimensions ÷ matmul peak",
                    f["textbook_flops_over_matmul_peak"],
                    ("textbook model GFLOP/s", round(r["textbook"]["flops_per_s"] / 1e9, 1)),
                    ("2048² f32 matmul GFLOP/s", round(r["peak_flops_per_s"] / 1e9, 1)),
                )
            ]
            if "textbook" in r
            else []
        ),
        *(
            [
                _row(
                    "the step's matmuls timed alone ÷ matmul peak (the first row's ceiling)",
                    f["model_matmuls_over_matmul_peak"],
                    ("step matmuls GFLOP/s", round(r["matmuls"]["flops_per_s"] / 1e9, 1)),
                    ("2048² f32 matmul GFLOP/s", round(r["peak_flops_per_s"] / 1e9, 1)),
                ),
                _row(
                    "workload model FLOP/s ÷ its matmuls alone (share of the step in matmuls)",
                    f["workload_over_its_matmuls"],
                    ("workload model GFLOP/s", round(achieved / 1e9, 1)),
                    ("step matmuls GFLOP/s", round(r["matmuls"]["flops_per_s"] / 1e9, 1)),
                ),
            ]
            if "matmuls" in r
            else []
        ),
        _row(
            "workload ÷ minimal Flax NNX loop (tokens/s)",
            f["workload_over_minimal_loop"],
            ("workload tokens/s", round(none_s)),
            ("minimal loop tokens/s", round(r["minimal_tokens_per_s"])),
            ">= 0.95",
        ),
        _row(
            f"async checkpoints every {r['checkpoint_every']} steps ÷ none (tokens/s)",
            f["async_ckpt_over_none"],
            ("with checkpoints, tokens/s", round(ckpt_s)),
            ("without, tokens/s", round(none_s)),
            ">= 0.97",
        ),
        *(
            [
                _row(
                    f"minimal loop writing its state every {r['checkpoint_every']} steps in "
                    "the background ÷ without (tokens/s)",
                    f["plain_writes_over_none"],
                    ("with plain writes, tokens/s", round(r["minimal_writes_tokens_per_s"])),
                    ("without, tokens/s", round(r["minimal_tokens_per_s"])),
                )
            ]
            if "plain_writes_over_none" in f
            else []
        ),
        _row(
            "resume compile time, warm cache ÷ cold",
            f["warm_compile_over_cold"],
            ("warm compile s", round(warm["compile_s"], 2)),
            ("cold compile s", round(cold["compile_s"], 2)),
            "<= 0.20",
        ),
        *(
            [
                _row(
                    "workload on the system malloc ÷ on " + _allocator_name(r.get("allocator", {})),
                    f["system_malloc_over_chosen"],
                    ("system malloc tokens/s", round(runs["system_malloc"]["tokens_per_s"])),
                    ("tokens/s", round(none_s)),
                )
            ]
            if "system_malloc_over_chosen" in f
            else []
        ),
    ]


def _allocator_name(env: dict) -> str:
    if env.get("LD_PRELOAD"):
        return Path(env["LD_PRELOAD"]).name.split(".so")[0].removeprefix("lib")
    return f"glibc with {env['GLIBC_TUNABLES']}" if env.get("GLIBC_TUNABLES") else "the same"


def goodput_rows(r: dict) -> list[dict]:
    """Rows of bench/goodput.py."""
    return [
        _row(
            f"goodput, SIGTERM every {r['sigterm_every_s']:.0f} s ({r['attempts']} attempts)",
            r["goodput"],
            ("productive step time s", round(r["seconds"]["productive"], 1)),
            ("wall time s", round(r["wall_s"], 1)),
            ">= 0.90",
        )
    ]


def pipeline_rows(r: dict) -> list[dict]:
    """Rows of bench/pipeline.py."""
    return [
        _row(
            f"pipeline flow ÷ its stages called directly ({r['steps']} tiny steps)",
            r["flow_over_direct"],
            ("flow wall s", r["flow_s"]),
            ("sum of stages s", r["direct_s"]),
            "<= 1.10",
        )
    ]


def sweep_rows(r: dict) -> list[dict]:
    """Rows of bench/sweep.py."""
    return [
        _row(
            f"sweep wall ÷ ideal ({r['trials']} trials of {r.get('steps_per_trial', '?')} "
            f"steps, {r['parallel']} at a time, {r.get('api', 'temporary')} API)",
            r["wall_over_ideal"],
            ("sweep wall s", r["wall_s"]),
            ("chip-time ÷ parallelism s", r["ideal_s"]),
            "<= 1.15",
        )
    ]


ROWS: dict[str, Callable[[dict], list[dict]]] = {
    "shard": shard_rows,
    "workload": workload_rows,
    "goodput": goodput_rows,
    "pipeline": pipeline_rows,
    "sweep": sweep_rows,
}


def run_bench(name: str, out: Path) -> tuple[dict | None, float, str]:
    """Run bench/<name>.py writing `out`; (its JSON or None, seconds, stderr tail)."""
    cmd = [sys.executable, str(BENCH / f"{name}.py"), *SUITE[name], "--out", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode or not out.exists():
        return None, seconds, proc.stderr[-2000:]
    return json.loads(out.read_text()), seconds, ""


def markdown(report: dict) -> str:
    """The report as a markdown table, one row per figure."""
    lines = [
        f"# Benchmarks {report['date']} (commit {report['commit']})",
        "",
        f"{report['machine']}; suite wall time {report['wall_s'] / 60:.1f} min; "
        f"load average {report['loadavg'][0]} before, {report['loadavg'][1]} after.",
        "",
        "| figure | value | numerator | reference | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        num, ref = row["numerator"], row["reference"]
        lines.append(
            f"| {row['figure']} | **{row['value']}** | {num['measured']} ({num['what']}) | "
            f"{ref['measured']} ({ref['what']}) | {row['goal'] or 'reference'} | "
            f"{MET_CELL[row['met']]} |"
        )
    for name, error in report["failed"].items():
        lines.append(f"\n**{name} failed to run:**\n```\n{error}\n```")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return out.stdout.decode().strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated subset of: " + ", ".join(SUITE))
    parser.add_argument("--results-dir", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SUITE)
    unknown = sorted(set(names) - set(SUITE))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(SUITE)}")

    load_before, start = os.getloadavg()[0], time.perf_counter()
    report = {"rows": [], "raw": {}, "seconds": {}, "failed": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            result, seconds, error = run_bench(name, Path(tmp) / f"{name}.json")
            report["seconds"][name] = round(seconds, 1)
            if result is None:
                report["failed"][name] = error
                print(f"   {name} FAILED after {seconds:.0f}s:\n{error}", flush=True)
                continue
            report["raw"][name] = result
            report["rows"].extend(ROWS[name](result))
            print(f"   {name} done in {seconds:.0f}s", flush=True)
    report.update(
        date=datetime.now(UTC).strftime("%Y-%m-%d"),
        commit=_commit(),
        machine=f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}",
        wall_s=round(time.perf_counter() - start, 1),
        loadavg=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        benchmarks=names,
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / report["date"]
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"written {stem}.json and {stem}.md")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
