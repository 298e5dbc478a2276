"""Orchestration overhead: the pipeline flow's wall time ÷ the same stages called directly.

    .venv/bin/python bench/pipeline.py [--steps 150] [--repeats 2] [--out FILE]

Both sides run configs/tiny.yaml (with `--steps` training steps) from an empty storage
root, so each shards, compiles cold, trains, verifies, evaluates and lands the same work:

- flow: `tpu_training_pipeline(config)`, against a temporary Prefect API that is started,
  and has answered one request, before the clock does (a deployment's server is already
  up, past its first request's one-time set-up);
- direct: the functions the tasks wrap, in order, with no Prefect at all: plan, shard,
  create the local slice and watch the workload to its end, delete it, verify the
  checkpoint, evaluate it, land the rows in DuckDB and draw the loss curve.

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
    plan = plan_run(config)
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


def warm_up_server() -> None:
    """Have the just-started API answer one request, as a deployment's server long since has.

    A fresh Prefect server spends ~0.6 s on its first request after `/health` (0.56 s, then
    0.025 s for the same request again): a start-up cost, not a run's. A raw HTTP request,
    not Prefect's client, so the flow's own client still makes its first-use checks on the
    clock.
    """
    import httpx
    from prefect.settings import PREFECT_API_URL

    httpx.get(f"{PREFECT_API_URL.value()}/admin/version", timeout=60).raise_for_status()


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
