"""Run monitoring: step timing, throughput and MFU, and the metric writers (JSON Lines, TensorBoard, tqdm).

Only the process with index 0 writes files; every process may time.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Mapping

import numpy as np


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; Linux reports KiB). Units: bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class Throughput:
    """Per-step throughput figures from a measured wall time.

    Args:
      tokens_per_step: tokens in one global batch (``global_batch_size * seq_len``, padding included).
      flops_per_token: model FLOPs per token (:func:`jaxpt.flops.flops_per_token`).
      num_devices: devices in the mesh.
      peak_flops_per_device: peak FLOP/s of one device.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, num_devices: int,
                 peak_flops_per_device: float):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak = peak_flops_per_device

    def figures(self, step_time_s: float) -> dict[str, float]:
        """``tokens_per_sec``, ``tflops_per_device`` (model TFLOP/s achieved per device), ``mfu`` (0..1)."""
        step_time_s = max(step_time_s, 1e-9)
        flops_per_device = self.tokens_per_step * self.flops_per_token / self.num_devices / step_time_s
        return {
            "step_time_s": step_time_s,
            "tokens_per_sec": self.tokens_per_step / step_time_s,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / self.peak,
        }


class MetricWriter:
    """Appends one JSON object per record to ``<workdir>/metrics.jsonl`` and mirrors scalars to TensorBoard
    (``<workdir>/tensorboard``). A no-op on processes other than 0."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
        try:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record of truth.
            self._tb = None

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record; it must hold ``step``. Non-finite floats are written as strings ("nan")."""
        if not self.enabled:
            return
        clean = {}
        for k, v in record.items():
            if isinstance(v, (np.floating, np.integer)):
                v = v.item()
            if isinstance(v, float) and not np.isfinite(v):
                v = str(v)
            clean[k] = v
        self._jsonl.write(json.dumps(clean, sort_keys=False) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All records of ``<workdir>/metrics.jsonl`` in order."""
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StepTimer:
    """Wall time between consecutive calls of :meth:`tick`, averaged over a window of steps."""

    def __init__(self):
        self._last = None
        self._times: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(now - self._last)
        self._last = now

    def pop_mean(self) -> float | None:
        """Mean seconds per step since the last pop (None if no interval was measured)."""
        if not self._times:
            return None
        mean = float(np.mean(self._times))
        self._times.clear()
        return mean
