"""Config values YAML or a user gets subtly wrong, and errors that blame the right place:
a line of the file, or the `--set` a value came from."""

from __future__ import annotations

import re

import pytest

from flows.cli import main as cli_main
from workloads.config_file import ConfigError, load_config

# Every mesh axis above one, so the divisibility rules all apply.
BASE = """\
run_name: base
seed: 0
model: {d_model: 32, n_layers: 1, n_heads: 2, d_ff: 64, max_seq_len: 64}
dataset: {seq_len: 32}
train:
  steps: 12
  batch_size: 16
  warmup_steps: 2
mesh: {data: 2, fsdp: 2, tensor: 2}
"""


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "train: {steps: true, warmup_steps: 0}",
            r":1: train\.steps: .*valid integer \(got True\)",
        ),
        ("train: {steps: 12.0}", r":1: train\.steps: .*valid integer \(got 12\.0\)"),
        ('train: {steps: "12"}', r":1: train\.steps: .*valid integer \(got '12'\)"),
        ("seed: no", r":1: seed: .*valid integer \(got False\)"),
        ("mesh:\n  data: yes", r":2: mesh\.data: .*valid integer \(got True\)"),
        ("slice: {hosts: true}", r"slice\.hosts: .*valid integer"),
        ("resilience: {max_failures: true}", r"resilience\.max_failures: .*valid integer"),
        ("dataset: {max_bytes: 1.0e+9}", r"dataset\.max_bytes: .*valid integer"),
        ("train: {learning_rate: true}", r"train\.learning_rate: True is a boolean, not a number"),
        ("slice: {poll_interval_s: .inf}", r"slice\.poll_interval_s: .*finite number"),
        ("cost: {usd_per_chip_hour: .inf}", r"cost\.usd_per_chip_hour: .*finite number"),
        ("resilience: {backoff_s: .nan}", r"resilience\.backoff_s: .*finite number"),
    ],
)
def test_numbers_are_numbers_of_their_type(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text + "\n"))


@pytest.mark.parametrize(
    ("section", "field", "written", "read_as"),
    [
        ("train", "steps", "010", "8"),  # octal
        ("train", "seed", "0777", "511"),
        ("model", "d_model", "0x20", "32"),
        ("train", "steps", "0b1100", "12"),
        ("train", "steps", "1:30", "90"),  # base 60
        ("train", "learning_rate", "1:30", "90"),
    ],
)
def test_numbers_yaml_reads_from_another_base_are_refused(
    tmp_path, section, field, written, read_as
):
    # YAML 1.1 took them silently: `steps: 010` trained 8 steps (probe Q).
    if field == "seed":
        section, text = None, f"seed: {written}\n"
    else:
        text = f"{section}:\n  {field}: {written}\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    name = f"{section}.{field}" if section else field
    line = 2 if section else 1
    said = f"{path}:{line}: {name}: {written!r} is not a decimal number: YAML reads it as {read_as}"
    assert str(err.value).startswith(said), err.value


def test_a_number_from_another_base_in_a_merge_key_is_refused(tmp_path):
    # `<<: {steps: 010}` merged the octal 8 into train, past the check (probe R).
    path = write(tmp_path, "train:\n  <<: {steps: 010}\n")
    with pytest.raises(ConfigError, match=r":2: train.steps: '010' is not a decimal number"):
        load_config(path)


def test_a_number_from_another_base_in_an_override_is_refused_and_text_is_kept(tmp_path):
    with pytest.raises(ConfigError, match=r"--set 'train.steps=010': train.steps: '010' is not"):
        load_config(write(tmp_path, BASE), ["train.steps=010"])
    # Text fields keep what was written; decimal forms pass.
    ok = "run_name: '0x20'\ndataset: {sources: [stdlib, 010]}\ntrain: {steps: +1_000}\n"
    cfg = load_config(write(tmp_path, ok), ["run_name=010"])
    assert (cfg.run_name, cfg.dataset.sources[1], cfg.train.steps) == ("010", "010", 1000)


