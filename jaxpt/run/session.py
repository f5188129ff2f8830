"""A training session: check every input, build the run, continue its lineage, train to ``TrainConfig.steps``.

:func:`run_training` is what ``python -m jaxpt.train`` runs (and what tools that train call): the checks
(:mod:`jaxpt.run.resolve`) before anything is written or compiled, then :func:`setup` (:mod:`jaxpt.run.build`, the sharded
state, the held-out evaluator), the resume or stage start (:mod:`jaxpt.run.lineage`), and the loop
(:mod:`jaxpt.run.loop`) with its hooks, recorded in ``run.json`` (:mod:`jaxpt.run.record`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

from jaxpt import config as config_lib
from jaxpt.config import TrainConfig
from jaxpt.data import stream
from jaxpt.run import build as builder_lib
from jaxpt.run import compile_cache
from jaxpt.run import hooks as hooks_lib
from jaxpt.run import lineage as stage_lib
from jaxpt.run import monitor
from jaxpt.run import resolve as preflight
from jaxpt.run.context import LoopContext, log_start
from jaxpt.run.loop import final_evaluation, train_loop
from jaxpt.run.preemption import Preempted, Preemption
from jaxpt.run.record import RunRegistry
from jaxpt.training import flops as flops_lib
from jaxpt.training import state as state_lib

log = logging.getLogger("jaxpt.train")

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
        final = final_evaluation(ctx, last)
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
