"""Does the training state fit on the slice's devices? A conservative estimate from the
config alone, checked before anything is provisioned.

A model too big for its slice used to pass validation, provision the slice, spend minutes
starting and fail with RESOURCE_EXHAUSTED (or, with no address-space limit, be SIGKILLed by
the OOM killer, an exit tasks/watch.py takes for a preemption and retries). What one device
holds during a step (workloads/trainer.py, workloads/model.py):

- the training state: the master parameters in `model.param_dtype`, their gradients and
  AdamW's two moments (optax keeps them in the parameters' dtype), each laid out as its
  parameter: the embedding split over `fsdp`, every kernel over `fsdp`×`tensor`, the norm
  scales whole (the gradients, which XLA lays out, are counted as split as the parameters:
  the least they can take). `data` holds a copy. All four exist at once: the global-norm
  clip needs every gradient before any parameter is updated.
- activations: no block is rematerialised, so the backward pass keeps at least each
  block's input (the device's rows × dataset.seq_len × d_model in `model.dtype`) and the
  float32 logits (rows × dataset.seq_len × padded vocabulary).

Both are lower bounds: the step also holds the compute-dtype copies of the kernels, the
attention scores, the MLP's hidden activations, XLA's temporaries and the runtime. So a
config is refused only when the state alone exceeds a device's memory, or the state plus
those activations exceed `ACTIVATION_SLACK` times it (XLA on TPU may rematerialise
activations to fit, so they are given room). Anything less is left to the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workloads.host_memory import host_memory_bytes

__all__ = ["estimate_memory", "eval_memory_problem", "host_memory_bytes", "memory_problems"]

from workloads.config_model import layer_matmul_params, padded_vocab_size, param_count
from workloads.vocab import BYTE_VOCAB_SIZE

if TYPE_CHECKING:
    from workloads.config import PipelineConfig

GIB = 1 << 30

# HBM per chip (one JAX device per chip on every generation, see workloads/config_slice.py),
# from Cloud TPU's system architecture pages. A family not listed is not checked.
HBM_BYTES_PER_CHIP = {"v4": 32 * GIB, "v5litepod": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}

# What each process of a local slice's hosts takes before any model, at least: Python, JAX
# and XLA's CPU runtime (~0.6 GiB each measured for configs/tiny.yaml).
HOST_PROCESS_BYTES = 400 * 2**20

# Refuse when the state plus the activations counted exceed this many times the memory.
ACTIVATION_SLACK = 2

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Lower bounds of what one device holds during a training step, in bytes."""

    params: int  # the model's parameters, all devices together
    state: int  # per device: parameters, gradients and AdamW's two moments
    state_fully_sharded: int  # per device, were mesh.data 1 (every device splits it)
    activations: int  # per device: every block's input and the float32 logits