@pytest.mark.parametrize(
    ("text", "line", "said"),
    [
        ("train:\n  steps: 3\n  on: 2\n", 3, "train: the key 'on' is read by YAML as the boolean"),
        ("yes: 1\n", 1, "the key 'yes' is read by YAML as the boolean True"),
        ("model:\n  1: 2\n", 2, "model: the key '1' is read by YAML as the number 1"),
        ("slice: {~: a}\n", 1, "slice: the key '~' is read by YAML as null"),
    ],
)
def test_a_key_yaml_reads_as_a_value_names_its_line_and_the_word(tmp_path, text, line, said):
    # `on:` is YAML 1.1's True: pydantic said 'train.1: Keys should be strings (got True)',
    # at the section's line (probe Q's leftover).
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:{line}: {said}"), err.value
    assert "quote it" in str(err.value)
    with pytest.raises(ConfigError, match=r"--set 'train=\{no: 1\}': train: the key 'no' is"):
        load_config(write(tmp_path, BASE), ["train={no: 1}"])
    # Quoted, the word is a name like any other: an unknown field, said as such.
    with pytest.raises(ConfigError, match=r"train\.on"):
        load_config(write(tmp_path, "train: {'on': 2}\n"))


def test_floats_still_take_ints_and_exponents_without_a_dot(tmp_path):
    # PyYAML reads 1e-3 as a string: refusing it would refuse how people write rates.
    cfg = load_config(write(tmp_path, "train: {learning_rate: 1e-3, weight_decay: 0}\n"))
    assert (cfg.train.learning_rate, cfg.train.weight_decay) == (1e-3, 0.0)


def test_warmup_must_be_below_steps_even_for_a_single_step(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(
        ConfigError, match=r"train\.warmup_steps = 1 must be below train\.steps = 1"
    ):
        load_config(path, ["train.steps=1", "train.warmup_steps=1"])
    assert load_config(path, ["train.steps=1", "train.warmup_steps=0"]).train.steps == 1


def test_d_ff_must_divide_only_over_the_axis_that_splits_it(tmp_path):
    # The MLP kernels split d_ff over `tensor` only (workloads/model.py): 36 on fsdp=8 trains.
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["model.d_ff=36", "mesh={data: 1, fsdp: 8, tensor: 1}"])
    assert cfg.model.d_ff == 36
    with pytest.raises(ConfigError, match=r"model\.d_ff = 66 is not divisible by mesh\.tensor = 4"):
        load_config(
            path, ["model.d_ff=66", "model.n_heads=4", "mesh={data: 1, fsdp: 2, tensor: 4}"]
        )
    with pytest.raises(
        ConfigError, match=r"model\.d_model = 36 is not divisible by mesh\.fsdp = 8"
    ):
        load_config(path, ["model.d_model=36", "mesh={data: 1, fsdp: 8, tensor: 1}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # a section the override created, not in the file
        (["trian.steps=3"], r"^--set: trian: Extra inputs .* \(from --set trian\.steps=3\)$"),
        # a section the override replaced: its fields are no longer the file's lines
        (
            ["train={steps: 0}"],
            r"^--set: train\.steps: .* \(got 0, from --set 'train=\{steps: 0\}'\)$",
        ),
        (["dataset.sources=[a, [b]]"], r"^--set: dataset\.sources\.1: .*valid string \(from --set"),
        (
            ["seed=-1"],
            r"^--set: seed: .*greater than or equal to 0 \(got -1, from --set seed=-1\)$",
        ),
        # a cross-field problem: the file's field keeps its line, the override is named
        (
            ["train.steps=2"],
            r"c\.yaml:8: train\.warmup_steps = 2 must be below train\.steps = 2 "
            r"\(with --set train\.steps=2\)$",
        ),
        (
            ["slice.devices=12", "mesh.data=3"],
            r"c\.yaml:7: train\.batch_size = 16 is not divisible .* = 6 "
            r"\(with --set mesh\.data=3\)$",
        ),
        (["slice.chaos.times=2"], r"^--set: slice\.chaos: slice\.chaos\.times > 0 needs a trigger"),
        # an override a later one replaced is not named: it had no effect
        (
            ["train.steps=20", "train.steps=2"],
            r"c\.yaml:8: train\.warmup_steps = 2 must be below train\.steps = 2 "
            r"\(with --set train\.steps=2\)$",
        ),
        (
            ["train.steps=20", "train={steps: 2, warmup_steps: 2}"],
            r"train\.warmup_steps = 2 must be below .* "
            r"\(from --set 'train=\{steps: 2, warmup_steps: 2\}'\)$",
        ),
    ],
)
def test_a_value_from_set_is_blamed_on_its_override(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE), overrides)
    assert any(re.search(message, line) for line in str(err.value).splitlines()), err.value


