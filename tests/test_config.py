"""Config validation: every bad input is named, with its file and line, before any cost."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flows.cli import main as cli_main
from tasks.plan import plan_run, write_workload_config
from tasks.rerun import check_resumable
from tests.helpers import REPO, six_document_run
from workloads.config import PipelineConfig, padded_vocab_size
from workloads.config_file import ConfigError, load_config


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == cfg.slice.devices


def test_batch_not_divisible_names_fields_and_line(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\n  batch_size: 30\nmesh:\n  data: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:3:" in msg
    assert "train.batch_size = 30" in msg and "mesh.data*mesh.fsdp = 8" in msg


def test_mesh_must_match_devices(tmp_path):
    path = write(tmp_path, "mesh: {data: 2, fsdp: 2, tensor: 1}\n")
    with pytest.raises(ConfigError, match=r"= 4 does not equal slice.devices = 8"):
        load_config(path)


def test_field_error_points_at_its_line(tmp_path):
    path = write(tmp_path, "run_name: ok\nmodel:\n  n_layers: 0\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: model.n_layers: .*greater than"):
        load_config(path)


def test_integers_past_what_can_train_or_be_stored_are_refused_naming_field_and_line(tmp_path):
    # optax counts steps in int32; Prefect's API and database hold 64-bit integers.
    path = write(tmp_path, "train:\n  steps: 2147483648\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: train.steps: .*less than or equal to 21"):
        load_config(path)
    path = write(tmp_path, "eval:\n  batch_size: 8\n  max_batches: 100000000000000000000\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: eval.max_batches: .*does not fit a 64-bit"):
        load_config(path)
    # A finished workload's slice is billed until the next poll sees it.
    with pytest.raises(ConfigError, match=r"slice.poll_interval_s: .*less than or equal to 300"):
        load_config(write(tmp_path, "slice:\n  poll_interval_s: 3600\n"))
    # What a flow run's parameters are checked against when it is created.
    integers = [
        prop
        for definition in PipelineConfig.model_json_schema()["$defs"].values()
        for field in definition["properties"].values()
        for prop in field.get("anyOf", [field])
        if prop.get("type") == "integer"
    ]
    assert len(integers) > 20
    assert all(p["minimum"] >= -(2**63) and p["maximum"] <= 2**63 - 1 for p in integers)


def test_waits_past_what_a_run_can_take_are_refused_naming_the_fields(tmp_path):
    # Both passed validation (probe Q): a lifetime of 1e300 s failed the slice's create on
    # its ttl label; a backoff of 1e300 s crashed Prefect's first retry with an
    # OverflowError that hid the failure it retried.
    with pytest.raises(ConfigError, match=r":2: slice.max_lifetime_s: .*less than or equal"):
        load_config(write(tmp_path, "slice:\n  max_lifetime_s: 1.0e+300\n"))
    assert load_config(write(tmp_path, "slice:\n  max_lifetime_s: 2592000\n"))  # 30 days
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "resilience:\n  backoff_s: 1.0e+300\n"))
    said = str(err.value)
    assert "resilience.backoff_s = 1e+300, doubled for each of resilience.max_failures = 3" in said
    assert "more than a week (604800 s): lower either" in said
    with pytest.raises(ConfigError, match=r"resilience.max_failures = 20 retries"):
        load_config(write(tmp_path, "resilience:\n  max_failures: 20\n"))
    assert load_config(write(tmp_path, "resilience:\n  max_failures: 12\n"))


def test_unknown_key_is_an_error(tmp_path):
    path = write(tmp_path, "train:\n  stepz: 10\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: train.stepz: Extra inputs"):
        load_config(path)


def test_model_shape_checks_name_fields(tmp_path):
    path = write(
        tmp_path,
        "model: {d_model: 100, n_heads: 3, d_ff: 91, max_seq_len: 64}\n"
        "dataset: {seq_len: 128}\nmesh: {data: 1, fsdp: 4, tensor: 2}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "model.d_model = 100 is not divisible by model.n_heads = 3" in msg
    assert "model.n_heads = 3 is not divisible by mesh.tensor = 2" in msg
    assert "model.d_ff = 91 is not divisible by mesh.tensor = 2" in msg
    assert "dataset.seq_len = 128 exceeds model.max_seq_len = 64" in msg


def test_a_max_seq_len_positions_cannot_hold_is_refused(tmp_path):
    path = write(tmp_path, "model:\n  max_seq_len: 3000000000\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: model.max_seq_len: .*less than 2147483648"):
        load_config(path)


def test_a_lost_steps_bound_below_the_checkpoint_interval_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  checkpoint_every: 10\n  max_lost_steps: 4\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: train.max_lost_steps: .*4 is below"):
        load_config(path)
    assert load_config(path, ["train.max_lost_steps=10"]).train.lost_steps_bound == 10
    assert PipelineConfig(train={"checkpoint_every": 7}).train.lost_steps_bound == 7


def test_overrides_are_applied_and_blamed(tmp_path):
    path = write(tmp_path, "train: {steps: 10}\n")
    cfg = load_config(path, ["train.steps=20", "model.dtype=float32", "run_name=abc"])
    assert (cfg.train.steps, cfg.model.dtype, cfg.run_name) == (20, "float32", "abc")
    with pytest.raises(ConfigError, match=r"--set: train.batch_size"):
        load_config(path, ["train.batch_size=0"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(path, ["train.steps"])


def test_bad_run_name_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="run_name 'Bad Name'"):
        load_config(write(tmp_path, "run_name: Bad Name\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [\n"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_training_hash_ignores_where_and_how_it_runs():
    a = PipelineConfig(run_name="a")
    b = PipelineConfig(run_name="b", storage={"root": "/elsewhere"}, eval={"max_batches": 3})
    c = PipelineConfig(train={"learning_rate": 1e-3})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_cadence_and_names_do_not_change_what_is_trained():
    base = PipelineConfig(model={"size": "small"})
    same = PipelineConfig(
        model=base.model.model_dump(exclude={"size"}),
        train={"checkpoint_every": 7, "keep_checkpoints": 1, "log_every": 1, "max_lost_steps": 9},
        dataset={"workers": 2},
    )
    assert same.config_hash() == base.config_hash()


def test_a_rerun_may_change_cadence_but_not_training(tmp_path):
    cfg = PipelineConfig(run_name="r", storage={"root": str(tmp_path)})
    plan = plan_run(cfg)
    write_workload_config(cfg, plan, str(tmp_path / "data"))
    cadence = cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_every": 1})})
    assert check_resumable(cadence, plan_run(cadence)).config_hash == plan.config_hash
    lr = cfg.model_copy(update={"train": cfg.train.model_copy(update={"learning_rate": 1e-4})})
    only_lr = r"config \(train.learning_rate: 0.003 -> 0.0001\); resume it"
    with pytest.raises(ConfigError, match=only_lr):
        check_resumable(lr, plan_run(lr))


def test_a_run_stored_under_an_older_default_says_how_to_resume_it(tmp_path):
    # Created before [stdlib] alone read with errors=replace: the same config file was
    # refused as another training config, with no word of why or what to do.
    old = PipelineConfig(
        run_name="r", storage={"root": str(tmp_path)}, dataset={"errors": "strict"}
    )
    write_workload_config(old, plan_run(old), str(tmp_path / "data"))
    cfg = PipelineConfig(run_name="r", storage={"root": str(tmp_path)})
    assert cfg.dataset.errors == "replace"
    with pytest.raises(ConfigError, match=r"add --set dataset.errors=strict to resume a run"):
        check_resumable(cfg, plan_run(cfg))
    assert check_resumable(old, plan_run(old)).config_hash == plan_run(old).config_hash


def test_a_run_keeps_the_hash_its_checkpoints_carry(tmp_path):
    # A run created by an older version, whose hash covered other fields: same training.
    cfg = PipelineConfig(run_name="r", storage={"root": str(tmp_path)})
    old = plan_run(cfg).model_copy(update={"config_hash": "older-hash"})
    write_workload_config(cfg, old, str(tmp_path / "data"))
    assert check_resumable(cfg, plan_run(cfg)).config_hash == "older-hash"


@pytest.mark.parametrize(
    "corrupt",
    [lambda p: p.write_text(p.read_text()[:1000]), lambda p: p.write_bytes(b"\xff\xfe not json")],
    ids=["torn", "not-utf8"],
)
def test_a_corrupt_stored_config_is_refused_naming_the_file_with_exit_2(tmp_path, capsys, corrupt):
    # It gave a pydantic ValidationError or a UnicodeDecodeError naming no file, and
    # `tpupipe validate` crashed with exit 1 instead of exit 2 (bad input).
    path = write(tmp_path, f"run_name: r\nstorage: {{root: {tmp_path / 'root'}}}\n")
    cfg = load_config(path)
    plan = plan_run(cfg)
    stored = Path(write_workload_config(cfg, plan, str(tmp_path / "data")))
    corrupt(stored)
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(stored))}: .*restore it, or choose a new run_name"
    ):
        check_resumable(cfg, plan_run(cfg))
    assert cli_main(["validate", "--config", str(path)]) == 2
    assert str(stored) in capsys.readouterr().err


def test_padded_vocab():
    assert padded_vocab_size(257) == 384
    assert padded_vocab_size(128) == 128


def test_cli_validate_exit_codes(tmp_path, capsys):
    assert cli_main(["validate", "--config", str(REPO / "configs" / "tiny.yaml")]) == 0
    bad = write(tmp_path, "train: {batch_size: 30}\n")
    assert cli_main(["validate", "--config", str(bad)]) == 2
    assert "train.batch_size = 30" in capsys.readouterr().err


def test_cli_validate_checks_what_the_config_points_at(tmp_path, capsys):
    """Sources and tokenizer are checked too (no slice would start for them), except the
    remote ones: validate needs no credentials."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text")
    root = f"storage: {{root: {tmp_path / 'root'}}}\n"
    cases = {
        f"dataset: {{sources: [{tmp_path / 'nope'}]}}\n": f"'{tmp_path / 'nope'}' matches no file",
        f"dataset: {{sources: [{corpus}], tokenizer: {tmp_path / 't.json'}}}\n": (
            f"tokenizer file {tmp_path / 't.json'} cannot be read"
        ),
    }
    for text, message in cases.items():
        assert cli_main(["validate", "--config", str(write(tmp_path, text + root))]) == 2, text
        assert message in capsys.readouterr().err
    text = f"dataset: {{sources: [{corpus}, 'gs://no-such-bucket-here/x']}}\n" + root
    assert cli_main(["validate", "--config", str(write(tmp_path, text))]) == 0
    out = capsys.readouterr().out
    assert "1 local file(s) (1 remote source(s) checked when the run starts)" in out