def estimate_memory(cfg: PipelineConfig, vocab_size: int) -> MemoryEstimate:
    """What one device of `cfg`'s mesh holds during a step, at least (see the module doc).

    Args:
        cfg: a validated config (its mesh resolved and its dimensions divisible by it).
        vocab_size: the tokenizer's vocabulary (the embedding has it padded).
    """
    m, mesh = cfg.model, cfg.mesh
    vocab = padded_vocab_size(vocab_size)
    embedding, kernels = vocab * m.d_model, m.n_layers * layer_matmul_params(m)
    norms = (2 * m.n_layers + 1) * m.d_model

    def state(fsdp: int, tensor: int) -> int:  # a parameter, its gradient and two moments
        return 4 * _BYTES[m.param_dtype] * (embedding // fsdp + kernels // (fsdp * tensor) + norms)

    rows, seq = cfg.train.batch_size // (mesh.data * mesh.fsdp), cfg.dataset.seq_len
    per_token = m.n_layers * m.d_model * _BYTES[m.dtype] + vocab * 4
    return MemoryEstimate(
        params=param_count(m, vocab_size),
        state=state(mesh.fsdp, mesh.tensor),
        state_fully_sharded=state(cfg.slice.devices // mesh.tensor, mesh.tensor),
        activations=rows * seq * per_token + rows * attention_bytes(cfg),
    )


def attention_bytes(cfg: PipelineConfig) -> int:
    """What one row (sequence) holds in attention at least, at once: the float32 mask bias
    the layers share (seq x seq) and one layer's float32 scores, a seq x seq matrix for each
    head of the device's (heads split over mesh.tensor). Not every layer's probabilities,
    which the backward pass keeps unless XLA rematerialises them (it may, on TPU).

    Why: they grow with dataset.seq_len squared. A seq_len of 32,768 passed the check on a
    24 GiB host, provisioned a slice and failed allocating 60 GB."""
    seq, heads = cfg.dataset.seq_len, cfg.model.n_heads // cfg.mesh.tensor
    return seq * seq * 4 * (1 + heads)


_VOCABS: dict[tuple, int] = {}  # a tokenizer file's vocabulary, by path, size and mtime


def tokenizer_vocab(cfg: PipelineConfig) -> int:
    """The vocabulary the model's embedding is sized for: the byte tokenizer's, or that of
    the tokenizer file, read here (local, and parsed once per version of the file). One
    that cannot be read counts as one padded block: the input checks name the file.

    Why read it: a 128k-id tokenizer's embedding can be most of a model, and it was counted
    as one 128-row block, so a model far too big for its slice passed every check."""
    if cfg.dataset.tokenizer is None:
        return BYTE_VOCAB_SIZE
    from workloads.sources import DatasetError
    from workloads.tokens import load_tokenizer

    path = os.path.abspath(cfg.dataset.tokenizer)
    try:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in _VOCABS:
            _VOCABS[key] = load_tokenizer(path).vocab_size
        return _VOCABS[key]
    except (OSError, DatasetError):
        return 1


def memory_problems(cfg: PipelineConfig, host_bytes: int | None) -> list[str]:
    """The config's training state does not fit the slice's devices: one message naming
    the fields that drive the estimate, the estimate, the limit and what to change.

    Args:
        cfg: a validated config.
        host_bytes: this machine's memory (`host_memory_bytes`), which a local slice's
            virtual devices share; None skips the check of a local slice.

    Returns:
        One message, or none when the estimate fits or the device's memory is unknown (a
        local slice without `host_bytes`, a TPU family without an HBM figure).
    """
    limit = _device_memory(cfg, host_bytes)
    if limit is None:
        return []
    local = cfg.slice.provider == "local"
    per_device, have = limit
    if (hosts := cfg.slice.hosts) > 1 and local and hosts * HOST_PROCESS_BYTES > host_bytes:
        return [
            f"slice.hosts = {hosts} local workload processes need at least "
            f"{_gib(hosts * HOST_PROCESS_BYTES)} before any model (each a Python and JAX "
            f"runtime of {_gib(HOST_PROCESS_BYTES)} or more: ~0.6 GiB measured for the tiny "
            f"config), more than {have}: use fewer slice.hosts"
        ]
    vocab = tokenizer_vocab(cfg)
    est = estimate_memory(cfg, vocab)
    m, mesh = cfg.model, cfg.mesh
    # A large vocabulary can be most of the model: say where the embedding's rows come from.
    sizes = f"model.d_model = {m.d_model}, model.n_layers = {m.n_layers}"
    if cfg.dataset.tokenizer:
        sizes += f", model.d_ff = {m.d_ff} and the {vocab:,} ids of dataset.tokenizer"
    else:
        sizes += f" and model.d_ff = {m.d_ff}"
    if est.state > per_device:
        advice = ["use a smaller model (model.d_model, model.n_layers, model.d_ff)"]
        if est.state_fully_sharded <= per_device and mesh.data > 1:
            # On a local slice too: the sum over its devices is then one copy of the state.
            advice.insert(0, "move devices from mesh.data to mesh.fsdp (fsdp splits the state)")
        if m.param_dtype == "float32" and est.state // 2 <= per_device:
            advice.append("set model.param_dtype = bfloat16 (half the bytes)")
        if not local:
            advice.append("use a slice of more chips (slice.accelerator_type)")
        return [
            f"{sizes} make a model of {_count(est.params)} parameters whose training state "
            f"({m.param_dtype} parameters, gradients and AdamW's two moments: "
            f"{4 * _BYTES[m.param_dtype]} bytes a parameter, split over mesh.fsdp*mesh.tensor "
            f"= {mesh.fsdp}*{mesh.tensor}, copied over mesh.data = {mesh.data}) needs "
            f"{_amount(cfg, est.state)}, more than {have}: {', or '.join(advice)}"
        ]
    if est.state + est.activations > ACTIVATION_SLACK * per_device:
        advice = "lower train.batch_size or dataset.seq_len, or use a smaller model"
        if not local:
            advice += ", or a slice of more chips (slice.accelerator_type)"
        return [
            f"train.batch_size = {cfg.train.batch_size} over mesh.data*mesh.fsdp = "
            f"{mesh.data}*{mesh.fsdp} with dataset.seq_len = {cfg.dataset.seq_len} keeps "
            f"activations of at least {_amount(cfg, est.activations)} (the input of each of "
            f"model.n_layers = {m.n_layers} blocks, model.d_model = {m.d_model} wide in "
            f"model.dtype = {m.dtype}, the float32 logits, and attention's float32 mask and "
            f"one layer's scores: dataset.seq_len squared for each of model.n_heads = "
            f"{m.n_heads} heads over mesh.tensor = {mesh.tensor}), and with the training state "
            f"({_amount(cfg, est.state)}) that is more than {ACTIVATION_SLACK} times {have}: "
            f"{advice}"
        ]
    return []


def eval_memory_problem(
    cfg: PipelineConfig, eval_records: int, vocab_size: int, host_bytes: int | None
) -> str | None:
    """The checks after training do not fit this host: the message naming the field.

    They run in the orchestrator, on one device (tasks/checks.py), after training: an
    `eval.batch_size` of 10**12 passed validation, trained the whole run and then failed
    allocating 7.28 TiB. Verifying the final checkpoint restores the whole training state
    (the parameters and AdamW's two moments); evaluating restores the parameters alone
    and runs batches of min(eval.batch_size, the split's records) rows
    (`workloads.input.eval_batches`), whose float32 logits are counted with the
    parameters. Both are lower bounds, as for training.

    Args:
        cfg: a validated config.
        eval_records: records in the dataset's eval split.
        vocab_size: the dataset's tokenizer vocabulary.
        host_bytes: this machine's memory; None skips the check.
    """
    if not host_bytes:
        return None
    rows = min(cfg.eval.batch_size, max(eval_records, 1))
    vocab = padded_vocab_size(vocab_size)
    # On one device: every head's scores.
    one_device = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"tensor": 1})})
    logits = rows * (cfg.dataset.seq_len * vocab * 4 + attention_bytes(one_device))
    m = cfg.model
    count = param_count(m, vocab_size)
    params = count * _BYTES[m.param_dtype]
    if (state := 3 * params) > host_bytes:
        advice = "use a smaller model (model.d_model, model.n_layers, model.d_ff)"
        if m.param_dtype == "float32" and state // 2 <= host_bytes:
            advice += ", or set model.param_dtype = bfloat16 (half the bytes)"
        return (
            f"model.d_model = {m.d_model}, model.n_layers = {m.n_layers} and model.d_ff = "
            f"{m.d_ff} make a model of {_count(count)} parameters whose checkpoint "
            f"({m.param_dtype} parameters and AdamW's two moments: "
            f"{3 * _BYTES[m.param_dtype]} bytes a parameter) takes {_gib(state)}, more than "
            f"this host's {_gib(host_bytes)} of memory, where the orchestrator restores the "
            f"final checkpoint to verify it after training: run the orchestrator on a host "
            f"with more memory, or {advice}"
        )
    if logits + params <= host_bytes:
        return None
    return (
        f"eval.batch_size = {cfg.eval.batch_size}: a batch of {rows} of the eval split's "
        f"{eval_records} records, dataset.seq_len = {cfg.dataset.seq_len} tokens each, keeps "
        f"float32 logits over a vocabulary of {vocab} and one layer's attention scores "
        f"(seq_len squared a head) of {_gib(logits)}, and with the "
        f"model's parameters ({_gib(params)}) that is more than this host's "
        f"{_gib(host_bytes)} of memory, where the orchestrator evaluates the run after "
        "training it: lower eval.batch_size"
    )


