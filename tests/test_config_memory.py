"""A model whose training state cannot fit its slice's devices is refused at validation,
naming the fields that drive the estimate, the estimate and the limit (found by an
acceptance probe: an 8192-wide, 8-layer model passed `tpupipe validate`, provisioned a
slice and failed with RESOURCE_EXHAUSTED after ~175 s of start-up). Nothing here trains."""

from __future__ import annotations

import pytest

from flows.cli import main as cli_main
from tests.helpers import GCP_OVERRIDES, REPO, tiny_config
from workloads import config_memory
from workloads.config import ModelConfig, param_count
from workloads.config_file import ConfigError, load_config
from workloads.config_memory import GIB, host_memory_bytes, memory_problems
from workloads.events import event_lines

MIB = 2**20

# The probe's model, on configs/tiny.yaml's local 8-device slice (data 2, fsdp 2, tensor 2).
BIG = ("model.d_model=8192", "model.n_layers=8", "model.d_ff=32768", "model.n_heads=64")
# ~2.0B parameters: 30 GiB of float32 state a v5e chip (16 GiB) holds only split 8 ways.
TWO_B = ("model.d_model=2048", "model.n_layers=40", "model.d_ff=8192", "model.n_heads=16")
THIS_HOST = 24 * GIB  # the probe's machine


def _host(n: int = THIS_HOST):
    return lambda: n


def test_the_probes_model_is_refused_naming_its_fields_and_numbers(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            REPO / "configs" / "tiny.yaml",
            [f"storage.root={tmp_path}", "run_name=big1", *BIG],
            host_memory=_host(),
        )
    msg = str(err.value)
    # 6.45B parameters x 16 bytes, a quarter on each device, 8 devices on one 24 GiB host.
    assert msg.startswith("--set: model.d_model = 8192, model.n_layers = 8 and model.d_ff = ")
    assert "make a model of 6.45B parameters" in msg
    assert "16 bytes a parameter, split over mesh.fsdp*mesh.tensor = 2*2" in msg
    assert "needs 24.0 GiB per device, 192.2 GiB for the slice.devices = 8" in msg
    assert "more than this host's 24.0 GiB of memory" in msg
    assert "use a smaller model" in msg
    assert "from --set model.d_model=8192, --set model.n_layers=8, --set model.d_ff=32768" in msg


def test_a_too_big_model_in_the_file_is_blamed_on_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "run_name: big\n"
        "model:\n  d_model: 8192\n  n_layers: 8\n  n_heads: 64\n  d_ff: 32768\n"
        "train: {steps: 12, batch_size: 16, warmup_steps: 2}\n"
        "mesh: {data: 2, fsdp: 2, tensor: 2}\n"
    )
    with pytest.raises(ConfigError, match=r"^\S*c\.yaml:3: model\.d_model = 8192, "):
        load_config(path, host_memory=_host())


def test_validate_and_run_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(config_memory, "host_memory_bytes", _host())
    import flows.api_server

    def no_server(*args, **kwargs):
        raise AssertionError("the run started its Prefect server (and would provision)")

    monkeypatch.setattr(flows.api_server, "temporary_api", no_server)
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--set", f"storage.root={tmp_path}"]
    for command in ("validate", "run"):
        assert cli_main([command, *args, *(a for o in BIG for a in ("--set", o))]) == 2
        err = capsys.readouterr().err
        assert "invalid config:" in err and "24.0 GiB per device" in err, err
    assert not (tmp_path / "runs").exists()


def test_the_flows_validate_stage_refuses_it_too(tmp_path, monkeypatch):
    # A run from the Prefect UI or a deployment gets no load_config: its validate stage
    # checks on the machine the local slice runs on.
    from tasks import prepare

    config = tiny_config(tmp_path, *BIG)  # no host given: loads, as `tpupipe report` does
    monkeypatch.setattr(prepare, "host_memory_bytes", _host())
    with pytest.raises(ConfigError, match=r"model\.d_model = 8192, .* 6\.45B parameters"):
        prepare.validate_config.fn(config)


def test_a_sweep_trial_too_big_is_named_before_any_trial_runs(tmp_path, monkeypatch):
    from tasks import sweep_plan
    from tasks.sweep_space import SearchSpace, SweepConfig
    from tasks.sweep_trials import build_trials

    monkeypatch.setattr(sweep_plan, "host_memory_bytes", _host())
    grid = {"model.n_layers": [1, 8], "model.d_model": [4096], "model.n_heads": [32]}
    space = SearchSpace(grid={**grid, "model.d_ff": [16384]})
    trials = build_trials(SweepConfig(base=tiny_config(tmp_path), space=space), "sw")
    with pytest.raises(ConfigError) as err:
        sweep_plan.check_trials(trials, local_inputs=True)
    assert "trial 1 (" in str(err.value) and "model.n_layers = 8" in str(err.value)
    assert "trial 0" not in str(err.value)  # 0.2B parameters: 6 GiB of state, twice, fit