def test_cli_validate_says_when_the_run_is_training_now(tmp_path, capsys):
    from workloads.rundir import RunDir

    config = write(tmp_path, f"run_name: busy\nstorage: {{root: {tmp_path / 'root'}}}\n")
    assert cli_main(["validate", "--config", str(config)]) == 0
    assert "note:" not in capsys.readouterr().out
    plan = plan_run(load_config(config))
    Path(plan.run_dir).mkdir(parents=True)
    for attempt, then in ((None, "of it now stops before"), (3, "takes over from attempt 3")):
        RunDir(plan.run_dir).write_status("training", attempt=attempt, step=9)  # this pid: alive
        assert cli_main(["validate", "--config", str(config)]) == 0  # still a valid config
        out = capsys.readouterr().out
        assert "note: run 'busy' is training now" in out and "at step 9" in out and then in out


def test_a_rerun_whose_sources_now_give_another_dataset_is_refused(tmp_path):
    from tasks.prepare import check_inputs
    from workloads import data

    corpus, cfg = six_document_run(tmp_path)
    plan = plan_run(cfg)
    result = data.shard_dataset(cfg.dataset, plan.datasets_root)
    write_workload_config(cfg, plan, result.dataset_dir)
    assert check_inputs(cfg, plan_run(cfg))[0].config_hash == plan.config_hash  # unchanged

    (corpus / "new.txt").write_text("a document added after the run started")
    with pytest.raises(ConfigError, match=r"trained on dataset .*\(added: .*new\.txt\); resum"):
        check_inputs(cfg, plan_run(cfg))
    (corpus / "new.txt").unlink()
    (corpus / "2.txt").write_text("edited in place")
    with pytest.raises(ConfigError, match=r"\(changed: .*2\.txt\)"):
        check_inputs(cfg, plan_run(cfg), remote=False)  # `tpupipe validate` sees it too


