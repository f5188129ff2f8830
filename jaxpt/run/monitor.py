"""Run monitoring: step timing, throughput and MFU, and the metric writers (JSON Lines, TensorBoard, tqdm).

Only the process with index 0 writes files; every process may time.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from typing import Any, Mapping

import numpy as np

from jaxpt.util import fs, jsonl
from jaxpt.util.errors import FileFormatError


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; Linux reports KiB). Units: bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class Throughput:
    """Per-step throughput figures from a measured wall time.

    Args:
      tokens_per_step: tokens in one global batch (``global_batch_size * seq_len``, padding included).
      flops_per_token: model FLOPs per token (:func:`jaxpt.training.flops.flops_per_token`).
      num_devices: devices in the mesh.
      peak_flops_per_device: peak FLOP/s of one device.
      peak_is_measured: the peak was measured on this host (CPU), not taken from a spec sheet. A measured peak is
        a lower bound of what the device can do: when a step achieves more, the peak is raised to the achieved
        rate (and :attr:`peak_raised` counts it), so ``mfu`` never exceeds 1.
      rows_through: with a batch-size ramp, ``step -> global rows trained in steps 1..step``
        (:meth:`jaxpt.training.batch_ramp.BatchRamp.rows_through`); tokens are that times ``seq_len``. None: every step
        has ``tokens_per_step`` tokens.
      seq_len: tokens per row (with ``rows_through``).
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, num_devices: int,
                 peak_flops_per_device: float, peak_is_measured: bool = False, rows_through=None,
                 seq_len: int = 0):
        self.rows_through, self.seq_len = rows_through, seq_len
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak = peak_flops_per_device
        self.peak_is_measured = peak_is_measured
        self.peak_raised = 0

    def figures(self, step_time_s: float, tokens_per_step: float | None = None) -> dict[str, float]:
        """``step_time_s``, ``tokens_per_sec``, ``tflops_per_device`` (model TFLOP/s achieved per device) and
        ``mfu`` (achieved / peak, 0..1; PaLM, Chowdhery et al. 2022, appendix B). ``tokens_per_step``: the
        interval's mean tokens per step (a batch-size ramp; :meth:`interval_tokens_per_step`), else the full
        batch's."""
        step_time_s = max(step_time_s, 1e-9)
        tokens_per_step = self.tokens_per_step if tokens_per_step is None else tokens_per_step
        flops_per_device = tokens_per_step * self.flops_per_token / self.num_devices / step_time_s
        if flops_per_device > self.peak and self.peak_is_measured:
            self.peak, self.peak_raised = flops_per_device, self.peak_raised + 1
        return {
            "step_time_s": step_time_s,
            "tokens_per_sec": tokens_per_step / step_time_s,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / self.peak,
        }

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on through ``step`` (``step x tokens_per_step``: from the step, so steps re-run after a
        resume or rollback are not counted twice); with a batch-size ramp, the sum of the steps' tokens."""
        if self.rows_through is not None:
            return self.rows_through(step) * self.seq_len
        return step * self.tokens_per_step

    def interval_tokens_per_step(self, after: int, through: int) -> float:
        """Mean tokens per step of steps ``after+1..through`` (the full batch's when ``through <= after``)."""
        if through <= after:
            return self.tokens_per_step if self.rows_through is None else \
                (self.rows_through(through) - self.rows_through(through - 1)) * self.seq_len
        return (self.tokens_seen(through) - self.tokens_seen(after)) / (through - after)


