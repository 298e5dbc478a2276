"""Model FLOPs per token, the hardware's peak, and model FLOPs utilisation (MFU).

On TPU the peak comes from a table of bf16 FLOP/s per chip; on CPU it is measured at
start-up with a matmul in the compute dtype, because a CPU's peak depends on the machine
and on how many cores are free. Virtual CPU devices share the host's cores, so the host's
peak is what one device's matmul reaches, whatever the device count.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from workloads.config import ModelConfig, layer_matmul_params

log = logging.getLogger(__name__)

# Peak dense bf16 FLOP/s per chip, from Cloud TPU's published system specifications
# (cloud.google.com/tpu/docs/system-architecture-tpu-vm, read 2026-11).
TPU_PEAK_BF16_FLOPS = {
    "v2": 45e12,
    "v3": 123e12,
    "v4": 275e12,
    "v5 lite": 197e12,  # v5e: device_kind "TPU v5 lite"
    "v5e": 197e12,
    "v5p": 459e12,
    "v5": 459e12,
    "v6 lite": 918e12,  # v6e (Trillium): device_kind "TPU v6 lite"
    "v6e": 918e12,
}


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of the whole slice and where the figure came from."""

    flops_per_s: float
    source: str  # "table:<kind>" or "measured:<dtype> matmul"


def model_flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 3x the forward pass's matmuls (forward + backward).

    Counts the QKV, output, MLP and logit projections (2 FLOPs per multiply-add) and the
    attention scores and context over `seq_len` keys, as in the PaLM paper's appendix B.
    The logits count the tokenizer's `vocab_size`, not the rows the model pads its table
    to: padding is work the hardware does, not work the model needs (the byte tokenizer's
    257 rows padded to 384 read 22% more FLOPs on `tiny`), so MFU does not reward it.
    """
    d = cfg.d_model
    per_layer = 2 * layer_matmul_params(cfg) + 2 * 2 * seq_len * d
    forward = cfg.n_layers * per_layer + 2 * d * vocab_size
    return 3.0 * forward


# JAX devices per chip where it is not one: a v2 or v3 chip's two TensorCores are two
# devices, where v4 and v5p join theirs into one (megacore) and v5e and v6e have one.
DEVICES_PER_CHIP = {"v2": 2, "v3": 2}


def tpu_peak(device_kind: str, devices: int) -> Peak | None:
    """Peak of `devices` JAX devices of `device_kind` (e.g. "TPU v5 lite"), or None if
    the kind is unknown. The table is per chip: `devices` counts TensorCores on v2 and v3."""
    kind = device_kind.lower().removeprefix("tpu").strip()
    for name in sorted(TPU_PEAK_BF16_FLOPS, key=len, reverse=True):
        if kind.startswith(name):
            chips = devices / DEVICES_PER_CHIP.get(name, 1)
            return Peak(TPU_PEAK_BF16_FLOPS[name] * chips, f"table:{name}")
    return None


def best_matmul_seconds(a: jax.Array, b: jax.Array, repeats: int) -> float:
    """Fastest of `repeats` timed runs of `a @ b` (compiled first, outside the timing)."""
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_peak(dtype: str = "bfloat16", size: int = 1024, repeats: int = 8) -> Peak:
    """FLOP/s of a square matmul on one local device: the best of several timed runs."""
    device = jax.local_devices()[0]
    key = jax.random.key(0)
    a = jax.device_put(jax.random.normal(key, (size, size), jnp.dtype(dtype)), device)
    return Peak(2.0 * size**3 / best_matmul_seconds(a, a, repeats), f"measured:{dtype} matmul")


def slice_peak(compute_dtype: str, remembered: dict | None = None) -> Peak:
    """The slice's peak: the TPU table on TPU, a measured matmul elsewhere.

    A measurement `remembered` from an earlier attempt of the run (same dtype) is reused:
    it saves a resumed attempt the measuring time and keeps MFU comparable across attempts.
    """
    device = jax.devices()[0]
    if device.platform == "tpu":
        peak = tpu_peak(device.device_kind, jax.device_count())
        if peak is not None:
            return peak
    if remembered and remembered.get("source") == f"measured:{compute_dtype} matmul":
        flops = remembered.get("flops_per_s")
        # `peak.json` is only a cache: a value that is not a positive number is measured
        # again, never a failed attempt.
        if isinstance(flops, int | float) and math.isfinite(flops) and flops > 0:
            return Peak(float(flops), remembered["source"])
    return measure_matmul_peak(compute_dtype)


class CompileCounter:
    """Persistent compilation cache hits and misses in this process, and the seconds spent
    getting executables: XLA compiles on a miss, cache reads on a hit (tracing excluded)."""

    _DURATIONS = (
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    )

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event in self._DURATIONS:
            self.compile_s += duration

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1