def test_a_rerun_naming_the_same_data_otherwise_resumes_and_other_sources_are_refused(
    tmp_path, monkeypatch
):
    # Another source list raised "TypeError: unhashable type: 'list'" (and said to run it
    # again); the same tokenizer file or corpus by a relative path was refused as another
    # training config.
    import shutil

    from tasks.prepare import check_inputs
    from tests.test_data_formats import bpe_tokenizer
    from workloads import data

    _, cfg = six_document_run(tmp_path)
    tok = bpe_tokenizer(tmp_path / "tok.json")
    cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"tokenizer": str(tok)})})
    plan = plan_run(cfg)
    built = data.shard_dataset(cfg.dataset, plan.datasets_root)
    write_workload_config(cfg, plan, built.dataset_dir)

    def rerun(**dataset) -> str:
        changed = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update=dataset)})
        return check_inputs(changed, plan_run(changed))[0].config_hash

    monkeypatch.chdir(tmp_path)
    shutil.copy(tok, tmp_path / "copy.json")
    assert rerun(tokenizer="tok.json", sources=["corpus"]) == plan.config_hash
    assert rerun(tokenizer="copy.json", sources=[f"{tmp_path}//corpus/"]) == plan.config_hash
    # Stored relative to another directory, or moved since: the same bytes still resume.
    changed = cfg.model_copy(
        update={"dataset": cfg.dataset.model_copy(update={"tokenizer": "../tok.json"})}
    )
    write_workload_config(changed, plan, built.dataset_dir)
    assert rerun(tokenizer=str(tmp_path / "copy.json")) == plan.config_hash
    tok.rename(tmp_path / "moved.json")
    assert rerun(tokenizer="moved.json") == plan.config_hash
    (tmp_path / "moved.json").rename(tok)
    write_workload_config(cfg, plan, built.dataset_dir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "0.txt").write_text("another corpus " * 40)
    with pytest.raises(ConfigError, match=r"trained on dataset .*added: .*other/0\.txt.*removed"):
        rerun(sources=[str(other)])
    bpe_tokenizer(tmp_path / "other.json", extra=("[X]",))
    with pytest.raises(ConfigError, match=r"config \(dataset.tokenizer: '.*tok.json' -> 'other"):
        rerun(tokenizer="other.json")  # another file: named as the field that changed


