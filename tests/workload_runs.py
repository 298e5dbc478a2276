"""Run the real training workload on a local slice and interrupt it, for the tests."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from infra.slices import LocalSliceProvider, SliceSpec, SliceState
from tasks.plan import plan_run, write_workload_config
from tests.helpers import tiny_config
from workloads import data
from workloads.events import grant_lease
from workloads.rundir import RunDir


class WorkloadRun:
    """One run directory, and attempts of the workload on it started and stopped at will."""

    def __init__(self, root: Path, *overrides: str) -> None:
        self.config = tiny_config(root, *overrides)
        self.plan = plan_run(self.config)
        dataset = data.shard_dataset(self.config.dataset, self.plan.datasets_root)
        self.config_path = write_workload_config(self.config, self.plan, dataset.dataset_dir)
        self.provider = LocalSliceProvider(root / "slices")
        self.run_dir = Path(self.plan.run_dir)
        self.attempts = 0

    def start(self, lease: str | None = None) -> str:
        """Launch a new attempt (holding `lease`, if given); returns its slice name."""
        self.attempts += 1
        name = f"{self.plan.run_id}-{self.attempts}"
        env = {"TPUPIPE_ATTEMPT": str(self.attempts)}
        if lease:
            grant_lease(str(self.run_dir), self.attempts, lease)
            env["TPUPIPE_LEASE"] = lease
        self.provider.create(
            SliceSpec(
                name=name,
                devices=self.config.slice.devices,
                hosts=self.config.slice.hosts,
                command=[sys.executable, "-m", "workloads.train", "--config", self.config_path],
                env=env,
                log_path=str(self.run_dir / "logs" / f"{name}.log"),
            )
        )
        return name

    def wait(self, name: str, timeout_s: float = 240.0) -> int:
        """Wait for the attempt to exit; returns its exit code."""
        deadline = time.monotonic() + timeout_s
        while (status := self.provider.status(name)).state is SliceState.READY:
            assert time.monotonic() < deadline, f"attempt {name} did not finish"
            time.sleep(0.05)
        self.provider.delete(name)
        return status.exit_code

    def run_to_end(self) -> int:
        """One attempt from wherever the run is to its last step."""
        return self.wait(self.start())

    def metrics(self) -> list[dict]:
        """Complete rows of metrics.jsonl, in the order they were written."""
        return RunDir(self.run_dir).read_metrics()

    def signal_at(
        self, name: str, min_step: int, sig: signal.Signals, committed: int | None = None
    ) -> int:
        """Send `sig` to the attempt's process group once it has logged `min_step` (and,
        if given, once checkpoint step `committed` has been committed).

        Returns:
            The last step the metrics showed when the signal was sent.
        """
        pgid = json.loads((self.provider.registry_dir / f"{name}.json").read_text())["pgid"]
        deadline = time.monotonic() + 240

        def ready(rows: list[dict]) -> bool:
            done = committed is None or (self.run_dir / "checkpoints" / str(committed)).exists()
            return bool(rows) and rows[-1]["step"] >= min_step and done

        while not ready(rows := self.metrics()):
            assert time.monotonic() < deadline, f"attempt {name} never reached {min_step}"
            assert self.provider.status(name).state is SliceState.READY, "attempt ended early"
            time.sleep(0.01)
        os.killpg(pgid, sig)
        return rows[-1]["step"]

    def signal_in_phase(self, name: str, phase: str, sig: signal.Signals) -> None:
        """Send `sig` to the attempt's process group once its heartbeat shows `phase`."""
        pgid = json.loads((self.provider.registry_dir / f"{name}.json").read_text())["pgid"]
        deadline = time.monotonic() + 240
        status = self.run_dir / "status.json"
        while not (status.exists() and json.loads(status.read_text())["phase"] == phase):
            assert time.monotonic() < deadline, f"attempt {name} never reached {phase}"
            assert self.provider.status(name).state is SliceState.READY, "attempt ended early"
            time.sleep(0.005)
        os.killpg(pgid, sig)

    def status(self) -> dict:
        """The workload's last heartbeat."""
        return json.loads((self.run_dir / "status.json").read_text())
