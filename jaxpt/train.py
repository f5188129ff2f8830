"""``python -m jaxpt.train``: build the run, then run the train loop with its hooks.

Reads top to bottom: :func:`main` parses flags; :func:`setup` checks the inputs and builds the run with
:func:`jaxpt.run.build.build` (the one builder every entry point uses); :func:`train_loop` dispatches step t and
only then reads the metrics of step t-1, so the host never waits on the device. Periodic actions
(checkpoints, held-out evaluation, the document log, skip events, a profiler window) are hooks
(:mod:`jaxpt.run.hooks`); data, checkpoint and evaluation helpers live with their owners
(:mod:`jaxpt.data.stream`, :mod:`jaxpt.checkpoint`, :mod:`jaxpt.eval.inloop`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpt.run import build as builder_lib
from jaxpt.run import compile_cache
from jaxpt import config as config_lib
from jaxpt.run import distributed
from jaxpt.training import flops as flops_lib
from jaxpt.run import hooks as hooks_lib
from jaxpt.run.context import LoopContext, log_start
from jaxpt.run import monitor
from jaxpt.run import resolve as preflight
from jaxpt.util import progress as progress_lib
from jaxpt.run import lineage as stage_lib
from jaxpt.training import state as state_lib
from jaxpt.config import TrainConfig
from jaxpt.data import stream
from jaxpt.util.errors import ConfigError
from jaxpt.run.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from jaxpt.run.record import RunRegistry

log = logging.getLogger("jaxpt.train")

#: Seconds between run.json updates of the session's goodput (also written at every checkpoint and at the end).
GOODPUT_EVERY_S = 10.0


@dataclasses.dataclass
class Run:
    """Everything :func:`train_loop` needs, built by :func:`setup`: the built program and the live state."""

    built: builder_lib.Built
    state: state_lib.TrainState
    tokenizer: Any
    throughput: monitor.Throughput
    peak_note: str
    evaluator: Any  # jaxpt.eval.inloop.HeldoutEvaluator

    @property
    def cfg(self) -> TrainConfig:
        return self.built.cfg

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.built.mesh

    @property
    def spec(self) -> state_lib.StateSpec:
        return self.built.spec

    @property
    def train_step(self):
        return self.built.train_step

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Held-out figures of the current params (:meth:`jaxpt.eval.inloop.HeldoutEvaluator.evaluate`);
        ``max_batches`` defaults to ``TrainConfig.eval_batches`` (0: the whole held-out set)."""
        limit = self.cfg.eval_batches if max_batches is None else max_batches
        return self.evaluator.evaluate(self.state.params, limit)