def test_the_same_sources_in_another_order_are_refused_saying_so(tmp_path):
    # It blamed "the tokenizer file or a dataset option", where neither had changed.
    from tasks.prepare import check_inputs
    from workloads import data

    corpus, cfg = six_document_run(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    for i in range(3):
        (other / f"{i}.txt").write_text(f"other document {i} " * 40)
    both = [str(corpus), str(other)]
    cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"sources": both})})
    plan = plan_run(cfg)
    write_workload_config(
        cfg, plan, data.shard_dataset(cfg.dataset, plan.datasets_root).dataset_dir
    )
    swapped = cfg.model_copy(
        update={"dataset": cfg.dataset.model_copy(update={"sources": both[::-1]})}
    )
    with pytest.raises(ConfigError, match=r"\(the same source files in another order \("):
        check_inputs(swapped, plan_run(swapped))
    # A file rewritten with its own bytes besides: the order is still what is said, first,
    # and the file is not called modified (probe S blamed it alone).
    touched = corpus / "2.txt"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ConfigError) as err:
        check_inputs(swapped, plan_run(swapped))
    said = str(err.value)
    assert "(the same source files in another order (" in said, said
    assert f"; rewritten, same size (perhaps the same bytes): {touched}" in said, said
    assert "modified, same size" not in said


