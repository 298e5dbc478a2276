"""Goodput of a demo-sized run preempted (SIGTERM) every `--every` seconds.

    .venv/bin/python bench/goodput.py [--every 120] [--out FILE]

Runs the real pipeline flow on configs/demo.yaml with the local provider's chaos option
sending SIGTERM `--every` seconds into each attempt, then reads the run's ledger
(events.jsonl): goodput = productive step time ÷ wall time, with the badput buckets.
Goal: ≥ 0.90 with a SIGTERM every 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=float, default=120.0, help="seconds between SIGTERMs")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from flows.pipeline import tpu_training_pipeline
    from tasks.goodput import compute_goodput, read_events
    from workloads.config_file import load_config

    with tempfile.TemporaryDirectory() as root:
        config = load_config(
            REPO / "configs" / "demo.yaml",
            [
                f"storage.root={root}",
                "run_name=goodput",
                f"train.steps={args.steps}",
                "slice.chaos.signal=TERM",
                f"slice.chaos.after_s={args.every}",
                "slice.chaos.times=1000",
            ],
        )
        run = tpu_training_pipeline(config=config)
        ledger = compute_goodput(read_events(Path(run.run_dir) / "events.jsonl"))
    result = {
        "sigterm_every_s": args.every,
        "steps": args.steps,
        "attempts": ledger.attempts,
        "preemptions": ledger.preemptions,
        "wall_s": ledger.wall_s,
        "goodput": ledger.goodput,
        "seconds": ledger.seconds,
        "goal": ">= 0.90",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
