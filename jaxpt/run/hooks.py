"""Periodic actions of the train loop, as hooks registered with it.

The loop (:func:`jaxpt.run.loop.train_loop`) dispatches step t, then reads the metrics of step t-1, so the host
never waits on the device. A hook can act at three points of each step, each a method that does nothing by
default:

* ``on_batch(ctx, step, local_batch)``: step ``step``'s batch was fetched, not yet dispatched;
* ``on_dispatched(ctx, step)``: step ``step`` was dispatched (``ctx.run.state`` is its output, its metrics
  not read yet), e.g. start a checkpoint save (the device-to-host copy waits for the step, not the host);
* ``on_reported(ctx, report)``: step ``report.step``'s metrics were read (one step late); a hook may add
  figures to ``report.record``, which the loop writes when it is due or when a hook asked for it;
* ``on_rewind(ctx, step)``: a rollback took the run back to ``step``; what a hook logged for later steps is
  superseded.

Adding a periodic action (an eval, a gate check, a profiler window) is one new hook, not a loop edit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from jaxpt.data.mixture import GROUP_KEY, stage_at
from jaxpt.data.stream import BatchDocumentLog
from jaxpt.run import monitor, profile_comm
from jaxpt.util import fs

log = logging.getLogger("jaxpt.run.hooks")


@dataclasses.dataclass
class StepReport:
    """One step's read-back metrics, as the hooks see them.

    Attributes:
      step: the global step (1-based) the metrics belong to.
      values: the step's device metrics as Python floats (see :func:`jaxpt.training.step.train_step`).
      doc_index: int [local_batch, seq_len] document index of each token of this process's rows (-1: padding).
      data_wait: seconds the host waited for the step's batch.
      record: the metrics.jsonl record being assembled; hooks add figures to it.
      write: set by a hook that needs the record written even off the ``log_every`` grid.
      rollback: ``None``, or the reason the run must roll back after this step.
    """

    step: int
    values: dict[str, float]
    doc_index: np.ndarray
    data_wait: float
    record: dict[str, Any]
    write: bool = False
    rollback: str | None = None


class Hook:
    """Base class: a periodic action; override the points it acts at."""

    def on_batch(self, ctx, step: int, local_batch: dict[str, np.ndarray]) -> None:
        pass

    def on_dispatched(self, ctx, step: int) -> None:
        pass

    def on_reported(self, ctx, report: StepReport) -> None:
        pass

    def on_rewind(self, ctx, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class CheckpointHook(Hook):
    """Starts an (asynchronous) checkpoint save whenever the checkpointer's save policy wants the step
    (``ctx.save_checkpoint``: the loop's state, data position and meta)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def on_dispatched(self, ctx, step: int) -> None:
        if self.ckpt.should_save(step):
            ctx.save_checkpoint(step)


class EvalHook(Hook):
    """The held-out evaluation every ``every`` steps (not at the last step: the run's final evaluation covers
    it, nor at a step that triggers a rollback), bounded by ``TrainConfig.eval_batches``."""

    def __init__(self, every: int, last_step: int):
        self.every, self.last_step = every, last_step

    def on_reported(self, ctx, report: StepReport) -> None:
        s = report.step
        if self.every and s % self.every == 0 and s != self.last_step and report.rollback is None:
            report.record.update(ctx.evaluate())
            report.write = True


class SkipEventHook(Hook):
    """Logs a ``spike_skip`` / ``nonfinite_skip`` event (with the batch's documents) for every skipped step."""

    def on_reported(self, ctx, report: StepReport) -> None:
        v = report.values
        if not v.get("skipped"):
            return
        docs = sorted(int(d) for d in np.unique(report.doc_index) if d >= 0)
        ctx.event({"step": report.step, "event": "nonfinite_skip" if v.get("nonfinite") else "spike_skip",
                   "loss": v["loss"], "grad_norm": v["grad_norm"],
                   "loss_threshold": v.get("spike_loss_threshold"),
                   "grad_norm_threshold": v.get("spike_grad_norm_threshold"), "doc_index": docs})


class DocumentLogHook(Hook):
    """Appends, per fetched batch, the documents of this process's rows (:class:`jaxpt.data.stream.BatchDocumentLog`)."""

    def __init__(self, workdir: str, start_step: int | None = None):
        self.log = BatchDocumentLog(workdir, start_step)

    def on_batch(self, ctx, step: int, local_batch: dict[str, np.ndarray]) -> None:
        self.log.write(step, local_batch["doc_index"])

    def on_rewind(self, ctx, step: int) -> None:
        self.log.rewind(step)

    def close(self) -> None:
        self.log.close()


class ProfileHook(Hook):
    """A ``jax.profiler`` trace of steps ``start``..``stop`` (inclusive, 1-based) into ``<workdir>/profile``
    (``*.xplane.pb`` for TensorBoard's profile plugin, ``perfetto_trace.json.gz`` for Perfetto), and the
    window's communication share by mesh axis in the record of step ``stop`` (``comm_share``,
    ``comm_share/<axes>``: :func:`jaxpt.run.profile_comm.comm_share_by_axis`). Process 0 only."""

    def __init__(self, workdir: str, start: int, stop: int):
        if not 1 <= start <= stop:
            raise ValueError(f"profile window {start}:{stop}: need 1 <= start <= stop")
        self.dir, self.start, self.stop = fs.join(workdir, "profile"), start, stop
        self.active = False

    def on_batch(self, ctx, step: int, local_batch) -> None:
        if step == self.start and jax.process_index() == 0:
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.active = True

    def on_reported(self, ctx, report: StepReport) -> None:
        if self.active and report.step >= self.stop:
            t0 = time.perf_counter()
            jax.block_until_ready(ctx.run.state)
            jax.profiler.stop_trace()
            self.active = False
            report.record["profile_dir"] = self.dir
            report.write = True
            log.info("profiled steps %d-%d into %s", self.start, self.stop, self.dir)
            report.record.update(self._comm_shares(ctx))
            ctx.timer.exclude(time.perf_counter() - t0)  # writing and reading the trace is not step time

    def _comm_shares(self, ctx) -> dict:
        try:
            shares = profile_comm.comm_share_by_axis(self.dir, ctx.run.mesh.devices, ctx.run.mesh.axis_names)
        except (OSError, ValueError) as e:  # a trace that cannot be read costs the figures, not the run
            log.warning("communication share of the profile window not measured: %s", e)
            return {}
        axes = sorted(((k.split("/", 1)[1], v) for k, v in shares.items() if k.startswith("comm_share/")),
                      key=lambda kv: -kv[1])
        log.info("steps %d-%d: collectives %.1f%% of device time (%s)", self.start, self.stop,
                 100 * shares.get("comm_share", 0.0), ", ".join(f"{k} {v:.1%}" for k, v in axes))
        return shares

    def close(self) -> None:
        if self.active:  # the run ended inside the window (preemption, divergence, an error)
            jax.profiler.stop_trace()
            self.active = False
            log.warning("the run ended inside the profile window %d:%d: its trace in %s is partial and its "
                        "communication share was not measured", self.start, self.stop, self.dir)


def parse_window(text: str) -> tuple[int, int] | None:
    """``'20:25'`` -> ``(20, 25)``; ``''`` -> None.

    Raises:
      ValueError: not of the form ``START:STOP`` with integers.
    """
    if not text:
        return None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise ValueError(f"profile window {text!r}: expected START:STOP, e.g. '20:25'") from None


class MixtureShareHook(Hook):
    """Logs the realized token shares of the data mixture per stage (:mod:`jaxpt.data.mixture`).

    Counts the tokens of each group in the batches the loop actually trains on (this process's rows, from the
    host-side ``mixture_group`` key; every logical shard follows the weights, so one process's shares are the
    global ones within a document per shard), per stage, from this session's start. Adds to each logged
    record ``mixture/stage`` (0-based), ``mixture/stage_tokens`` and ``mixture/share/<group>`` (tokens of the
    group / tokens of the stage so far, padding excluded), and asks for a record at each stage's last step.
    A rollback starts the stage's counts again.
    """

    def __init__(self, schedule, groups: list[str]):
        self.schedule, self.groups = list(schedule), list(groups)
        self.pending: dict[int, np.ndarray] = {}
        self.stage, self.totals = None, np.zeros(len(self.groups), np.int64)

    @classmethod
    def for_batches(cls, batches) -> "MixtureShareHook | None":
        """The hook for a token-mixture stream (:mod:`jaxpt.data.mixture`: its iterators carry a ``schedule``),
        else None."""
        its = list(getattr(batches, "iterators", {}).values())
        schedule = getattr(its[0], "schedule", None) if its else None
        return None if schedule is None else cls(schedule, its[0].groups)

    def stages_record(self) -> list[dict]:
        """The mixture's stages as run.json records them: ``[{"start_step", "weights"}]``, weights normalized."""
        return [{"start_step": s, "weights": w} for s, w in self.schedule]

    def on_batch(self, ctx, step: int, local_batch: dict[str, np.ndarray]) -> None:
        g = local_batch.get(GROUP_KEY)
        if g is not None:
            self.pending[step] = np.bincount(g[g >= 0].ravel(), minlength=len(self.groups))[:len(self.groups)]

    def on_reported(self, ctx, report: StepReport) -> None:
        counts = self.pending.pop(report.step, None)
        if counts is None:
            return
        stage = stage_at(self.schedule, report.step)
        if stage != self.stage:
            self.stage, self.totals = stage, np.zeros(len(self.groups), np.int64)
        self.totals += counts
        total = int(self.totals.sum())
        report.record["mixture/stage"] = stage
        report.record["mixture/stage_tokens"] = total
        for name, c in zip(self.groups, self.totals):
            report.record[f"mixture/share/{name}"] = float(c) / total if total else 0.0
        nxt = self.schedule[stage + 1][0] if stage + 1 < len(self.schedule) else None
        if nxt is not None and report.step == nxt - 1:
            report.write = True

    def on_rewind(self, ctx, step: int) -> None:
        self.pending.clear()
        self.stage = None


class StragglerHook(Hook):
    """Every ``log_every`` steps, gathers every process's host figures of the interval (``ctx.host_times``; a
    collective, so every process runs it on the same steps), adds them to the record
    (:meth:`jaxpt.run.monitor.StragglerMonitor.observe`) and logs the slowest process; a persistent one is a
    ``straggler`` event. Registered by :func:`jaxpt.run.context.default_hooks` when there are several processes.
    """

    def __init__(self, log_every: int):
        self.log_every = log_every
        self.monitor = monitor.StragglerMonitor()

    def on_reported(self, ctx, report: StepReport) -> None:
        from jax.experimental import multihost_utils
        if report.step % self.log_every:
            return
        figures = np.asarray(multihost_utils.process_allgather(ctx.host_times.pop()))
        out = self.monitor.observe(figures.reshape(jax.process_count(), 3))
        report.record.update(out)
        if jax.process_index() != 0:
            return
        log.info("step %d: slowest process %d, own time %.3f s/step = %.2fx the median", report.step,
                 out["slowest_process"], out["process_own_time_s"][out["slowest_process"]], out["slowest_ratio"])
        if out["straggler"]:
            ctx.event({"step": report.step, "event": "straggler", "process": out["slowest_process"],
                       "ratio": out["slowest_ratio"], "threshold": self.monitor.threshold,
                       "intervals": self.monitor.patience})