def test_a_run_built_with_its_tokenizers_truncation_says_so_after_the_upgrade(
    tmp_path, monkeypatch
):
    # Refused as "the tokenizer file or a dataset option changed ... Restore them", where
    # nothing had changed: this version turns the file's truncation off.
    from tokenizers import Tokenizer

    from tasks.prepare import check_inputs
    from tests.test_data_formats import bpe_tokenizer
    from workloads import data, tokens

    _, cfg = six_document_run(tmp_path)
    path = bpe_tokenizer(tmp_path / "tok.json")
    cutting = Tokenizer.from_file(str(path))
    cutting.enable_truncation(8)
    cutting.save(str(path))
    cfg = cfg.model_copy(
        update={"dataset": cfg.dataset.model_copy(update={"tokenizer": str(path)})}
    )
    plan = plan_run(cfg)
    with monkeypatch.context() as before:  # built as the version before did: cut documents
        before.setattr(tokens, "_whole_documents", lambda hf: ())
        built = data.shard_dataset(cfg.dataset, plan.datasets_root)
    write_workload_config(cfg, plan, built.dataset_dir)
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg, plan_run(cfg))
    said = str(err.value)
    assert said.startswith(f"run 'r' trained on dataset {built.dataset_dir}, built from ")
    assert "with its truncation, which this version turns off" in said
    assert said.endswith("Choose a new run_name")


def test_a_run_on_a_dataset_an_older_version_stored_resumes_after_an_upgrade(tmp_path):
    """Format 4 stored the same records as uint16: a run started before the upgrade gets a
    new fingerprint for the same sources, and must resume, not be refused as changed data.
    Format 3 records could differ (BOM handling), and changed sources are still refused."""
    import json

    from tasks.prepare import check_inputs
    from tests.helpers import as_format_4
    from workloads import data

    corpus, cfg = six_document_run(tmp_path)
    plan = plan_run(cfg)
    result = data.shard_dataset(cfg.dataset, plan.datasets_root)
    old = as_format_4(result.dataset_dir, tmp_path / "root" / "datasets" / "00000000000000v4")
    write_workload_config(cfg, plan, old)
    assert check_inputs(cfg, plan_run(cfg))[0].config_hash == plan.config_hash

    manifest = json.loads((tmp_path / old / "manifest.json").read_text())
    older = {k: v for k, v in manifest.items() if k != "manifest_sha256"}  # none before 6
    (tmp_path / old / "manifest.json").write_text(json.dumps({**older, "format_version": 3}))
    # Said as it is: the sources are the same, the format is not (this blamed the
    # tokenizer file or a dataset option).
    format_3 = r"trained on dataset 00000000000000v4 .*the same source files, but an older "
    with pytest.raises(ConfigError, match=format_3 + r"tpupipe built it in dataset format 3"):
        check_inputs(cfg, plan_run(cfg))
    (tmp_path / old / "manifest.json").unlink()  # the dataset cache cleaned
    gone = r"holds no readable manifest\.json \(deleted with the datasets\?\).*Restore that dataset"
    with pytest.raises(ConfigError, match=gone):
        check_inputs(cfg, plan_run(cfg))
    (tmp_path / old / "manifest.json").write_text(json.dumps(manifest))
    edited = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"seq_len": 8})})
    assert not data.same_records(old, edited.dataset, data.resolve_sources(cfg.dataset.sources))
    (corpus / "2.txt").write_text("edited in place")
    with pytest.raises(ConfigError, match=r"\(changed: .*2\.txt\)"):
        check_inputs(cfg, plan_run(cfg))