@pytest.mark.parametrize("name", ["demo", "tiny", "v5e-8-spot"])
def test_the_shipped_configs_pass_with_room_to_spare(name):
    # Even a 1 GiB machine holds the local ones; the v5e one fits a v5e chip.
    load_config(REPO / "configs" / f"{name}.yaml", host_memory=_host(1 * GIB))


def test_the_gcp_test_config_passes():
    load_config(REPO / "configs" / "tiny.yaml", list(GCP_OVERRIDES), host_memory=_host(0))


def test_a_model_that_fits_v5e_8_only_split_over_fsdp(tmp_path):
    path = REPO / "configs" / "v5e-8-spot.yaml"
    config = load_config(path, [*TWO_B], host_memory=_host())  # mesh data -1, fsdp 8
    assert (config.mesh.data, config.mesh.fsdp) == (1, 8)
    with pytest.raises(ConfigError) as err:
        load_config(path, [*TWO_B, "mesh.data=8", "mesh.fsdp=1"], host_memory=_host())
    msg = str(err.value)
    assert "make a model of 2.01B parameters" in msg
    assert "copied over mesh.data = 8) needs 30.0 GiB per device" in msg
    assert "more than the 16.0 GiB of HBM of a v5litepod chip" in msg
    assert "move devices from mesh.data to mesh.fsdp" in msg
    assert "--set mesh.fsdp=1, --set mesh.data=8)" in msg  # both named where they came from


def test_activations_are_refused_only_well_past_the_memory(tmp_path):
    # The state of this 4000-layer, 32-wide model is 1 GiB; its counted activations (each
    # block's input, the logits, one layer's attention scores) grow with the batch. 24 GiB
    # of host: refused only once state + activations pass 48 GiB, though the step would
    # hold several times more.
    base = ("model.n_layers=4000", "dataset.seq_len=64")

    def problems(batch: int) -> list[str]:
        return memory_problems(tiny_config(tmp_path, *base, f"train.batch_size={batch}"), THIS_HOST)

    assert problems(1024) == []  # ~33 GiB with the state: more than the host, less than 2x
    (msg,) = problems(2048)  # ~64 GiB
    assert msg.startswith("train.batch_size = 2048 over mesh.data*mesh.fsdp = 2*2 with ")
    assert "model.n_layers = 4000" in msg and "more than 2 times this host's 24.0 GiB" in msg


def test_no_figure_for_the_device_means_no_check(tmp_path, monkeypatch):
    big = tiny_config(tmp_path, *BIG)
    assert memory_problems(big, None) == []  # a local slice, the host unknown
    gcp = tiny_config(tmp_path, *GCP_OVERRIDES, *BIG)
    assert memory_problems(gcp, None)  # v5litepod's HBM is known: the host does not matter
    monkeypatch.delitem(config_memory.HBM_BYTES_PER_CHIP, "v5litepod")
    assert memory_problems(gcp, None) == []  # a TPU family without a figure: skipped


