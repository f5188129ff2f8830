"""What the train loop carries besides the state (:class:`LoopContext`), the loop's default hooks, and the
run's start record.

:func:`jaxpt.run.loop.train_loop` reads the batches, dispatches the steps and reads their metrics one step late;
everything it keeps between steps (metric writer, checkpointer, hooks, divergence monitor, step timer, goodput and
host-time accounting) lives on a :class:`LoopContext`, whose methods time a save or an evaluation as such, not as
step time.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import jax

from jaxpt import mesh as mesh_lib
from jaxpt.config import TrainConfig
from jaxpt.model import attention_auto
from jaxpt.run import hooks as hooks_lib, monitor
from jaxpt.run.preemption import Preemption
from jaxpt.training import state as state_lib
from jaxpt.training.noise_scale import NoiseScaleSmoother
from jaxpt.training.stability import DivergenceMonitor
from jaxpt.util import progress as progress_lib

log = logging.getLogger("jaxpt.train")


def progress_for(cfg: TrainConfig, start: int) -> progress_lib.Progress | None:
    """The train progress display on process 0 (None when ``TrainConfig.progress_bar`` is off): a bar on a
    terminal; in a log file (a TPU VM job, a scheduler) a plain line every 30 s with the step, the rate, the ETA
    and the last loss (tqdm's carriage returns would make one endless line there)."""
    if not cfg.progress_bar or jax.process_index() != 0:
        return None
    return progress_lib.Progress(cfg.steps, "train", "steps", initial=start)


class LoopContext:
    """What the loop carries besides the state: writer, batches, hooks, checkpointer, stability monitor."""

    def __init__(self, run, writer: monitor.MetricWriter, batches: Iterator, ckpt=None,
                 meta: dict | None = None, preemption: Preemption | None = None, registry=None,
                 fault_injector=None, hooks: list[hooks_lib.Hook] | None = None, train_time_s: float = 0.0,
                 goodput: monitor.Goodput | None = None, batch_injector=None):
        self.run, self.writer, self.batches, self.ckpt, self.meta = run, writer, batches, ckpt, meta
        self.preemption, self.registry = preemption, registry
        # ``(step, state) -> state`` applied before dispatching ``step``: fault injection for drills and tests.
        self.fault_injector = fault_injector
        # ``(step, local_batch) -> local_batch`` applied to each fetched batch: a bad batch, for drills and tests.
        self.batch_injector = batch_injector
        start = int(jax.device_get(run.state.step))
        self.hooks = default_hooks(run.cfg, ckpt, start) if hooks is None else hooks
        self.divergence = DivergenceMonitor(run.cfg.stability)
        self.timer = monitor.StepTimer()
        self.bar = progress_for(run.cfg, start)
        self.last: dict[str, Any] = {}
        self.losses = monitor.LossSeries()  # loss / loss_mean / skipped_loss, and the final report's mean of 20
        self.noise_scale = NoiseScaleSmoother()  # grad_noise_scale, from every step's gns/* (grad accumulation)
        self._clock0 = time.perf_counter() - train_time_s  # train_time_s: through the restored step
        self.goodput = goodput if goodput is not None else monitor.Goodput()
        self.host_times = monitor.HostTimes()
        self._goodput_written = time.perf_counter()
        self.compiled: set = set()  # train steps dispatched once (a batch-size ramp has one per size)
        self.throughput_after = start  # the step of the last record's throughput figures
        self._saved_time: tuple[int, float] | None = None  # (step, train_time_s) of the last checkpoint's meta

    def train_time_s(self) -> float:
        """Seconds of training wall time so far, over every session of the run (carried in checkpoints)."""
        return time.perf_counter() - self._clock0

    def time_through(self, step: int) -> float:
        """The training wall time through ``step`` (seconds), taken once per reported step: the time its
        checkpoint's meta recorded when ``step`` was saved (so a resume from that checkpoint continues the same
        clock, and the records stay increasing however long the save blocked), else the time now. A saved time is
        used once and forgotten at its step, so a step trained again after a rollback never gets an old one."""
        saved, now = self._saved_time, self.train_time_s()
        if saved is not None and step >= saved[0]:
            self._saved_time = None
            if step == saved[0]:
                return saved[1]
        return now

    def save_checkpoint(self, step: int, force: bool = False, wait: bool = False) -> None:
        """Save ``step`` (asynchronously unless ``wait``; the meta item records the training wall time so
        far); the time the loop is blocked counts as checkpoint time, not step time (the step being saved is
        finished first, so its own compute stays step time), and the run's goodput is recorded."""
        jax.block_until_ready(self.run.state)
        t0 = time.perf_counter()
        self._saved_time = (step, self.train_time_s())
        saved = self.ckpt.save(step, self.run.state, self.batches,
                               {**self.meta, "train_time_s": self._saved_time[1]}, force=force)
        if wait:
            self.ckpt.wait()
        blocked = time.perf_counter() - t0
        self.goodput.add("checkpoint_s", blocked)
        self.timer.exclude(blocked)
        self.goodput.checkpoint_saves += bool(saved)
        self.record_goodput(step)

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """:meth:`jaxpt.run.session.Run.evaluate`, its time counted as evaluation time, not step time (the last step is finished
        first, so its own compute stays step time)."""
        jax.block_until_ready(self.run.state.params)
        t0 = time.perf_counter()
        out = self.run.evaluate(max_batches)
        spent = time.perf_counter() - t0
        self.goodput.add("eval_s", spent)
        self.timer.exclude(spent)
        return out

    def record_goodput(self, step: int) -> None:
        """Write this session's time accounting and last step into run.json (:meth:`RunRegistry.update_session`)."""
        if self.registry is not None:
            self.registry.update_session({"last_step": step, "goodput": self.goodput.summary()})
        self._goodput_written = time.perf_counter()

    def event(self, record: dict[str, Any]) -> None:
        """Log an event to metrics.jsonl and the run registry."""
        self.writer.write(record)
        self.writer.flush()
        if self.registry is not None:
            self.registry.add_event(record)
        log.warning("event: %s", record)

    def close(self) -> None:
        """Close the hooks (e.g. a profiler window still open) and the progress display."""
        for h in self.hooks:
            h.close()
        if self.bar is not None:
            self.bar.close()


def default_hooks(cfg: TrainConfig, ckpt, start_step: int = 0) -> list[hooks_lib.Hook]:
    """The loop's periodic actions for ``cfg``: skip events, held-out evaluation, checkpoints, the document
    log (from ``start_step``: later lines are superseded), the profiler window, each when configured, and with
    several processes the straggler check."""
    hooks: list[hooks_lib.Hook] = [hooks_lib.SkipEventHook(), hooks_lib.EvalHook(cfg.eval_every, cfg.steps)]
    if ckpt is not None:
        hooks.append(hooks_lib.CheckpointHook(ckpt))
    if cfg.log_batch_documents:
        hooks.append(hooks_lib.DocumentLogHook(cfg.workdir, start_step))
    window = hooks_lib.parse_window(cfg.profile_steps)
    if window is not None:
        hooks.append(hooks_lib.ProfileHook(cfg.workdir, *window))
    if jax.process_count() > 1:
        hooks.append(hooks_lib.StragglerHook(cfg.log_every))
    return hooks


def log_start(run, writer: monitor.MetricWriter, start: int, notes: list[str], stage: dict) -> None:
    """Log the mesh, parameter count, MFU peak and attention implementation, and write the ``start`` (or
    ``resume`` / ``stage_start``) record of step ``start`` to metrics.jsonl."""
    frac = state_lib.replicated_param_fraction(run.spec)
    mesh_text = mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh))
    log.info("mesh %s over %d devices (%s); %.2fM params; %.2f%% of param bytes fully replicated", mesh_text,
             run.mesh.size, jax.devices()[0].device_kind, state_lib.num_params(run.spec) / 1e6, 100 * frac)
    log.info("MFU peak: %s", run.peak_note)
    attention = attention_auto.resolve_for(run.cfg.model, run.cfg.seq_len, list(run.mesh.devices.flat))
    log.info("attention_impl %r runs as %r%s", run.cfg.model.attention_impl, attention.name,
             f" (fallback: {attention.reason})" if attention.reason else "")
    new_stage = stage.get("parent") is not None and start == stage.get("start_step")
    writer.write({"step": start, "event": "stage_start" if new_stage else "resume" if start else "start",
                  "stage": stage["name"],
                  "attention_impl": run.cfg.model.attention_impl, "attention_impl_used": attention.name,
                  **({"attention_fallback_reason": attention.reason} if attention.reason else {}),
                  "num_params": state_lib.num_params(run.spec), "replicated_param_fraction": frac,
                  "mesh": mesh_text, "peak_flops_note": run.peak_note, "peak_flops_per_device": run.throughput.peak,
                  **({"notes": notes} if notes else {})})

