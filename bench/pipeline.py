"""Orchestration overhead: the pipeline flow's wall time ÷ the same stages called directly.

    .venv/bin/python bench/pipeline.py [--steps 150] [--repeats 2] [--out FILE]

Both sides run configs/tiny.yaml (with `--steps` training steps) from an empty storage
root, so each shards, compiles cold, trains, verifies, evaluates and lands the same work:

- flow: `tpu_training_pipeline(config)`, against a temporary Prefect API that is started,
  and has run a small flow from another process, before the clock does (a deployment's
  server is already up and past its routes' one-time set-up: `warm_up_server`);
- direct: the functions the tasks wrap, in order, with no Prefect at all: plan, check the
  inputs and price the run, shard, create the local slice and watch the workload to its
  end, delete it, verify the checkpoint, evaluate it, land the rows in DuckDB and draw the
  loss curve.

Each side runs in its own fresh process (neither inherits the other's imports or caches),
`--repeats` times each in alternating order, and the best of each is kept, so a busy
neighbour hurts both alike. What the ratio holds: task and flow runs, state writes to the
API, the progress and summary artifacts. Goal: ≤ 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def config_for(root: Path, steps: int):
    """configs/tiny.yaml with its storage under `root` and `steps` training steps."""
    from workloads.config_file import load_config

    overrides = [f"storage.root={root}", f"train.steps={steps}", "train.checkpoint_every=50"]
    return load_config(REPO / "configs" / "tiny.yaml", overrides)


def direct(config) -> dict[str, float]:
    """Every stage of the pipeline without Prefect; seconds per stage."""
    from infra.metrics import build_sink
    from infra.slices import SliceSpec, build_provider
    from tasks.checks import load_workload_config
    from tasks.landing import build_rows
    from tasks.plan import plan_run, slice_labels, write_workload_config
    from tasks.prepare import check_inputs
    from tasks.pricing import price_for
    from tasks.progress import write_loss_curve
    from tasks.training import workload_command
    from tasks.watch import WatchSettings, watch_slice
    from workloads import checkpoint, data, evaluate
    from workloads.rundir import RunDir

    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    started = datetime.now(UTC)
    plan, _ = check_inputs(config, plan_run(config))  # what the validate task does
    price_for(config)
    shards = data.shard_dataset(config.dataset, plan.datasets_root)
    path = write_workload_config(config, plan, shards.dataset_dir)
    lap("shard")
    provider = build_provider("local", plan.slices_root, config.slice)
    spec = SliceSpec(
        name=plan.slice_name,
        labels=slice_labels(plan, attempt=1),
        devices=config.slice.devices,
        hosts=config.slice.hosts,
        command=workload_command(path),
        env={"TPUPIPE_ATTEMPT": "1"},
        log_path=f"{plan.run_dir}/logs/{plan.slice_name}.log",
        run_dir=plan.run_dir,
    )
    provider.create(spec)
    try:
        settings = WatchSettings(config.slice.poll_interval_s, 600.0, 5.0)
        watch_slice(provider, plan.slice_name, RunDir(plan.run_dir), settings, lambda _: None)
    finally:
        provider.delete(plan.slice_name)
    lap("train")
    verified = checkpoint.verify_checkpoint(plan.run_dir, config.train.steps, plan.config_hash)
    result = evaluate.evaluate(load_workload_config(plan), verified.step)
    evaluate.write_result(plan.run_dir, result)
    lap("verify_evaluate")
    run, steps, evals = build_rows(config, plan, started, verified, result)
    sink = build_sink(config.metrics.sink, plan.metrics_path, config.metrics)
    sink.ensure_tables()
    sink.land(run, steps, evals)
    write_loss_curve(plan.run_dir)  # the summary's picture: pipeline output, not overhead
    lap("land")
    return seconds


WARM_UP_FLOW = """
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact


@task
def step(i: int) -> int:
    get_run_logger().info("warm-up task %d", i)
    return i


@flow
def warm_up() -> None:
    create_progress_artifact(progress=0.0, description="warm-up")
    create_markdown_artifact("warm-up", key="warm-up")
    for i in range(3):
        step(i)


warm_up()
"""


def warm_up_server() -> None:
    """Run a small flow against the just-started API, from another process, before the clock.

    A deployment's server has served flow runs before. A fresh one pays one-time costs: its
    first request after `/health` took 0.56 s (0.025 s for the same request again), and the
    first flow's registration once took 0.41 s (0.016 s after this warm-up). From
    another process, so the flow's own process still pays its client's first-use costs
    (imports, the version check, the events connection) on the clock, as a deployment's
    fresh flow-run process does.
    """
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cmd = [sys.executable, "-c", WARM_UP_FLOW]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"warm-up flow failed:\n{out.stderr[-3000:]}")


def side(name: str, root: Path, steps: int) -> dict:
    """Child process: run one side from an empty `root`; its seconds (and stages)."""
    if name == "direct":
        stages = direct(config_for(root, steps))
        return {"seconds": sum(stages.values()), "stages": stages}
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import tpu_training_pipeline

    with prefect_test_harness(server_startup_timeout=120):  # started before the clock
        warm_up_server()
        start = time.perf_counter()
        tpu_training_pipeline(config=config_for(root, steps))
        return {"seconds": time.perf_counter() - start}


def _run_side(name: str, root: Path, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--side", name, "--root", str(root), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{name} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--side", choices=["direct", "flow"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.root, args.steps)))
        return 0

    runs: dict[str, list[dict]] = {"direct": [], "flow": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            # Each side in a fresh process, so neither inherits the other's imports and
            # caches; the order alternates, so neither always runs second either.
            for name in ("direct", "flow") if i % 2 == 0 else ("flow", "direct"):
                runs[name].append(_run_side(name, Path(tmp) / f"{name}-{i}", args.steps))
    best_direct = min(runs["direct"], key=lambda r: r["seconds"])
    flow_s = min(r["seconds"] for r in runs["flow"])
    figures = {
        "steps": args.steps,
        "flow_s": round(flow_s, 2),
        "direct_s": round(best_direct["seconds"], 2),
        "direct_stages_s": {k: round(v, 2) for k, v in best_direct["stages"].items()},
        "flow_over_direct": round(flow_s / best_direct["seconds"], 3),
        "flow_s_per_repeat": [round(r["seconds"], 2) for r in runs["flow"]],
        "direct_s_per_repeat": [round(r["seconds"], 2) for r in runs["direct"]],
    }
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
