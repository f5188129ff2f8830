"""FLOP accounting and device peaks for MFU.

Model FLOPs per token (training, forward + backward), the MaxText / Megatron convention:

    6 * N_matmul  +  6 * n_layers * n_heads * head_dim * seq_len

``N_matmul`` counts params used in a matmul per token: all block projections and the output projection
(tied or not); the embedding *lookup* is a gather and is excluded. The second term is causal self-attention
(QK^T and AV: 2 matmuls x 2 FLOPs per MAC x 3 for forward+backward, halved because causal attention
touches half of the L x L scores). Sources: Kaplan et al. 2020 ("Scaling Laws", sec. 2.1); Chowdhery et
al. 2022 ("PaLM", appendix B); MaxText ``calculate_tflops_training_per_device`` (causal halving).
MFU = achieved model FLOP/s per device / peak FLOP/s per device (PaLM, appendix B). Remat recomputation
is not counted, by definition of *model* FLOPs.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import count_params

#: Dense bf16 peak FLOP/s per device (chip for TPU, GPU for NVIDIA), from vendor spec sheets.
#: Keys are matched as case-insensitive substrings of ``jax.Device.device_kind``; longest match wins.
PEAK_FLOPS_BF16: dict[str, float] = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,   # v5e reports "TPU v5 lite"
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,   # v6e (Trillium) reports "TPU v6 lite"
    "tpu v6e": 918e12,
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward+backward) by the formula in the module docstring. Units: FLOPs."""
    n_matmul = count_params(cfg)["matmul"]
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6.0 * n_matmul + attention


def table_peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s for a ``device_kind`` from :data:`PEAK_FLOPS_BF16`, or None if unknown."""
    kind = device_kind.lower()
    matches = [k for k in PEAK_FLOPS_BF16 if k in kind]
    return PEAK_FLOPS_BF16[max(matches, key=len)] if matches else None


@functools.lru_cache(maxsize=None)
def measure_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5,
                        device: jax.Device | None = None) -> float:
    """Measured FLOP/s of one device on an ``n x n @ n x n`` matmul (2 n^3 FLOPs), best of ``repeats``.

    Used as the peak on hosts with no table entry (CPU). Measured once per process and argument set
    (cached). Units: FLOP/s. The default device is this process's first local device: timing a device of
    another process measures nothing (process 1 of a CPU pair once reported 7.7 PFLOP/s).
    """
    device = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def peak_flops_per_device(device: jax.Device | None = None, dtype=jnp.float32) -> tuple[float, str]:
    """``(peak FLOP/s, how it was obtained)`` for this process's first local (or the given) device.

    Accelerators use the bf16 spec-sheet table. On CPU a matmul is measured here, in ``dtype``, best of 5 timings
    (:func:`measure_matmul_peak`); since simulated CPU devices (``--xla_force_host_platform_device_count``) share
    the host's cores, the host figure is divided by the number of local devices. A measurement taken under load
    is low, so :class:`jaxpt.run.monitor.Throughput` raises a measured peak to any rate a train step achieves
    (MFU never exceeds 100%). The second element says which, for the log.
    """
    device = device or jax.local_devices()[0]
    peak = table_peak_flops(device.device_kind)
    if peak is not None:
        return peak, f"spec-sheet bf16 peak for {device.device_kind!r}"
    measured = measure_matmul_peak(dtype=dtype, device=device)
    n_local = jax.local_device_count()
    return measured / n_local, (
        f"measured on this host: 2048^3 {jnp.dtype(dtype).name} matmul = {measured / 1e9:.1f} GFLOP/s (best of 5), "
        f"shared by {n_local} local {device.platform} devices; not a spec-sheet peak, so raised to any rate a "
        "step achieves (MFU <= 100%)")
