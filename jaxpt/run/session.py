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
from jaxpt.checkpoint import Checkpointer
from jaxpt.config import TrainConfig
from jaxpt.data import stream
from jaxpt.eval import inloop
from jaxpt.run import build as builder_lib, compile_cache, hooks as hooks_lib, lineage as lineage_lib, monitor, resolve
from jaxpt.run.context import LoopContext, log_start
from jaxpt.run.loop import final_evaluation, train_loop
from jaxpt.run.preemption import Preempted, Preemption
from jaxpt.run.record import RunRegistry
from jaxpt.training import flops as flops_lib, state as state_lib
from jaxpt.util import fs

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


def setup(r: resolve.Resolved | TrainConfig, init_state: bool = True) -> Run:
    """Build the resolved run (a bare config is resolved first, :func:`jaxpt.run.resolve.resolve`) with its
    throughput accounting and held-out evaluator, and (``init_state``) a fresh state, sharded at creation; without
    it the caller puts the run's first state in place (:func:`jaxpt.run.lineage.first_state`).

    Raises:
      ConfigError, CheckpointError: from resolving a bare config; before anything compiles.
    """
    r = resolve.resolve(r) if isinstance(r, TrainConfig) else r
    built = builder_lib.build(r.layout)
    cfg = built.cfg
    device = jax.local_devices()[0]
    peak, note = flops_lib.peak_flops_per_device(device, dtype=cfg.model.jnp_compute_dtype)
    throughput = monitor.Throughput(cfg.global_batch_size * cfg.seq_len,
                                    flops_lib.flops_per_token(cfg.model, cfg.seq_len), built.mesh.size, peak,
                                    peak_is_measured=flops_lib.table_peak_flops(device.device_kind) is None,
                                    rows_through=built.ramp.rows_through if cfg.batch_size_schedule else None,
                                    seq_len=cfg.seq_len)
    evaluator = inloop.HeldoutEvaluator(cfg, built.mesh, built.spec.graphdef, built.spec.abstract.params,
                                        r.tokenizer, r.heldout_docs, r.heldout_set)
    return Run(built, built.init_state() if init_state else None, r.tokenizer, throughput, note, evaluator)


def run_training(cfg: TrainConfig, fault_injector=None, batch_injector=None) -> dict[str, Any]:
    """Resolve the run (:func:`jaxpt.run.resolve.resolve`: every check once; nothing is written or compiled before
    it passes), build it, continue its lineage (resume, a new stage, or fresh: :mod:`jaxpt.run.lineage`), and train to
    ``cfg.steps``; returns the final record. A workdir already at ``cfg.steps`` is left untouched (its last final
    record is returned). Compiled programs go to, and come from, the persistent compilation cache
    (``TrainConfig.compilation_cache_dir``, :mod:`jaxpt.run.compile_cache`), so a restart does not recompile.

    ``fault_injector`` (``(step, state) -> state``, applied before each step) and ``batch_injector``
    (``(step, local_batch) -> local_batch``, applied to each fetched batch) are for drills and tests.

    Raises:
      ConfigError (exit 2), CheckpointError (exit 3): refused by the checks; DivergenceError: too many rollbacks;
      Preempted: saved and stopped on a preemption notice.
    """
    t_start = time.perf_counter()
    r = resolve.resolve(cfg)
    if r.lineage.nothing_to_do(r.cfg):
        log.warning("nothing to do: the newest checkpoint of %s is at step %d = TrainConfig.steps; nothing "
                    "written (pass a larger --steps to train on)", cfg.workdir, r.lineage.start_step)
        return last_final(cfg.workdir, r.lineage.start_step)
    # After the checks (a refused config leaves no cache directory behind), before anything compiles.
    with compile_cache.persistent_cache(compile_cache.resolve_cache_dir(cfg.compilation_cache_dir, cfg.workdir)):
        return _train(r, t_start, fault_injector, batch_injector)


def last_final(workdir: str, step: int) -> dict[str, Any]:
    """The last ``final`` record of ``<workdir>/metrics.jsonl`` (what a run already at its target step returns),
    or ``{"step": step, "event": "nothing_to_do"}`` when there is none."""
    path = monitor.metrics_path(workdir)
    finals = [r for r in monitor.read_metrics(workdir) if r.get("event") == "final"] if fs.exists(path) else []
    return finals[-1] if finals else {"step": step, "event": "nothing_to_do"}


def _start(r: resolve.Resolved, is_main: bool):
    """Write the operative config (after every check passed), build, and continue the lineage: ``(run, ckpt,
    batches, identity)`` with the run's first state in place."""
    config_text = config_lib.write_operative_config(r.given, write=is_main)
    run = setup(r, init_state=False)
    cfg, lin = run.cfg, r.lineage
    ckpt = Checkpointer(cfg.workdir, cfg.checkpoint) if cfg.checkpoint.enabled else None
    batches = stream.train_batches(cfg, run.tokenizer, r.data_shards, first_step=r.first_step)
    run.state = lineage_lib.first_state(lin, run.built, ckpt, batches, r.data_start)
    ident = lineage_lib.identity(cfg, lin, run.mesh, run.tokenizer, config_text, r.data_version, batches.num_shards,
                                 r.data_start)
    return run, ckpt, batches, ident


def _train(r: resolve.Resolved, t_start: float, fault_injector, batch_injector) -> dict[str, Any]:
    """:func:`run_training` once its checks passed: start, train, finish, recording the session in run.json."""
    is_main = jax.process_index() == 0
    run, ckpt, batches, ident = _start(r, is_main)
    cfg, start = run.cfg, r.lineage.start_step
    writer = monitor.MetricWriter(cfg.workdir, enabled=is_main, start_step=start)
    log_start(run, writer, start, r.notes, ident.stage)
    registry = RunRegistry(cfg.workdir, enabled=is_main)
    registry.start(cfg, run, ident)
    resumed_time = float(r.lineage.resume.meta.get("train_time_s", 0.0)) if r.lineage.resume is not None else 0.0
    ctx = None
    try:
        with Preemption() as preemption:
            goodput = monitor.Goodput(redo_until=registry.steps_reached_before(), t0=t_start)
            ctx = LoopContext(run, writer, batches, ckpt, ident.meta, preemption, registry, fault_injector,
                              train_time_s=resumed_time, goodput=goodput, batch_injector=batch_injector)
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
