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

from jaxpt import jsonl
from jaxpt.errors import FileFormatError


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
        path = os.path.join(workdir, METRICS_FILE)
        jsonl.drop_partial_last_line(path)  # a record half-written by a killed run (see read_metrics)
        self._jsonl = open(path, "a", buffering=1)
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


# ------------------------------------------------------------------------------------------ reading metrics.jsonl

#: The metrics log of a workdir, written by :class:`MetricWriter`.
METRICS_FILE = "metrics.jsonl"


class MetricsFormatError(FileFormatError):
    """``metrics.jsonl`` breaks its contract at one line (file, line, reason); see :func:`read_metrics`."""


def metrics_path(workdir: str) -> str:
    """``<workdir>/metrics.jsonl``, or ``workdir`` itself when it is a file."""
    return workdir if os.path.isfile(workdir) else os.path.join(workdir, METRICS_FILE)


def check_metrics_record(record: dict, path: str, line_no: int) -> dict:
    """``record`` if it holds an integer ``step``; raises MetricsFormatError (reason ``missing_step``) naming
    ``path:line_no`` otherwise."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise MetricsFormatError.at(path, line_no, "missing_step", "every record needs an integer 'step'")
    return record


def parse_metrics_line(raw: bytes, path: str, line_no: int) -> dict:
    """One complete line of a metrics file (``raw``: its bytes without the LF), for readers that tail a live file.

    Raises:
      MetricsFormatError: the line breaks the contract of :func:`read_metrics` (names ``path:line_no``).
    """
    try:
        record = jsonl.parse_object(raw.rstrip(b"\r"))
    except jsonl.LineError as e:
        raise MetricsFormatError.at(path, line_no, e.reason, e.detail) from None
    return check_metrics_record(record, path, line_no)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """Every record of ``<workdir>/metrics.jsonl`` (or of the file ``workdir``), in file order.

    The contract: the JSON Lines rules of :mod:`jaxpt.jsonl`, each record an object with an integer ``step``
    (events, the final report and per-step metrics alike; non-finite floats are the strings ``"nan"``/``"inf"``).
    One exception: a last line that lacks its newline and does not parse is skipped, the record a trainer
    killed mid-write left half-written (:class:`MetricWriter` ends every record with a newline and cuts such a
    line off before it appends again).

    Raises:
      FileNotFoundError: no metrics file.
      MetricsFormatError: (a ConfigError) any other bad line: names the file, the 1-based line and the reason.
    """
    path = metrics_path(workdir)
    return [check_metrics_record(rec, path, n)
            for n, rec in jsonl.iter_objects(path, error=MetricsFormatError, partial_last_line=True)]


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
