"""What a checkpoint's arrays must satisfy to be saved, and to be trusted when read back.

At save, one jitted pass over every array gives two things per array: whether it is finite
(a non-finite state is never saved) and a 32-bit checksum of its bytes, which goes into
the step's `meta` item. When a step is restored, the same pass runs over what was read and
each checksum must match the saved one.

Why checksums: a restore only proves that the files parse. Uncompressed arrays carry no
checksum of their own, so a flipped bit or a block of a data file overwritten by a torn
write restored silently (a probe changed 400 bytes of a final checkpoint: the pipeline
verified it, evaluated it and landed its wrong parameters; flipped mantissa bits in the
newest step were resumed from, and the run ended with other parameters than an
uninterrupted one).

The checksum is the wrapping sum of the array's 32-bit words, word i weighted by 2i + 1.
Integer sums do not depend on the order they are added in, so a checkpoint gives the same
checksums on any mesh and any number of hosts; an odd weight is invertible modulo 2**32,
so a change to any single word always changes the sum, and two different words swapped
almost always do. One sum, not two: integer reductions are slow on XLA's CPU backend (the
finite check of the `small` model's 153 MB state took 22-27 ms, with one sum 35-60 ms,
with two 100 ms, measured side by side); on a TPU either is a small fraction of a step.
Steps saved before checksums existed (no `checksums` in their meta) are trusted on their
finite check alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as a flat vector of uint32 words (narrower items widened)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    size = np.dtype(x.dtype).itemsize
    if size >= 4:  # 8-byte items become two words each
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    narrow = jnp.uint16 if size == 2 else jnp.uint8
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32).ravel()


def _checksum(x: jax.Array) -> jax.Array:
    words = _words(x)
    weights = 2 * jax.lax.iota(jnp.uint32, words.size) + 1
    return jnp.sum(words * weights, dtype=jnp.uint32)


@jax.jit
def _scan_each(leaves: list) -> tuple[jax.Array, jax.Array]:
    # One jitted program over every array (module-level, so every save reuses it): a
    # replicated vector of "finite" flags and one of checksums.
    finite = [
        jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
        for x in leaves
    ]
    return jnp.stack(finite), jnp.stack([_checksum(x) for x in leaves])


def _path(path: tuple) -> str:
    """`model/blocks/0/up/kernel`: the same for a tree saved with the list index 0 and
    one read back from orbax's metadata, whose keys are all strings."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(part) for part in parts)


def scan(state: Any) -> list[tuple[str, bool, str]]:
    """(path, finite, checksum as 8 hex digits) of every array of `state`, in tree order.

    A collective when `state` spans several hosts: every host must call it.
    """
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    if not flat:
        return []
    finite, sums = _scan_each([jnp.asarray(leaf) for _, leaf in flat])
    finite, sums = np.asarray(finite), np.asarray(sums)
    return [
        (_path(path), bool(ok), f"{int(digest):08x}")
        for (path, _), ok, digest in zip(flat, finite, sums, strict=True)
    ]


def first_non_finite(scanned: list[tuple[str, bool, str]]) -> str | None:
    """'array <path> has NaN or Inf values' for the first such array, or None."""
    for path, finite, _ in scanned:
        if not finite:
            return f"array {path} has NaN or Inf values"
    return None


def checksums(scanned: list[tuple[str, bool, str]]) -> dict[str, str]:
    """The checksums to save with a step, by array path."""
    return {path: digest for path, _, digest in scanned}


def integrity_problem(state: Any, saved: dict[str, str] | None) -> str | None:
    """Why arrays read back from a step must not be trusted (NaN/Inf, or bytes that differ
    from what was saved), or None. `saved`: the step's checksums (None: saved before
    checksums existed)."""
    scanned = scan(state)
    # Checksums first: bytes changed after the save (random ones decode to NaN here and
    # there) are damage, not a diverged state, which is never saved.
    read = checksums(scanned)
    for path in sorted(saved.keys() | read.keys()) if saved is not None else ():
        if saved.get(path) != read.get(path):
            return (
                f"array {path} does not match the checksum saved with it (saved "
                f"{saved.get(path, 'none')}, read {read.get(path, 'none')}): its files "
                "changed after the save"
            )
    return first_non_finite(scanned)