class LossSeries:
    """The train-loss series of the records: ``loss`` is the logged step's own value, ``loss_mean`` the mean
    over every step since the previous record, and a skipped step's loss (a spike or non-finite step the update
    skipped) goes to ``skipped_loss`` instead, never into ``loss``, ``loss_mean`` or :meth:`mean_last`."""

    def __init__(self, last: int = 20):
        self._interval: list[float] = []
        self._recent: collections.deque = collections.deque(maxlen=last)

    def observe(self, record: dict[str, Any]) -> None:
        """Take one step's record (``loss``, ``skipped``): count its loss, or move it to ``skipped_loss``."""
        if record.get("skipped"):
            record["skipped_loss"] = record.pop("loss")
        else:
            self._interval.append(record["loss"])
            self._recent.append(record["loss"])

    def pop_interval(self) -> dict[str, float]:
        """``{"loss_mean": ...}`` over the steps observed since the last pop (``{}`` when all were skipped)."""
        out = {"loss_mean": float(np.mean(self._interval))} if self._interval else {}
        self._interval.clear()
        return out

    def reset(self) -> None:
        """Forget the current interval (a rollback discarded its steps)."""
        self._interval.clear()

    def mean_last(self) -> float | None:
        """Mean loss of the last ``last`` non-skipped steps (None before any)."""
        return float(np.mean(self._recent)) if self._recent else None

    @property
    def recent_count(self) -> int:
        """How many steps :meth:`mean_last` averages (fewer than ``last`` in a short session)."""
        return len(self._recent)


class MetricWriter:
    """Appends one JSON object per record to ``<workdir>/metrics.jsonl`` and mirrors scalars to TensorBoard
    (``<workdir>/tensorboard``). A no-op on processes other than 0.

    ``start_step``: the step the run starts from (a resumed run's restored step, 0 for a fresh run). When the
    file already holds records of later steps (a session whose last checkpoints were lost; for a fresh run in a
    used workdir, any record), a supersede marker ``{"event": "superseded", "superseded_after": start_step}``
    (-1 for a fresh run) is appended first, which :func:`read_metrics` applies, and TensorBoard purges those
    steps (``purge_step``): every reader and plot sees one value per step. None: plain append.
    """

    def __init__(self, workdir: str, enabled: bool = True, start_step: int | None = None):
        self.enabled, self.workdir = enabled, workdir
        self._tb = None
        if not enabled:
            return
        fs.makedirs(workdir)
        self.path = fs.join(workdir, METRICS_FILE)
        jsonl.drop_partial_last_line(self.path)  # a record half-written by a killed run (see read_metrics)
        self._jsonl = fs.Appender(self.path)
        purge = None
        if start_step is not None:
            last = jsonl.last_step(self.path)
            after = start_step if start_step else -1
            if last is not None and last > after:
                self._mark_superseded(after, "resume" if start_step else "fresh start")
            purge = after + 1
        self._open_tensorboard(purge)

    def _mark_superseded(self, after: int, reason: str) -> None:
        self._jsonl.write(json.dumps({"step": max(after, 0), "event": "superseded", jsonl.SUPERSEDED_AFTER: after,
                                      "reason": reason}) + "\n")

    def _open_tensorboard(self, purge_step: int | None) -> None:
        try:
            from tensorboardX import SummaryWriter
            self._tb_files = getattr(self, "_tb_files", 0) + 1  # a rewind within the second needs a new file name
            self._tb = SummaryWriter(fs.join(self.workdir, "tensorboard"), purge_step=purge_step,
                                     filename_suffix=f".{os.getpid()}.{self._tb_files}")
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record of truth.
            self._tb = None

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a rollback): supersede the records after it, as a resume does."""
        if not self.enabled:
            return
        self._mark_superseded(step, "rollback")
        if self._tb is not None:
            self._tb.close()
        self._open_tensorboard(step + 1)

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
                # tensorboardX's gs:// writer uploads again when garbage-collected: let that happen now, not
                # at interpreter exit when the bucket may be gone
                self._tb = None


# ------------------------------------------------------------------------------------------ reading metrics.jsonl

#: The metrics log of a workdir, written by :class:`MetricWriter`.
METRICS_FILE = "metrics.jsonl"


class MetricsFormatError(FileFormatError):
    """``metrics.jsonl`` breaks its contract at one line (file, line, reason); see :func:`read_metrics`."""


def metrics_path(workdir: str) -> str:
    """``<workdir>/metrics.jsonl``, or ``workdir`` itself when it is a file."""
    return workdir if fs.isfile(workdir) else fs.join(workdir, METRICS_FILE)


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


def read_metrics(workdir: str, superseded: bool = False) -> list[dict[str, Any]]:
    """Every record of ``<workdir>/metrics.jsonl`` (or of the file ``workdir``), in file order, supersede markers
    applied (:func:`jaxpt.util.jsonl.drop_superseded`: records of steps a resumed or rolled-back run rewrote are left
    out, so each step has one record); ``superseded=True``: every record as written.

    The contract: the JSON Lines rules of :mod:`jaxpt.util.jsonl`, each record an object with an integer ``step``
    (events, the final report and per-step metrics alike; non-finite floats are the strings ``"nan"``/``"inf"``).
    One exception: a last line that lacks its newline and does not parse is skipped, the record a trainer
    killed mid-write left half-written (:class:`MetricWriter` ends every record with a newline and cuts such a
    line off before it appends again).

    Raises:
      FileNotFoundError: no metrics file.
      MetricsFormatError: (a ConfigError) any other bad line: names the file, the 1-based line and the reason.
    """
    path = metrics_path(workdir)
    records = [check_metrics_record(rec, path, n)
               for n, rec in jsonl.iter_objects(path, error=MetricsFormatError, partial_last_line=True)]
    return records if superseded else jsonl.drop_superseded(records)


class StepTimer:
    """Wall time between consecutive calls of :meth:`tick`, averaged over a window of steps."""

    def __init__(self):
        self._last = None
        self._times: list[float] = []
        self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` out of the interval being measured (a compile inside it, not step time)."""
        self._excluded += seconds

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(max(now - self._last - self._excluded, 0.0))
        self._last, self._excluded = now, 0.0

    def pop_mean(self) -> float | None:
        """Mean seconds per step since the last pop (None if no interval was measured)."""
        if not self._times:
            return None
        mean = float(np.mean(self._times))
        self._times.clear()
        return mean


