"""The Prefect UI's run forms of the `train` and `sweep` deployments. The form sends every
field it shows, and it showed the default config's model dimensions, devices, hosts and
decoding next to the size, TPU type and corpus a user picked: given explicitly, they
overrode what those fill in. A run of `model.size: small` from the form trained the tiny
model, silently; a TPU type was refused until devices and hosts were typed in by hand
(probe X, session 39). The form now starts with those fields empty."""

from __future__ import annotations

import copy

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from flows.pipeline import tpu_training_pipeline
from flows.sweep import sweep
from tasks.sweep_space import SweepConfig
from tasks.sweep_trials import build_trials
from tests.helpers import REPO
from workloads.config import PipelineConfig
from workloads.config_file import load_config
from workloads.config_model import MODEL_SIZES


def form(flow) -> tuple[dict, dict]:
    """What the flow's run form starts from (its `config` default), and the schema the
    API checks a run's parameters against (`enforce_parameter_schema`)."""
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    return copy.deepcopy(schema["properties"]["config"]["default"]), schema


def submitted(flow, config: dict) -> dict:
    """`config` as the form submits it: checked by the API as a run of it would be."""
    _, schema = form(flow)
    validate({"config": config}, schema, raise_on_error=True)
    return config


def dims(model) -> dict:
    return {k: getattr(model, k) for k in MODEL_SIZES["tiny"]}


def test_the_train_form_starts_with_what_sections_fill_in_empty_and_means_the_default():
    config, _ = form(tpu_training_pipeline)
    assert {k: config["model"][k] for k in MODEL_SIZES["tiny"]} == dict.fromkeys(
        MODEL_SIZES["tiny"]
    )
    assert (config["slice"]["devices"], config["slice"]["hosts"]) == (None, None)
    assert config["dataset"]["errors"] is None
    # Submitted as it is, it is the default config, and the one the nightly run trains.
    as_sent = PipelineConfig.model_validate(submitted(tpu_training_pipeline, config))
    assert as_sent.model_dump() == PipelineConfig().model_dump()
    assert as_sent.config_hash() == PipelineConfig().config_hash()


@pytest.mark.parametrize("size", ["small", "base"])
def test_a_size_picked_in_the_train_form_trains_that_size(size):
    config, _ = form(tpu_training_pipeline)
    config["model"]["size"] = size
    model = PipelineConfig.model_validate(submitted(tpu_training_pipeline, config)).model
    assert dims(model) == MODEL_SIZES[size]
    config["model"]["d_ff"] = 1024  # a dimension typed in still overrides the size's
    model = PipelineConfig.model_validate(submitted(tpu_training_pipeline, config)).model
    assert dims(model) == {**MODEL_SIZES[size], "d_ff": 1024}


def test_a_tpu_type_picked_in_the_train_form_sets_devices_and_hosts():
    config, _ = form(tpu_training_pipeline)
    gcp = load_config(REPO / "configs" / "v5e-8-spot.yaml", []).model_dump(mode="json")["slice"]
    config["slice"] = {**gcp, "accelerator_type": "v5litepod-16", "devices": None, "hosts": None}
    config["mesh"] = {"data": 16, "fsdp": 1, "tensor": 1}
    cfg = PipelineConfig.model_validate(submitted(tpu_training_pipeline, config))
    assert (cfg.slice.devices, cfg.slice.hosts) == (16, 4)


def test_a_corpus_typed_in_the_train_form_is_decoded_strictly(tmp_path):
    # The stdlib corpus's lenient decoding came along in the form: a user's own corpus
    # from the UI had its bad bytes replaced silently, where the README promises an error.
    (tmp_path / "a.txt").write_text("text")
    config, _ = form(tpu_training_pipeline)
    config["dataset"]["sources"] = [str(tmp_path / "a.txt")]
    cfg = PipelineConfig.model_validate(submitted(tpu_training_pipeline, config))
    assert cfg.dataset.errors == "strict"


def test_a_size_picked_for_the_base_in_the_sweep_form_reaches_every_trial():
    config, _ = form(sweep)
    assert config["base"]["model"]["d_model"] is None
    config["base"]["model"]["size"] = "small"
    config["space"] = {"grid": {"seed": [1, 2]}}
    trials = build_trials(SweepConfig.model_validate(submitted(sweep, config)), "sw")
    assert [dims(t.config.model) for t in trials] == [MODEL_SIZES["small"]] * 2


def test_a_filled_in_field_set_to_none_in_python_is_filled_in_again():
    # Assigned None after validation, it stayed None, and a sweep built on the config
    # failed with a TypeError (probe P, session 39).
    cfg = PipelineConfig()
    cfg.model.size = "small"
    cfg.model.d_model = None
    cfg.slice.devices = None
    assert (cfg.model.d_model, cfg.slice.devices) == (512, 8)
    trials = build_trials(SweepConfig(base=cfg, space={"grid": {"seed": [1]}}), "sw")
    assert (trials[0].config.model.d_model, trials[0].config.slice.devices) == (512, 8)
