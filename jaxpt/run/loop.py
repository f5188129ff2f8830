"""The train loop: dispatch step t, then read step t-1's metrics, so the host never waits on the device.

:func:`train_loop` runs a built and initialized run (:class:`jaxpt.run.session.Run`) with what it carries between
steps (:class:`jaxpt.run.context.LoopContext`); periodic actions are hooks (:mod:`jaxpt.run.hooks`). Divergence rolls
the run back (:func:`rollback`); preemption saves and raises :class:`jaxpt.run.preemption.Preempted`;
:func:`final_evaluation` saves the last step and writes the ``final`` record.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpt.data import stream
from jaxpt.run import hooks as hooks_lib, monitor
from jaxpt.run.context import LoopContext
from jaxpt.run.preemption import Preempted

log = logging.getLogger("jaxpt.train")

#: Seconds between run.json updates of the session's goodput (also written at every checkpoint and at the end).
GOODPUT_EVERY_S = 10.0


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics are not yet read."""

    step: int
    metrics: Any
    data_wait: float
    doc_index: np.ndarray


def train_loop(ctx: LoopContext) -> dict[str, Any]:
    """Train from ``run.state.step`` up to ``cfg.steps``. Returns the last logged record.

    The loop dispatches step t, then reads the metrics of step t-1 (already finished or about to), so the
    host never blocks the device. The first step's time (compile) is excluded from throughput. Divergence
    triggers :func:`rollback`; on preemption the loop saves, waits for the commit and raises :class:`Preempted`.
    """
    run = ctx.run
    step = int(jax.device_get(run.state.step))
    pending: _Pending | None = None
    ctx.goodput.start_loop()
    while step < run.cfg.steps:
        t0 = time.perf_counter()
        local = stream.next_batch(ctx.batches, run.built.ramp.units(step + 1))
        if ctx.batch_injector is not None:
            local = ctx.batch_injector(step + 1, local)
        batch = stream.to_device(run.mesh, run.cfg.logical_axis_rules, local)
        data_wait = time.perf_counter() - t0
        for h in ctx.hooks:
            h.on_batch(ctx, step + 1, local)
        if ctx.fault_injector is not None:
            run.state = ctx.fault_injector(step + 1, run.state)
        t1 = time.perf_counter()
        train_step = run.built.train_step_for(step + 1)
        run.state, metrics = train_step(run.state, batch)
        dispatch_s = time.perf_counter() - t1
        if ctx.goodput.steps_run == 0 or train_step not in ctx.compiled:  # a first dispatch traces and compiles
            ctx.compiled.add(train_step)
            ctx.goodput.add("compile_s", dispatch_s)
            ctx.timer.exclude(dispatch_s)
            ctx.host_times.reset()  # compile time is no process's slowness
        else:
            ctx.host_times.add_blocked(dispatch_s)  # a dispatch may wait for the devices (CPU: it does)
        ctx.goodput.add("data_wait_s", data_wait)
        step += 1
        ctx.goodput.step(step)
        trouble = _report(ctx, pending) if pending is not None else None
        pending = _Pending(step, metrics, data_wait, local["doc_index"])
        if trouble is not None:
            step = rollback(ctx, *trouble)
            pending = None  # the step dispatched from the bad state is discarded
            continue
        for h in ctx.hooks:
            h.on_dispatched(ctx, step)
        if ctx.preemption is not None and ctx.preemption.should_stop(step):
            _stop_for_preemption(ctx, pending, step)
    if pending is not None:
        trouble = _report(ctx, pending)
        if trouble is not None:  # trouble on the very last step: roll back and finish the run
            rollback(ctx, *trouble)
            return train_loop(ctx)
    return ctx.last


def _stop_for_preemption(ctx: LoopContext, pending: _Pending, step: int) -> None:
    _report(ctx, pending)
    if ctx.ckpt is not None:
        ctx.save_checkpoint(step, force=True, wait=True)
    ctx.event({"step": step, "event": "preempted"})
    raise Preempted(step)