#: Goodput categories, in the order tables and plots show them (seconds of one session's wall time each).
GOODPUT_CATEGORIES = ("productive_s", "startup_s", "compile_s", "data_wait_s", "checkpoint_s", "eval_s", "redone_s")


class Goodput:
    """Time accounting of one training session (one process start): where its wall time went.

    Categories (seconds): ``startup_s`` (from :func:`jaxpt.run.session.run_training` to the first step: checks,
    build, restore), ``compile_s`` (the first dispatch of each train step, which traces and compiles; a
    batch-size ramp has one per size),
    ``data_wait_s`` (waiting for batches), ``checkpoint_s`` (the loop blocked by checkpoint saves, including
    the final save's wait), ``eval_s`` (held-out evaluation), ``redone_s`` (steps trained again: a resumed
    session re-running steps a lost session had already trained, or the steps a rollback discards; each
    counted at the session's mean step time) and ``productive_s`` (the rest: steps that count). They sum to
    ``wall_s``. Time between sessions (a dead process, a queue) is not a session's and is not counted.

    Args:
      redo_until: the highest step an earlier session reached; steps up to it are redone work.
    """

    def __init__(self, redo_until: int = 0, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.seconds = dict.fromkeys(GOODPUT_CATEGORIES[1:-1], 0.0)
        self.redo_until = redo_until
        self.steps_run = 0
        self.redone_steps = 0
        self.checkpoint_saves = 0
        self.loop_started: float | None = None

    def start_loop(self) -> None:
        """The loop begins: what came before is startup."""
        if self.loop_started is None:
            self.loop_started = time.perf_counter()
            self.seconds["startup_s"] = self.loop_started - self.t0

    def add(self, category: str, seconds: float) -> None:
        """Count ``seconds`` under ``category`` (one of :data:`GOODPUT_CATEGORIES` but productive/redone)."""
        self.seconds[category] += seconds

    def step(self, step: int) -> None:
        """Step ``step`` was dispatched; redone when an earlier session or a discarded window had it."""
        self.steps_run += 1
        if step <= self.redo_until:
            self.redone_steps += 1

    def rewound(self, from_step: int) -> None:
        """A rollback discarded the steps after the restored step up to ``from_step``: they will be redone."""
        self.redo_until = max(self.redo_until, from_step)

    def summary(self) -> dict[str, float]:
        """``{category: seconds}`` (summing to ``wall_s``), plus ``wall_s``, ``goodput`` (productive / wall),
        ``steps_run``, ``redone_steps`` and ``checkpoint_saves``."""
        wall = time.perf_counter() - self.t0
        out = dict(self.seconds)
        stepping = max(wall - sum(out.values()), 0.0)
        out["redone_s"] = stepping * self.redone_steps / self.steps_run if self.steps_run else 0.0
        out["productive_s"] = stepping - out["redone_s"]
        out = {k: out[k] for k in GOODPUT_CATEGORIES}
        out.update(wall_s=wall, goodput=out["productive_s"] / wall if wall > 0 else 0.0, steps_run=self.steps_run,
                   redone_steps=self.redone_steps, checkpoint_saves=self.checkpoint_saves)
        return out


class StragglerMonitor:
    """Finds a slow process among the processes of a multi-process run, from per-process figures the loop
    gathers every log interval.

    Each process measures, per step, its wall time between metric reads (``step_time_s``), the time it
    waited for its batch (``data_wait_s``) and the time it was blocked reading the step's metrics, i.e.
    waiting for the devices (and, through the collectives, for its slowest peer), plus the time its dispatches
    blocked (on CPU a dispatch waits for the previous step). Its *own* time,
    ``own_time_s = step_time_s - blocked``, is the time its host spent on the step: a slow host (slow input,
    a busy CPU) has the largest own time, while its peers spend the same time blocked. The slowest process is
    the one with the largest own time; its ratio is that over the median own time of the other processes
    (with two processes, the other one's).

    Args:
      threshold: a ratio above this is a slow interval.
      patience: consecutive slow intervals of the same process before :meth:`observe` flags a straggler.

    Raises:
      ValueError: ``threshold <= 1`` or ``patience < 1``.
    """

    def __init__(self, threshold: float = 1.5, patience: int = 3):
        if threshold <= 1 or patience < 1:
            raise ValueError(f"threshold = {threshold} (> 1), patience = {patience} (>= 1)")
        self.threshold, self.patience = threshold, patience
        self._slow: tuple[int, int] | None = None  # (process, consecutive slow intervals)

    def observe(self, figures: np.ndarray) -> dict[str, Any]:
        """``figures``: float [num_processes, 3], each row ``(step_time_s, data_wait_s, own_time_s)`` of one
        process (interval means). Returns the metrics.jsonl fields ``process_step_time_s``,
        ``process_data_wait_s``, ``process_own_time_s`` (lists by process index), ``slowest_process``,
        ``slowest_ratio`` (over the median of the others) and ``straggler`` (True once the same process was
        slow ``patience`` intervals in a row)."""
        figures = np.asarray(figures, np.float64)
        own = figures[:, 2]
        slowest = int(np.argmax(own))
        others = np.delete(own, slowest) if len(own) > 1 else own
        ratio = float(own[slowest] / max(float(np.median(others)), 1e-9))
        if ratio > self.threshold:
            n = self._slow[1] + 1 if self._slow and self._slow[0] == slowest else 1
            self._slow = (slowest, n)
        else:
            self._slow = None
        return {"process_step_time_s": figures[:, 0].tolist(), "process_data_wait_s": figures[:, 1].tolist(),
                "process_own_time_s": own.tolist(), "slowest_process": slowest, "slowest_ratio": ratio,
                "straggler": bool(self._slow and self._slow[1] >= self.patience)}


class HostTimes:
    """This process's per-step host figures over one log interval (see :class:`StragglerMonitor`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.t0, self.steps, self.data_wait, self.blocked = time.perf_counter(), 0, 0.0, 0.0

    def add(self, data_wait: float, blocked: float) -> None:
        """One step read back: its batch wait and the seconds the read blocked on the devices."""
        self.steps += 1
        self.data_wait += data_wait
        self.blocked += blocked

    def add_blocked(self, seconds: float) -> None:
        """Seconds a dispatch blocked on the devices (asynchronous dispatch returns at once; on CPU it waits)."""
        self.blocked += seconds

    def pop(self) -> np.ndarray:
        """float [3]: interval means ``(step_time_s, data_wait_s, own_time_s)``; resets the interval."""
        n = max(self.steps, 1)
        step = (time.perf_counter() - self.t0) / n
        out = np.array([step, self.data_wait / n, step - self.blocked / n], np.float64)
        self.reset()
        return out