def test_the_host_memory_is_ram_plus_swap(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemAvailable:  10 kB\nSwapTotal:  24 kB\n")
    assert host_memory_bytes(str(meminfo)) == 1024 * 1024
    assert host_memory_bytes(str(tmp_path / "missing")) > 0  # sysconf's figure instead


def _files(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize(
    ("cgroup", "files", "expected_mib"),
    [
        # cgroup v2: RAM and swap limited apart, the tightest of the cgroup and its parents.
        (
            "0::/pod/run\n",
            {
                "cgroup.controllers": "memory",
                "pod/memory.max": str(512 * MIB),
                "pod/run/memory.max": "max",
                "pod/run/memory.swap.max": "0",
            },
            512,
        ),
        (
            "0::/pod\n",
            {
                "cgroup.controllers": "memory",
                "pod/memory.max": "max",
                "pod/memory.swap.max": str(100 * MIB),
            },
            1000 + 100,
        ),
        # A container's own cgroup mounted as the root (cgroup namespace): its path is "/".
        ("0::/\n", {"cgroup.controllers": "memory", "memory.max": str(300 * MIB)}, 300 + 200),
        # cgroup v1: RAM alone, or RAM plus swap together when swap accounting is on.
        (
            "4:memory:/docker/c1\n0::/\n",
            {"memory/docker/c1/memory.limit_in_bytes": str(400 * MIB)},
            400 + 200,
        ),
        (
            "4:memory:/docker/c1\n",
            {
                "memory/docker/c1/memory.limit_in_bytes": str(400 * MIB),
                "memory/docker/c1/memory.memsw.limit_in_bytes": str(450 * MIB),
            },
            450,
        ),
        # No limit set anywhere (v1 writes a huge number), or nothing readable.
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, 1200),
        ("0::/user.slice\n", {"cgroup.controllers": "memory"}, 1200),
        (None, {}, 1200),
    ],
)
def test_the_host_memory_is_within_the_cgroups_limit(tmp_path, cgroup, files, expected_mib):
    # In a container /proc/meminfo shows the host: a model the container could not hold
    # passed the check, provisioned its slice and was SIGKILLed by the cgroup's OOM killer.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {1000 * 1024} kB\nSwapTotal: {200 * 1024} kB\n")
    root = tmp_path / "cgroupfs"
    root.mkdir()
    _files(root, files)
    proc = tmp_path / "cgroup"
    if cgroup is not None:
        proc.write_text(cgroup)
    got = host_memory_bytes(str(meminfo), str(proc), str(root))
    assert got == expected_mib * MIB


@pytest.mark.parametrize(
    "model", [{"size": "tiny"}, {"size": "small"}, {"d_model": 96, "n_heads": 3, "n_layers": 3}]
)
def test_the_parameter_count_is_the_built_models(model):
    import jax
    from flax import nnx

    from workloads.config import MeshConfig
    from workloads.model import Transformer, count_params
    from workloads.trainer import make_mesh

    cfg = ModelConfig(**model)
    with jax.set_mesh(make_mesh(MeshConfig(data=8))):
        built = nnx.eval_shape(lambda: Transformer(cfg, 1000, rngs=nnx.Rngs(0)))
    assert param_count(cfg, 1000) == count_params(built)


def test_the_state_on_a_device_is_what_the_estimate_counts(tmp_path):
    # The layout the estimate assumes, read off a real train state on tiny.yaml's mesh
    # (data 2, fsdp 2, tensor 2): parameters and AdamW's moments split as the parameters.
    import jax

    from workloads.trainer import create_train_state, make_mesh

    cfg = tiny_config(tmp_path)
    state = create_train_state(cfg.model, cfg.train, 257, 0, make_mesh(cfg.mesh))
    device = jax.devices()[0]
    held = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(state.arrays)
        for shard in leaf.addressable_shards
        if shard.device == device and leaf.ndim  # not AdamW's step count
    )
    # The estimate also counts the gradients, a fourth of it, which live only in the step.
    assert held == config_memory.estimate_memory(cfg, 257).state * 3 // 4


def test_an_eval_batch_past_the_hosts_memory_is_named(tmp_path):
    config = tiny_config(tmp_path, "eval.batch_size=1000000")
    problem = config_memory.eval_memory_problem(config, 2_000_000, 257, THIS_HOST)
    # 10**6 rows x 32 tokens x 384 (257 padded) x 4 bytes of logits, and 32 x 32 float32
    # scores (the mask bias, and 2 heads') a row.
    assert problem.startswith(
        "eval.batch_size = 1000000: a batch of 1000000 of the eval split's 2000000 records, "
        "dataset.seq_len = 32 tokens each, keeps float32 logits over a vocabulary of 384 and "
        "one layer's attention scores (seq_len squared a head) of 57.2 GiB"
    )
    assert "more than this host's 24.0 GiB of memory" in problem
    assert problem.endswith("lower eval.batch_size")
    # A batch is never larger than the split (workloads.input.eval_batches): "all of it".
    assert config_memory.eval_memory_problem(config, 5_000, 257, THIS_HOST) is None
    assert config_memory.eval_memory_problem(config, 2_000_000, 257, None) is None