def _report(ctx: LoopContext, p: _Pending) -> tuple[int, str] | None:
    """Read one step's metrics (blocks until that step is done), run the hooks, and write the record every
    ``log_every`` steps (and at step 1, the last step, a rollback, or when a hook asks), with the interval's
    mean loss (:class:`jaxpt.run.monitor.LossSeries`), the smoothed gradient noise scale with accumulation
    (:class:`jaxpt.training.noise_scale.NoiseScaleSmoother`), tokens seen and training time so far.
    Returns ``(step, reason)`` when the run must roll back."""
    run, cfg = ctx.run, ctx.run.cfg
    t0 = time.perf_counter()
    values = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
    train_time_s = ctx.time_through(p.step)  # for every step: a saved step's time is used at that step or never
    ctx.host_times.add(p.data_wait, time.perf_counter() - t0)
    ctx.timer.tick()
    if ctx.bar is not None:
        ctx.bar.update(1)
        ctx.bar.set_postfix(loss=f"{values['loss']:.3f}")
    reason = ctx.divergence.observe(p.step, values["loss"], bool(values.get("nonfinite")))
    report = hooks_lib.StepReport(p.step, values, p.doc_index, p.data_wait, {"step": p.step, **values},
                                  rollback=reason)
    for h in ctx.hooks:
        h.on_reported(ctx, report)
    ctx.losses.observe(report.record)
    ctx.noise_scale.observe(report.record)
    if p.step % cfg.log_every == 0 or p.step == cfg.steps or p.step == 1 or reason or report.write:
        record = report.record
        record.update(ctx.losses.pop_interval(), **ctx.noise_scale.record())
        step_time = ctx.timer.pop_mean()
        if step_time is not None:
            record.update(run.throughput.figures(
                step_time, run.throughput.interval_tokens_per_step(ctx.throughput_after, p.step)))
            ctx.throughput_after = p.step
        if cfg.batch_size_schedule:
            record["batch_size"] = run.built.ramp.batch_size(p.step)  # the realized global batch, rows
        record.update(tokens_seen=run.throughput.tokens_seen(p.step), train_time_s=train_time_s,
                      data_wait_s=p.data_wait, host_peak_rss_gib=monitor.host_peak_rss_bytes() / 2 ** 30)
        ctx.writer.write(record)
        ctx.last = record
        if time.perf_counter() - ctx._goodput_written > GOODPUT_EVERY_S:
            ctx.record_goodput(p.step)
    return (p.step, reason) if reason else None


def rollback(ctx: LoopContext, step: int, reason: str) -> int:
    """Roll back to the last good checkpoint (or the initial state), damp the learning rate, and keep the
    data iterator where it is, so the window of batches since that checkpoint is skipped. Returns the
    step the run continues from.

    Raises:
      DivergenceError: too many rollbacks within ``StabilityConfig.rollback_window_steps``.
    """
    run, st = ctx.run, ctx.run.cfg.stability
    ctx.divergence.record_rollback(step, reason)
    # The trouble began at `step` (non-finite) or up to `patience` steps earlier (slow divergence).
    trouble_start = step if "non-finite" in reason else max(step - st.rollback_patience, 0)
    lr_scale = float(jax.device_get(run.state.lr_scale)) * st.lr_damping
    state, restored_step = (None, 0)
    if ctx.ckpt is not None:
        state, restored_step = ctx.ckpt.rewind(trouble_start, run.spec.abstract)
    run.state = state if state is not None else run.built.init_state()
    run.state = run.state.replace(lr_scale=jnp.asarray(lr_scale, jnp.float32))
    ctx.goodput.rewound(step)
    ctx.writer.rewind(restored_step)  # the records of the discarded steps are superseded: one value per step
    ctx.losses.reset()
    ctx.noise_scale.reset()
    for h in ctx.hooks:
        h.on_rewind(ctx, restored_step)
    ctx.event({"step": step, "event": "rollback", "reason": reason, "restored_step": restored_step,
               "lr_scale": lr_scale, "skipped_batches": [restored_step + 1, step + 1]})
    return restored_step


def final_evaluation(ctx: LoopContext, last: dict[str, Any]) -> dict[str, Any]:
    """Save the last step, run the full held-out evaluation and write the ``final`` record."""
    run = ctx.run
    step = int(jax.device_get(run.state.step))
    if ctx.ckpt is not None:
        ctx.save_checkpoint(step, force=True, wait=True)
    final = {"step": step, "event": "final", **ctx.evaluate(max_batches=0), "train_loss": last.get("loss"),
             "train_loss_mean_last20": ctx.losses.mean_last(), "train_time_s": ctx.train_time_s()}
    if run.throughput.peak_raised:
        final["peak_flops_per_device"] = run.throughput.peak  # the measured CPU peak, raised by achieved steps
    ctx.writer.write(final)
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    log.info("step %d: train loss %s (mean of the last %d steps %s), held-out loss %.4f "
             "(perplexity %.1f over %d tokens)", final["step"], fmt(final["train_loss"]), ctx.losses.recent_count,
             fmt(final["train_loss_mean_last20"]), final["heldout_loss"], final["heldout_perplexity"],
             final["heldout_tokens"])
    return final