def test_a_wheel_uri_without_a_bucket_is_refused_naming_slice_wheel(tmp_path, capsys):
    # It passed validation and reached the slice, whose start-up failed with exit 127.
    text = (
        "slice: {provider: gcp, zone: us-west4-a, accelerator_type: v5litepod-8, "
        "runtime_version: v2-alpha-tpuv5-lite, wheel: 'gs:///x.whl'}\n"
        f"storage: {{root: {tmp_path / 'root'}}}\n"
    )
    assert cli_main(["validate", "--config", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert "slice.wheel 'gs:///x.whl' names no bucket" in err and ":1:" in err


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("slice.wheel=gs://My_Bucket!/x.whl", "'My_Bucket!' is not a bucket name"),
        ("slice.wheel=gs://bkt//../x.whl", "an empty, '.' or '..' part"),
        ('slice.tpu_packages=["jax tpu"]', "entry 'jax tpu' is not a pip requirement"),
        (
            'slice.tpu_packages=["jax[tpu]==0.10.2", "libtpu==not-a-version"]',
            "entry 'libtpu==not-a-version' is not a pip requirement",
        ),
        # One line of a requirements file each: this one ran into the next.
        ('slice.tpu_packages=["pkg @ https://e.com/a.whl\\\\", "jax"]', "not one line of its own"),
    ],
)
def test_a_wheel_or_tpu_package_the_tpu_vm_cannot_install_is_refused(tmp_path, override, said):
    # Both passed validation: the TPU VM's start-up script failed on them, once billed.
    from tests.helpers import GCP_OVERRIDES, tiny_config

    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, *GCP_OVERRIDES, override)
    assert said in str(err.value)
    tiny_config(
        tmp_path,
        *GCP_OVERRIDES,
        'slice.tpu_packages=["jax[tpu]==0.10.2", "x>=1; python_version>\'3\'"]',
    )


def test_a_run_made_before_format_auto_was_the_default_resumes_with_its_config(tmp_path):
    # Its config.json says format 'text', the default then; the same config file now
    # means 'auto', which reads .txt files as text: the same dataset, not another config.
    from tasks.prepare import check_inputs
    from workloads import data

    corpus, cfg = six_document_run(tmp_path)
    before = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"format": "text"})})
    plan = plan_run(before)
    result = data.shard_dataset(before.dataset, plan.datasets_root)
    write_workload_config(before, plan, result.dataset_dir)
    assert cfg.dataset.format == "auto"
    rerun = check_inputs(cfg, plan_run(cfg))[0]
    assert rerun.config_hash == plan.config_hash
    # A file 'auto' reads otherwise (JSONL) is a change of training data: refused by name,
    # with the way to resume.
    (corpus / "6.jsonl").write_text('{"text": "a document"}\n')
    with pytest.raises(ConfigError, match=r"dataset\.format: 'text' -> 'auto' \(format 'auto'"):
        check_inputs(cfg, plan_run(cfg))
    (corpus / "6.jsonl").unlink()
    # A rerun with the default writes 'auto' into config.json: the original config, which
    # says 'text', resumes it still.
    write_workload_config(cfg, rerun, result.dataset_dir)
    assert check_inputs(before, plan_run(before))[0].config_hash == plan.config_hash
    # Unlisted sources (a sweep's plan, gs:// in `tpupipe validate`) leave it to the run.
    assert check_resumable(before, plan_run(before)).config_hash == plan.config_hash