def test_an_eval_batch_this_host_cannot_hold_stops_the_run_before_provisioning(
    tmp_path, monkeypatch, capsys
):
    """eval.batch_size = 10**12 passed validation, trained the whole run, then failed
    allocating 7.28 TiB in the evaluation."""
    from tasks import prepare
    from workloads import data

    overrides = ["run_name=evalmem", "eval.batch_size=1000000000000"]
    config = tiny_config(tmp_path, *overrides)
    records = data.shard_dataset(config.dataset, str(tmp_path / "count")).manifest["splits"]
    records = records["eval"]["records"]
    # A host that holds the training, but not the logits of the whole eval split at once.
    host = next(h for h in range(MIB, 1024 * MIB, MIB // 16) if not memory_problems(config, h))
    assert config_memory.eval_memory_problem(config, records, 257, host) is not None
    monkeypatch.setattr(prepare, "host_memory_bytes", _host(host))

    args = ["run", "--config", str(REPO / "configs" / "tiny.yaml")]
    args += [a for o in (f"storage.root={tmp_path}", *overrides) for a in ("--set", o)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"eval.batch_size = 1000000000000: a batch of {records} of the eval split's" in err
    run_dir = tmp_path / "runs" / "evalmem"
    # No attempt, nothing provisioned: only the failed landing is recorded.
    assert [e["event"] for e in event_lines(str(run_dir))] == ["landed"]
    assert not (run_dir / "config.json").exists()


def test_a_final_checkpoint_this_host_cannot_verify_is_named(tmp_path):
    # The orchestrator restores the whole training state to verify the final checkpoint:
    # a host holding the parameters (and an eval batch) but not AdamW's moments ran out
    # of memory after the whole run had trained.
    config = tiny_config(tmp_path, "model.d_model=512", "model.d_ff=2048", "eval.batch_size=1")
    params = config_memory.param_count(config.model, 257) * 4
    host = 2 * params
    problem = config_memory.eval_memory_problem(config, 100, 257, host)
    assert problem.startswith(
        "model.d_model = 512, model.n_layers = 1 and model.d_ff = 2048 make a model of "
    )
    assert (
        "checkpoint (float32 parameters and AdamW's two moments: 12 bytes a parameter)" in problem
    )
    assert problem.endswith("or set model.param_dtype = bfloat16 (half the bytes)")
    assert config_memory.eval_memory_problem(config, 100, 257, 3 * params + MIB) is None


def test_a_tokenizers_vocabulary_counts_once_its_file_is_read(tmp_path):
    # The vocabulary counted as one 128-row block: a 4096-wide model with a 70,000-id
    # tokenizer passed validation, its embedding alone more than the host could hold.
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    wide = [f"storage.root={tmp_path}", "model.d_model=4096", "model.n_heads=32"]
    wide += ["model.n_layers=1", "model.d_ff=4096", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]
    tiny = REPO / "configs" / "tiny.yaml"
    assert load_config(tiny, wide, host_memory=_host())  # byte-level: 257 ids fit
    big_vocab = [*wide, f"dataset.tokenizer={tmp_path / 'big.json'}"]
    with pytest.raises(ConfigError) as err:
        load_config(tiny, big_vocab, host_memory=_host())
    msg = str(err.value)
    assert "model.d_ff = 4096 and the 70,001 ids of dataset.tokenizer make a model of 387" in msg
    assert f"--set dataset.tokenizer={tmp_path / 'big.json'}" in msg


def test_attention_that_grows_with_seq_len_squared_is_counted(tmp_path):
    # seq_len 32,768 passed the check on this host, provisioned a slice and failed
    # allocating 60 GB: only the blocks' inputs and the logits were counted, linear in it.
    def problems(seq_len: int) -> list[str]:
        return memory_problems(
            tiny_config(tmp_path, f"dataset.seq_len={seq_len}", f"model.max_seq_len={seq_len}"),
            THIS_HOST,
        )

    assert problems(4096) == []
    (msg,) = problems(32768)
    # 4 rows a device x 32768**2 x 4 bytes x (the mask bias + 1 head's scores).
    assert "dataset.seq_len = 32768 keeps activations of at least 32.2 GiB per device" in msg
    assert "attention's float32 mask and one layer's scores: dataset.seq_len squared" in msg


def test_local_hosts_whose_processes_alone_exceed_the_host_are_refused(tmp_path):
    # 64 host processes of ~0.6 GiB each passed on a 24 GiB host (probe Q).
    def problems(hosts: int) -> list[str]:
        config = tiny_config(
            tmp_path,
            f"slice.devices={hosts}",
            f"slice.hosts={hosts}",
            "mesh.data=-1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            f"train.batch_size={hosts}",
            f"eval.batch_size={hosts}",
        )
        return memory_problems(config, THIS_HOST)

    assert problems(8) == []
    (msg,) = problems(64)
    assert msg.startswith("slice.hosts = 64 local workload processes need at least 25.0 GiB")
    assert msg.endswith("within its cgroup's limit): use fewer slice.hosts")