def setup(cfg: TrainConfig, pre: preflight.Preflight | None = None) -> Run:
    """Build the run on checked inputs (``pre``, else :func:`jaxpt.run.resolve.check` of ``cfg``) and initialize
    its sharded state.

    Raises:
      ConfigError: naming the key, file or line; before anything compiles.
    """
    from jaxpt.eval import inloop
    pre = pre or preflight.check(cfg)
    built = builder_lib.build(pre.cfg, tokenizer=pre.tokenizer)
    cfg = built.cfg
    device = jax.local_devices()[0]
    peak, note = flops_lib.peak_flops_per_device(device, dtype=cfg.model.jnp_compute_dtype)
    throughput = monitor.Throughput(cfg.global_batch_size * cfg.seq_len,
                                    flops_lib.flops_per_token(cfg.model, cfg.seq_len), built.mesh.size, peak,
                                    peak_is_measured=flops_lib.table_peak_flops(device.device_kind) is None,
                                    rows_through=built.ramp.rows_through if cfg.batch_size_schedule else None,
                                    seq_len=cfg.seq_len)
    evaluator = inloop.HeldoutEvaluator(cfg, built.mesh, built.spec.graphdef, built.spec.abstract.params,
                                        pre.tokenizer, pre.heldout_docs, pre.heldout_set)
    return Run(built, built.init_state(), pre.tokenizer, throughput, note, evaluator)


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
    mean loss (:class:`jaxpt.run.monitor.LossSeries`), tokens seen and training time so far.
    Returns ``(step, reason)`` when the run must roll back."""
    run, cfg = ctx.run, ctx.run.cfg
    t0 = time.perf_counter()
    values = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
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
    if p.step % cfg.log_every == 0 or p.step == cfg.steps or p.step == 1 or reason or report.write:
        record = report.record
        record.update(ctx.losses.pop_interval())
        step_time = ctx.timer.pop_mean()
        if step_time is not None:
            record.update(run.throughput.figures(
                step_time, run.throughput.interval_tokens_per_step(ctx.throughput_after, p.step)))
            ctx.throughput_after = p.step
        if cfg.batch_size_schedule:
            record["batch_size"] = run.built.ramp.batch_size(p.step)  # the realized global batch, rows
        record.update(tokens_seen=run.throughput.tokens_seen(p.step), train_time_s=ctx.train_time_s(),
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
    for h in ctx.hooks:
        h.on_rewind(ctx, restored_step)
    ctx.event({"step": step, "event": "rollback", "reason": reason, "restored_step": restored_step,
               "lr_scale": lr_scale, "skipped_batches": [restored_step + 1, step + 1]})
    return restored_step


def _final(ctx: LoopContext, last: dict[str, Any]) -> dict[str, Any]:
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


def run_training(cfg: TrainConfig, fault_injector=None, batch_injector=None) -> dict[str, Any]:
    """Check every input and the resume target (:func:`jaxpt.run.resolve.check`; nothing is written or compiled
    before it passes), set up, resume if the workdir has checkpoints, and train to ``cfg.steps``; returns the
    final record. A workdir already at ``cfg.steps`` is left untouched (its last final record is returned).
    Compiled programs go to, and come from, the persistent compilation cache (``TrainConfig.compilation_cache_dir``,
    :mod:`jaxpt.run.compile_cache`), so a restart does not recompile.

    ``fault_injector`` (``(step, state) -> state``, applied before each step) and ``batch_injector``
    (``(step, local_batch) -> local_batch``, applied to each fetched batch) are for drills and tests.
    """
    t_start = time.perf_counter()
    pre = preflight.check(cfg)
    if pre.nothing_to_do:
        log.warning("nothing to do: the newest checkpoint of %s is at step %d = TrainConfig.steps; nothing "
                    "written (pass a larger --steps to train on)", cfg.workdir, pre.resume_step)
        return preflight.last_final(cfg.workdir, pre.resume_step)
    # After the checks (a refused config leaves no cache directory behind), before anything compiles.
    with compile_cache.persistent_cache(compile_cache.resolve_cache_dir(cfg.compilation_cache_dir, cfg.workdir)):
        return _train(cfg, pre, t_start, fault_injector, batch_injector)


def _train(cfg: TrainConfig, pre: preflight.Preflight, t_start: float, fault_injector,
           batch_injector) -> dict[str, Any]:
    """:func:`run_training` once its checks passed: write the operative config, set up, resume, train, finish."""
    from jaxpt.checkpoint import Checkpointer, run_meta
    is_main = jax.process_index() == 0
    config_text = config_lib.write_operative_config(cfg, write=is_main)  # after every check passed
    run = setup(cfg, pre)
    cfg = run.cfg
    ckpt = Checkpointer(cfg.workdir, cfg.checkpoint) if cfg.checkpoint.enabled else None
    batches = stream.train_batches(cfg, run.tokenizer,
                                   stream.data_shard_count(cfg, ckpt.saved_data_shards() if ckpt else None))
    start = 0
    if ckpt is not None:
        state, start = ckpt.resume(run.spec.abstract, batches, cfg.model, run.tokenizer.sha256)
        run.state = state if state is not None else run.state
    stage = ((pre.resume_meta.get("stage") if start else None)
             or stage_lib.stage_record(cfg, pre.parent, stream.data_version(cfg)))
    if start == 0 and pre.parent is not None:  # a new stage: its first state from the parent checkpoint
        run.state = stage_lib.begin_stage(run.built, pre.parent)
        start = pre.parent.step
    writer = monitor.MetricWriter(cfg.workdir, enabled=is_main, start_step=start)
    meta = run_meta(cfg, run.mesh, run.tokenizer, config_text, stream.data_version(cfg), batches.num_shards)
    meta["stage"] = stage
    log_start(run, writer, start, pre.notes, stage)
    registry = RunRegistry(cfg.workdir, enabled=is_main)
    registry.start(cfg, config_text, run, stream.data_version(cfg),
                   stages=[*(stage_lib.parent_stages(pre.parent) if pre.parent else []), stage])
    ctx = None
    try:
        with Preemption() as preemption:
            goodput = monitor.Goodput(redo_until=registry.steps_reached_before(), t0=t_start)
            ctx = LoopContext(run, writer, batches, ckpt, meta, preemption, registry, fault_injector,
                              train_time_s=float(pre.resume_meta.get("train_time_s", 0.0)) if start else 0.0,
                              goodput=goodput, batch_injector=batch_injector)
            mixture = hooks_lib.MixtureShareHook.for_batches(batches)
            if mixture is not None:  # record the mixture's stages; log its realized shares per stage
                registry.update_session({"mixture": mixture.stages_record()})
                ctx.hooks.append(mixture)
            last = train_loop(ctx)
        final = _final(ctx, last)
        ctx.record_goodput(final["step"])
        registry.finish("completed", final)
        return final
    except Preempted as e:
        ctx.record_goodput(e.args[0])
        registry.finish("preempted", {})
        raise
    except Exception as e:
        if ctx is not None:
            ctx.record_goodput(int(jax.device_get(run.state.step)))
        registry.finish("failed", {"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        if ctx is not None:
            ctx.close()
        if ckpt is not None:
            ckpt.close()
        writer.close()


def main(argv: list[str] | None = None) -> int:
    from jaxpt.checkpoint import CheckpointError
    from jaxpt.training.stability import DivergenceError
    parser = argparse.ArgumentParser(prog="python -m jaxpt.train", description=__doc__.splitlines()[0])
    config_lib.add_arguments(parser)
    distributed.add_arguments(parser)
    parser.add_argument("--dry_run", action="store_true", help="check config, mesh, paths, tokenizer and the "
                        "resume target, print the plan; compile and write nothing (jaxpt.run.resolve)")
    args = parser.parse_args(argv)
    progress_lib.quiet_startup()
    try:
        cfg = config_lib.from_args(args)  # parse first: a config error needs no cluster
        startup = distributed.initialize(args)
        logging.basicConfig(level=logging.WARNING, force=True,
                            format=f"[%(asctime)s p{jax.process_index()}] %(name)s: %(message)s")
        logging.getLogger("jaxpt").setLevel(logging.INFO)
        distributed.log_startup(startup)
        if args.dry_run:
            print(preflight.format_plan(preflight.plan(cfg)))
        else:
            run_training(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        if "devices are present" in str(e) and jax.default_backend() == "cpu":
            print("hint: on a CPU host, simulate devices with "
                  "XLA_FLAGS=--xla_force_host_platform_device_count=8 (the Makefile sets it)", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    except DivergenceError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 4
    except Preempted as e:
        print(f"preempted at step {e.args[0]}: checkpoint committed; rerun the same command to resume",
              file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