def test_a_problem_with_a_field_left_at_its_default_names_the_line_of_the_other(tmp_path):
    # No mesh section: the default mesh (8 devices) against the slice the file gives.
    path = write(tmp_path, "run_name: small\nslice:\n  provider: local\n  devices: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:4: mesh.data*mesh.fsdp*mesh.tensor = 8*1*1 = 8 does not equal " in str(
        err.value
    )


def test_a_bad_value_in_the_file_is_shown_with_its_line(tmp_path):
    path = write(tmp_path, BASE.replace("steps: 12", "steps: twelve"))
    with pytest.raises(ConfigError, match=rf"^{path}:6: train\.steps: .* \(got 'twelve'\)$"):
        load_config(path)


def test_a_key_given_twice_in_an_override_value_is_named(tmp_path):
    # As in the file: YAML would silently keep the last `steps`.
    with pytest.raises(
        ConfigError, match=r"^--set 'train=\{steps: 1, steps: 2\}': .* 'steps' twice"
    ):
        load_config(write(tmp_path, BASE), ["train={steps: 1, steps: 2}"])


def test_an_override_key_with_an_empty_part_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--set 'train\.\.steps=1': the key .* empty part"):
        load_config(write(tmp_path, BASE), ["train..steps=1"])


@pytest.mark.parametrize(
    ("text", "field", "expected"),
    [
        ("slice: {project: 123456}", ("slice", "project"), "123456"),
        ("dataset: {sources: [2024, on, a]}", ("dataset", "sources"), ["2024", "on", "a"]),
        ("storage: {root: 1.5}", ("storage", "root"), "1.5"),
        ("run_name: null", ("run_name",), None),
        ("run_name:", ("run_name",), None),
        ("run_name: '123'", ("run_name",), "123"),
    ],
)
def test_string_fields_keep_the_text_yaml_would_retype(tmp_path, text, field, expected):
    cfg = load_config(write(tmp_path, text + "\n"))
    value = cfg
    for part in field:
        value = getattr(value, part)
    assert value == expected


def test_string_overrides_keep_their_text_and_null_is_none(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["slice.project=0123", "run_name=2024-01-01", "storage.root=/d/x #1"])
    assert (cfg.slice.project, cfg.run_name, cfg.storage.root) == ("0123", "2024-01-01", "/d/x #1")
    assert load_config(path, ["run_name=null"]).run_name is None
    assert load_config(path, ["run_name='abc'"]).run_name == "abc"
    with pytest.raises(ConfigError, match=r"^--set: run_name: run_name 'a: b' must be"):
        load_config(path, ["run_name=a: b"])


@pytest.mark.parametrize("text", ['run_name: ""', "run_name: ''", "run_name: null"])
def test_an_empty_run_name_means_a_new_one_as_documented(tmp_path, text):
    # The field's description (the Prefect form's help) says empty generates a name, and
    # the form may send "" for a cleared box.
    assert load_config(write(tmp_path, BASE.replace("run_name: base", text))).run_name is None


@pytest.mark.parametrize("name", ["0x1F", "1_000", "No", "1.5"])
def test_a_name_kept_as_written_still_follows_the_name_rules(tmp_path, name):
    with pytest.raises(ConfigError, match=rf"c\.yaml:1: run_name: run_name '{name}' must be"):
        load_config(write(tmp_path, f"run_name: {name}\n"))


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "train:\n  batch_size: [16\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: not valid YAML: .*flow sequence at line 2"):
        load_config(path)
    path = write(tmp_path, "seed: 0\nrun_name: a\x07b\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: not valid YAML: unacceptable character"):
        load_config(path)


