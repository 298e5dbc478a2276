"""Config files and overrides a user gets wrong: each is refused with its place named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flows.cli import main as cli_main
from tests.helpers import REPO
from workloads.config_file import ConfigError, load_config


def write(tmp_path, data: str | bytes):
    path = tmp_path / "c.yaml"
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("text", ["", "# only a comment\n\n", "---\n"])
def test_an_empty_config_is_an_error(tmp_path, text):
    with pytest.raises(ConfigError, match=r"c\.yaml: the config is empty"):
        load_config(write(tmp_path, text))


def test_a_key_given_twice_names_both_lines(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\n  batch_size: 8\n  steps: 20\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml:4: duplicate key 'steps' \(first given at line 2\)"
    ):
        load_config(path)
    path = write(tmp_path, "train: {steps: 10}\nseed: 1\ntrain: {batch_size: 8}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: duplicate key 'train' .*line 1\)"):
        load_config(path)


def test_a_config_that_is_not_utf8_names_the_byte(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8 text \(invalid byte at offset 13\)"):
        load_config(write(tmp_path, b"run_name: caf\xe9\n"))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("seed=-1", r"--set: seed: .*greater than or equal to 0"),
        ("seed=4294967296", r"--set: seed: .*less than or equal to 4294967295"),
        ("train.learning_rate=.inf", r"train\.learning_rate: .*finite"),
        ("train.learning_rate=.nan", r"train\.learning_rate: .*finite"),
        ("train.learning_rate=1e39", r"1e\+39 is inf in float32"),
        ("train.weight_decay=1e300", r"train\.weight_decay: 1e\+300 is inf in float32"),
        ("train.grad_clip_norm=1e300", r"train\.grad_clip_norm: 1e\+300 is inf in float32"),
        ("train.grad_clip_norm=0", r"train\.grad_clip_norm: .*greater than 0"),
        # 0 in float32 (flushed to zero below the smallest normal): the run never learned.
        ("train.grad_clip_norm=1e-50", r"train\.grad_clip_norm: 1e-50 is 0 in float32"),
        ("train.learning_rate=1e-39", r"train\.learning_rate: 1e-39 is 0 in float32"),
        ("train.weight_decay=1e-45", r"train\.weight_decay: 1e-45 is 0 in float32"),
    ],
)
def test_values_the_device_cannot_hold_are_refused(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "seed: 0\n"), [setting])


def test_the_largest_seed_and_a_huge_finite_learning_rate_are_valid(tmp_path):
    cfg = load_config(write(tmp_path, "seed: 4294967295\ntrain: {learning_rate: 1.0e+30}\n"))
    assert cfg.seed == 2**32 - 1 and cfg.train.learning_rate == 1e30


def test_an_override_that_is_not_yaml_is_named(tmp_path, capsys):
    path = write(tmp_path, "seed: 0\n")
    with pytest.raises(ConfigError, match=r"--set 'train\.steps=\[1': the value is not valid YAML"):
        load_config(path, ["train.steps=[1"])
    assert cli_main(["validate", "--config", str(path), "--set", "train.steps=[1"]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["123", "2024-01-01", "no", "1e3"])
def test_run_names_yaml_would_retype_are_kept_as_written(tmp_path, name):
    assert load_config(write(tmp_path, f"run_name: {name}\n")).run_name == name
    assert load_config(write(tmp_path, "seed: 0\n"), [f"run_name={name}"]).run_name == name
    with pytest.raises(ConfigError, match="run_name 'No'"):
        load_config(write(tmp_path, "run_name: No\n"))


def test_a_bad_workload_config_is_one_line_not_a_traceback(tmp_path):
    # In subprocesses: the workload's entry points configure logging for their process.
    def run(module: str, config) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", module, "--config", str(config)]
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)

    bad = tmp_path / "config.json"
    bad.write_text('{"run_dir": 3}')
    train = run("workloads.train", bad)
    assert train.returncode == 1  # never retried
    assert f"{bad}: not a workload config: pipeline: Field required (and 4 more)" in train.stderr
    assert "Traceback" not in train.stderr
    missing = tmp_path / "missing.json"
    evaluate = run("workloads.evaluate", missing)
    assert evaluate.returncode == 2
    assert evaluate.stderr.startswith(f"{missing}: cannot read the workload config")
    assert "Traceback" not in evaluate.stderr


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ('run_name="nightly\\n"', "run_name"),
        ('slice.zone="us-west4-a\\n"', "slice.zone"),
        ('slice.project="my-project\\n"', "slice.project"),
        ('metrics.location="us-central1\\n"', "metrics.location"),
        ('metrics.dataset="tpupipe\\n"', "metrics.dataset"),
        ('cost.region="us-central1\\n"', "cost.region"),
    ],
)
def test_a_name_with_a_trailing_newline_is_refused(tmp_path, setting, field):
    # What a YAML block scalar (`run_name: |`) or a pasted value gives: `$` in a pattern
    # matched before it, so `nightly\n` named the run directory, and the TPU node failed
    # only at the API, after sharding.
    with pytest.raises(ConfigError, match=rf"{field}"):
        load_config(write(tmp_path, "seed: 0\n"), [setting])


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("slice.zone=us-central\u0661-a", "slice.zone"),  # an Arabic-Indic 1
        ("slice.fallback_zones=[us-east\uff15-b]", r"slice\.fallback_zones"),  # fullwidth 5
        ("cost.region=us-central\u0661", "cost.region"),
        ("metrics.location=us-central\u0661", "metrics.location"),
        ("slice.accelerator_type=v5litepod-\u0668", "slice.accelerator_type"),
    ],
)
def test_a_name_with_a_digit_of_another_script_is_refused(tmp_path, setting, field):
    # `\d` matches any Unicode digit: these passed validation, the TPU type was even
    # priced (int() reads the digit), and the API would have refused them after sharding.
    gcp = "slice: {provider: gcp, zone: us-west4-a, accelerator_type: v5litepod-8, "
    gcp += "runtime_version: v2-alpha-tpuv5-lite, wheel: gs://bkt/w.whl}\n"
    text = gcp if setting.startswith("slice.") else "seed: 0\n"
    with pytest.raises(ConfigError, match=field):
        load_config(write(tmp_path, text), [setting])


def test_a_run_name_from_a_yaml_block_scalar_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"run_name 'nightly\\n' must be"):
        load_config(write(tmp_path, "run_name: |\n  nightly\n"))


def _name_checks():
    from infra.metrics.bigquery_sql import sql_literal
    from infra.slices.base import validate_labels, validate_name
    from tasks.sweep_space import SweepConfig

    return {
        "slice name": lambda: validate_name("tpupipe-nightly\n"),
        "label value": lambda: validate_labels({"run-id": "nightly\n"}),
        "label key": lambda: validate_labels({"run-id\n": "x"}),
        # A newline in a SQL string literal failed the landing script, after training.
        "landed run id": lambda: sql_literal("nightly\n"),
        "sweep name": lambda: SweepConfig(sweep_name="lr\n"),
    }


@pytest.mark.parametrize(
    "check", ["slice name", "label value", "label key", "landed run id", "sweep name"]
)
def test_names_checked_outside_the_config_refuse_a_trailing_newline_too(check):
    with pytest.raises(ValueError, match=r"\\n"):
        _name_checks()[check]()