def _device_memory(cfg: PipelineConfig, host_bytes: int | None) -> tuple[int, str] | None:
    """Bytes one device can hold and the words that say where the figure comes from."""
    s = cfg.slice
    if s.provider == "gcp":
        family = (s.accelerator_type or "").split("-")[0]
        hbm = HBM_BYTES_PER_CHIP.get(family)
        if hbm is None:
            return None
        return hbm, (
            f"the {_gib(hbm)} of HBM of a {family} chip (slice.accelerator_type = "
            f"{s.accelerator_type})"
        )
    if not host_bytes:
        return None
    return host_bytes // s.devices, (
        f"this host's {_gib(host_bytes)} of memory (RAM and swap, within its cgroup's limit)"
    )


def _amount(cfg: PipelineConfig, per_device: int) -> str:
    """A per-device figure as said to the user: a local slice's virtual devices share one
    host's memory, so their sum is what is compared."""
    devices = cfg.slice.devices
    if cfg.slice.provider == "gcp" or devices == 1:
        return f"{_gib(per_device)} per device"
    return (
        f"{_gib(per_device)} per device, {_gib(per_device * devices)} for the slice.devices "
        f"= {devices} virtual devices"
    )


def _gib(n: int) -> str:
    if n < GIB:  # "0.0 GiB" said nothing
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / GIB:.1f} GiB"


def _count(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