def test_a_problem_mentioning_a_semicolon_stays_on_one_line(tmp_path):
    path = write(
        tmp_path,
        "slice: {provider: gcp, zone: us-west4-a, accelerator_type: v5litepod-8, "
        "runtime_version: v2-alpha-tpuv5-lite, wheel: 'gs://bkt/w.whl'}\n"
        "cost: {priced_as: v5litepod-8, region: us-central1}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (
        f"{path}:2: cost.priced_as = 'v5litepod-8' is for local slices (a gcp slice is "
        "priced at slice.accelerator_type = 'v5litepod-8')" in str(err.value).splitlines()
    )


def test_odd_shapes_are_config_errors_not_tracebacks(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.size: Input should be 'tiny'"):
        load_config(write(tmp_path, "model: {size: [tiny]}\n"))
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(write(tmp_path, "seed: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_anchors_standing_for_billions_of_nodes_are_not_walked_again(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(ConfigError, match=r"c\.yaml:1: a0: Extra inputs"):
        load_config(write(tmp_path, "\n".join(lines) + "\n"))


def test_cli_exits_2_naming_the_override(tmp_path, capsys):
    path = write(tmp_path, BASE)
    assert cli_main(["validate", "--config", str(path), "--set", "train.steps=true"]) == 2
    err = capsys.readouterr().err
    assert "--set: train.steps: Input should be a valid integer (got True, from --set " in err


@pytest.mark.parametrize(
    "field", ["slice.project", "storage.project", "metrics.project"], ids=lambda f: f
)
@pytest.mark.parametrize(
    ("value", "said"),
    [("''", "is empty"), ("'My Project!'", "is neither a project id"), ("abc", "neither")],
)
def test_a_project_that_cannot_be_one_is_refused_naming_its_field(tmp_path, field, value, said):
    # An empty one failed only at the first API call, after sharding and uploading; a
    # malformed one reached the TPU API.
    section, key = field.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"{field}: .*{said}"):
        load_config(path)


@pytest.mark.parametrize("value", ["123456", "my-project-123", "example.com:my-project"])
def test_project_ids_and_numbers_are_taken(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"slice:\n  project: '{value}'\n")
    assert load_config(path).slice.project == value


def test_a_config_that_is_a_device_or_too_large_is_refused_without_reading_it_all(tmp_path):
    # `--config /dev/zero` read until the machine's memory ran out: the OOM killer struck
    # machine-wide (probe Z, session 39).
    with pytest.raises(ConfigError, match=r"^/dev/zero: a device, not a config file$"):
        load_config("/dev/zero")
    path = write(tmp_path, "run_name: big\n" + "# padding\n" * (11 * 2**20 // 10))
    with pytest.raises(ConfigError, match=rf"^{path}: over 10 MiB: not a config file$"):
        load_config(path)


def test_a_fifo_nothing_writes_to_is_an_empty_config_and_a_pipe_is_read(tmp_path):
    # A FIFO with no writer hung `tpupipe validate` without a word (probe Z); a pipe with
    # one (`--config <(...)`) must still be read.
    import os
    import threading

    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    said = []

    def load() -> None:
        try:
            load_config(fifo)
        except ConfigError as exc:
            said.append(str(exc))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(20)
    assert said == [f"{fifo}: a FIFO with no writer when it was read: nothing to read"]

    read, written = os.pipe()
    os.write(written, BASE.encode())
    os.close(written)
    try:
        assert load_config(f"/dev/fd/{read}").train.steps == 12
    finally:
        os.close(read)
