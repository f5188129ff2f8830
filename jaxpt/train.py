"""``python -m jaxpt.train``: build the config, mesh, state and data, then run the train loop.

Reads top to bottom: :func:`main` parses flags; :func:`setup` wires config -> mesh -> state -> steps -> data;
:func:`train_loop` dispatches step t and only then reads the metrics of step t-1, so the host never waits
on the device; :func:`evaluate` reports the held-out loss with the same mesh and one compiled step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxpt import config as config_lib
from jaxpt import distributed
from jaxpt import flops as flops_lib
from jaxpt import mesh as mesh_lib
from jaxpt import monitor
from jaxpt import optim
from jaxpt import state as state_lib
from jaxpt import step as step_lib
from jaxpt.config import ConfigError, TrainConfig
from jaxpt.eval import inloop  # registers HeldoutEvalConfig with gin (per-domain held-out eval in the loop)
from jaxpt.registry import RunRegistry

log = logging.getLogger("jaxpt.train")


@dataclasses.dataclass
class Run:
    """Everything :func:`train_loop` needs, built by :func:`setup`."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    spec: state_lib.StateSpec
    state: state_lib.TrainState
    tokenizer: Any
    train_step: Any
    eval_step: Any
    lr_schedule: Any
    throughput: monitor.Throughput
    peak_note: str
    eval_dataset: Any = None      # held-out batches, read and packed once, reused by every evaluation


def resolve_model_config(cfg: TrainConfig, tokenizer) -> TrainConfig:
    """Fill ``ModelConfig.vocab_size`` from the tokenizer when it is 0.

    Raises:
      ConfigError: a non-zero ``ModelConfig.vocab_size`` smaller than the tokenizer's vocabulary.
    """
    vocab = tokenizer.vocab_size
    m = cfg.model
    if m.vocab_size == 0:
        m = dataclasses.replace(m, vocab_size=vocab)
    elif m.vocab_size < vocab:
        raise ConfigError(f"ModelConfig.vocab_size = {m.vocab_size} is smaller than the tokenizer's "
                          f"{vocab} pieces ({cfg.data.tokenizer_path}); set it to 0 to follow the tokenizer")
    return dataclasses.replace(cfg, model=m)


def load_tokenizer(cfg: TrainConfig):
    """The run's :class:`jaxpt.data.tokenizer.Tokenizer` from ``DataConfig.tokenizer_path``.

    Raises:
      ConfigError: the model file is missing (names the key and the command that writes it).
    """
    from jaxpt.data.tokenizer import Tokenizer
    path = cfg.data.tokenizer_path
    if not os.path.exists(path):
        raise ConfigError(f"DataConfig.tokenizer_path = {path!r}: no such file "
                          "(run `python -m jaxpt.data.prepare --output artifacts/sample` first)")
    return Tokenizer.load(path)


def heldout_files(cfg: TrainConfig) -> list[str]:
    """The held-out documents (JSON Lines files) of a run's held-out loss.

    ``DataConfig.source = 'sample'``: ``DataConfig.heldout_path``. ``'corpus'``: the corpus version's own held-out
    split, ``<corpus_dir>/heldout/<domain>.jsonl.gz``, which ``data_pipelines.build`` keeps out of the training
    shards (``OutputConfig.heldout_fraction``); ``heldout_path`` is then ignored, so a corpus run never evaluates
    on text from another corpus. The rule is :func:`jaxpt.eval.heldout.run_sources`.

    Raises:
      ConfigError: the file or split is missing (names the config key), checked before anything compiles.
    """
    from jaxpt.eval import heldout
    source = heldout.run_sources(cfg.data)[0]
    try:
        return heldout.resolve_source(source, "heldout")
    except FileNotFoundError:
        if cfg.data.source == "corpus":
            raise ConfigError(f"DataConfig.corpus_dir = {source!r}: no held-out split (heldout/*.jsonl.gz); "
                              "rebuild the corpus version with OutputConfig.heldout_fraction > 0") from None
        raise ConfigError(f"DataConfig.heldout_path = {source!r}: no such file") from None


def setup(cfg: TrainConfig) -> Run:
    """Validate, build the mesh, create the sharded state and compile-ready steps."""
    sizes = config_lib.validate(cfg, jax.device_count())
    heldout_files(cfg)  # a missing held-out set fails now, not after the last step
    tokenizer = load_tokenizer(cfg)
    cfg = resolve_model_config(cfg, tokenizer)
    if cfg.dcn_mesh:
        ici = mesh_lib.resolve_mesh_shape(mesh_lib.parse_mesh_spec(cfg.mesh),
                                          jax.device_count() // _num_slices(cfg))
        mesh = mesh_lib.make_hybrid_mesh(ici, mesh_lib.parse_mesh_spec(cfg.dcn_mesh))
    else:
        mesh = mesh_lib.make_mesh(sizes)
    rules = cfg.logical_axis_rules
    lr_schedule = optim.learning_rate_schedule(cfg.optimizer, cfg.steps)
    spec = state_lib.make_state_spec(
        cfg.model, lambda p: optim.make_optimizer(cfg.optimizer, cfg.steps, p), mesh, rules, cfg.stability)
    state = state_lib.init_state(spec, cfg.model, cfg.seed)
    train_fn = step_lib.jit_train_step(spec, mesh, rules, z_loss_weight=cfg.z_loss_weight,
                                       lr_schedule=lr_schedule, grad_clip_norm=cfg.optimizer.grad_clip_norm,
                                       grad_accum=cfg.grad_accum_steps)
    eval_fn = step_lib.jit_eval_step(spec, mesh, rules)
    peak, note = flops_lib.peak_flops_per_device(dtype=cfg.model.jnp_compute_dtype)
    throughput = monitor.Throughput(cfg.global_batch_size * cfg.seq_len,
                                    flops_lib.flops_per_token(cfg.model, cfg.seq_len), mesh.size, peak)
    return Run(cfg, mesh, spec, state, tokenizer, train_fn, eval_fn, lr_schedule, throughput, note)


def _num_slices(cfg: TrainConfig) -> int:
    import math
    return math.prod(mesh_lib.parse_mesh_spec(cfg.dcn_mesh).values()) if cfg.dcn_mesh else 1


def local_batch_size(cfg: TrainConfig) -> int:
    """Rows this process contributes to each global batch."""
    return cfg.global_batch_size // jax.process_count()


def data_shard_count(cfg: TrainConfig, ckpt=None) -> int:
    """The run's logical data shard count: the config's, else the one its checkpoints recorded, else one per
    process (see :mod:`jaxpt.data.shards`)."""
    if cfg.data.num_shards:
        return cfg.data.num_shards
    if ckpt is not None:
        step = ckpt.latest_step()
        if step is not None:
            saved = ckpt.read_meta(step).get("data_shards")
            if saved:
                return int(saved)
    return jax.process_count()


def train_batches(run: Run, num_shards: int):
    """This process's iterator of local batches: its block of logical data shards, rows concatenated.

    Raises:
      ConfigError: the process count does not divide the shard count, or the batch the shard count.
    """
    from jaxpt.data import loader
    from jaxpt.data.shards import ShardAssignmentError, ShardedBatches
    cfg = run.cfg
    P, p = jax.process_count(), jax.process_index()
    if num_shards % P:
        raise ConfigError(str(ShardAssignmentError(
            f"{P} processes cannot share {num_shards} data shards evenly (DataConfig.num_shards; a resumed run "
            f"keeps its checkpoint's shard count): use a process count that divides {num_shards}")))
    if cfg.global_batch_size % num_shards:
        raise ConfigError(f"TrainConfig.global_batch_size = {cfg.global_batch_size} is not divisible by the "
                          f"{num_shards} data shards")
    per_process = num_shards // P
    shard_ids = list(range(p * per_process, (p + 1) * per_process))  # contiguous: global row order is fixed

    def make(k: int, n: int):
        if cfg.data.source == "corpus":  # a corpus version built by data_pipelines.build
            from jaxpt.data.corpus import packed_corpus_dataset
            return iter(packed_corpus_dataset(
                cfg.data.corpus_dir, run.tokenizer, seq_len=cfg.seq_len,
                local_batch_size=cfg.global_batch_size // n, seed=cfg.seed, process_index=k, process_count=n,
                add_eos=cfg.data.add_eos))
        return iter(loader.make_train_dataset(
            cfg.data.train_path, run.tokenizer, seq_len=cfg.seq_len,
            local_batch_size=cfg.global_batch_size // n, seed=cfg.seed, process_index=k, process_count=n,
            shuffle=cfg.data.shuffle, add_eos=cfg.data.add_eos))

    return ShardedBatches(make, num_shards, shard_ids)


def to_device(run: Run, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows (``int32[local_batch, seq_len]`` per key) -> global arrays
    ``int32[global_batch, seq_len]`` sharded over (``data``, ``fsdp``), for the keys the steps take
    (``step.BATCH_KEYS``); see :func:`jaxpt.data.loader.to_global_batch`."""
    from jaxpt.data import loader
    sharding = mesh_lib.batch_sharding(run.mesh, run.cfg.logical_axis_rules)
    return loader.to_global_batch({k: local_batch[k] for k in step_lib.BATCH_KEYS}, sharding)


def evaluate(run: Run, max_batches: int | None = None) -> dict[str, float]:
    """Held-out cross-entropy (nats per target token) and perplexity over the held-out documents.

    Each process builds the same held-out stream and contributes its slice of rows to each global batch.
    ``max_batches`` (default ``TrainConfig.eval_batches``; 0 = all) bounds the work for in-loop evaluations.
    """
    from jaxpt.data import loader
    cfg = run.cfg
    if run.eval_dataset is None:
        run.eval_dataset = loader.make_eval_dataset(
            heldout_files(cfg), run.tokenizer, seq_len=cfg.seq_len, batch_size=local_batch_size(cfg),
            process_index=jax.process_index(), process_count=jax.process_count(), add_eos=cfg.data.add_eos)
    limit = cfg.eval_batches if max_batches is None else max_batches
    outs, pending = [], None
    for i, batch in enumerate(run.eval_dataset):
        if limit and i >= limit:
            break
        out = run.eval_step(run.state.params, to_device(run, batch))
        # At most two eval steps in flight: read batch i-1 while batch i runs. Unbounded asynchronous dispatch
        # of multi-process programs hung with gloo collectives (two CPU processes); so did eager jnp ops on
        # the global outputs, which is why the sums are taken on the host, in float64.
        if pending is not None:
            outs.append(jax.device_get(pending))
        pending = out
    if pending is not None:
        outs.append(jax.device_get(pending))
    loss_sum = float(np.sum([o["loss_sum"] for o in outs], dtype=np.float64))
    tokens = float(np.sum([o["num_target_tokens"] for o in outs], dtype=np.float64))
    loss = loss_sum / max(tokens, 1.0)
    out = {"heldout_loss": loss, "heldout_perplexity": float(np.exp(loss)), "heldout_tokens": tokens}
    out.update(inloop.heldout_figures(run, limit))  # per domain/language when HeldoutEvalConfig.enabled
    return out


def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress_bar or jax.process_index() != 0:
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


class Preemption:
    """Turns SIGTERM into a flag the loop checks between steps (finish the step, save, exit).

    On TPU, Orbax/JAX's preemption sync point (``multihost_utils.reached_preemption_sync_point``) is also
    consulted when the distributed runtime provides it, so every process stops at the same step.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            self.requested = True
            log.warning("signal %d received: will save after the current step and exit", signum)
        self._previous = signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            try:
                from jax.experimental import multihost_utils
                if multihost_utils.reached_preemption_sync_point(step):
                    return True
            except Exception:  # no preemption service (e.g. CPU/gloo): fall back to the signal flag
                pass
        return self.requested


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics are not yet read."""

    step: int
    metrics: Any
    data_wait: float
    doc_index: np.ndarray


class LoopContext:
    """What the loop carries besides the state: writers, checkpointer, stability monitor, run events."""

    def __init__(self, run: Run, writer: monitor.MetricWriter, batches: Iterator, ckpt=None,
                 meta: dict | None = None, preemption: "Preemption | None" = None, registry=None,
                 fault_injector=None):
        from jaxpt.stability import DivergenceMonitor
        self.run, self.writer, self.batches, self.ckpt, self.meta = run, writer, batches, ckpt, meta
        self.preemption, self.registry = preemption, registry
        # ``(step, state) -> state`` applied before dispatching ``step``: fault injection for drills and tests.
        self.fault_injector = fault_injector
        self.divergence = DivergenceMonitor(run.cfg.stability)
        self.timer = monitor.StepTimer()
        self.bar = _progress(run.cfg, int(jax.device_get(run.state.step)))
        self.last: dict[str, Any] = {}
        # Per-batch losses vary a lot on mixed-domain data; the final report also gives a windowed mean.
        self.recent_losses: collections.deque = collections.deque(maxlen=20)
        self.doc_log = _BatchDocumentLog(run.cfg) if run.cfg.log_batch_documents else None

    def event(self, record: dict[str, Any]) -> None:
        """Log an event to metrics.jsonl and the run registry."""
        self.writer.write(record)
        self.writer.flush()
        if self.registry is not None:
            self.registry.add_event(record)
        log.warning("event: %s", record)


def train_loop(ctx: LoopContext) -> dict[str, Any]:
    """Train from ``run.state.step`` up to ``cfg.steps``. Returns the last logged record.

    The loop dispatches step t, then reads the metrics of step t-1 (already finished or about to), so the
    host never blocks the device. The first step's time (compile) is excluded from throughput. After each
    step: skip events are logged; divergence triggers :func:`rollback`; checkpoints start when the save
    policy says so; on preemption the loop saves, waits for the commit and raises :class:`Preempted`.
    """
    run = ctx.run
    step = int(jax.device_get(run.state.step))
    pending: _Pending | None = None
    while step < run.cfg.steps:
        t0 = time.perf_counter()
        local = next(ctx.batches)
        batch = to_device(run, local)
        data_wait = time.perf_counter() - t0
        if ctx.doc_log is not None:
            ctx.doc_log.write(step + 1, local["doc_index"])
        if ctx.fault_injector is not None:
            run.state = ctx.fault_injector(step + 1, run.state)
        run.state, metrics = run.train_step(run.state, batch)
        step += 1
        trouble = _report(ctx, pending) if pending is not None else None
        pending = _Pending(step, metrics, data_wait, local["doc_index"])
        if trouble is not None:
            step = rollback(ctx, *trouble)
            pending = None  # the step dispatched from the bad state is discarded
            continue
        if ctx.ckpt is not None and ctx.ckpt.should_save(step):
            ctx.ckpt.save(step, run.state, ctx.batches, ctx.meta)
        if ctx.preemption is not None and ctx.preemption.should_stop(step):
            _report(ctx, pending)
            if ctx.ckpt is not None:
                ctx.ckpt.save(step, run.state, ctx.batches, ctx.meta, force=True)
                ctx.ckpt.wait()
            ctx.event({"step": step, "event": "preempted"})
            raise Preempted(step)
    if pending is not None:
        trouble = _report(ctx, pending)
        if trouble is not None:  # trouble on the very last step: roll back and finish the run
            rollback(ctx, *trouble)
            return train_loop(ctx)
    if ctx.bar is not None:
        ctx.bar.close()
    return ctx.last


def _report(ctx: LoopContext, p: _Pending) -> tuple[int, str] | None:
    """Read one step's metrics (blocks until that step is done), log skip events and every log_every
    steps a record. Returns ``(step, reason)`` when the run must roll back."""
    run, cfg = ctx.run, ctx.run.cfg
    values = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
    ctx.timer.tick()
    if ctx.bar is not None:
        ctx.bar.update(1)
        ctx.bar.set_postfix(loss=f"{values['loss']:.3f}")
    if values.get("skipped"):
        docs = sorted(int(d) for d in np.unique(p.doc_index) if d >= 0)
        ctx.event({"step": p.step, "event": "nonfinite_skip" if values.get("nonfinite") else "spike_skip",
                   "loss": values["loss"], "grad_norm": values["grad_norm"],
                   "loss_threshold": values.get("spike_loss_threshold"),
                   "grad_norm_threshold": values.get("spike_grad_norm_threshold"), "doc_index": docs})
    if not values.get("skipped"):
        ctx.recent_losses.append(values["loss"])
    reason = ctx.divergence.observe(p.step, values["loss"], bool(values.get("nonfinite")))
    if p.step % cfg.log_every == 0 or p.step == cfg.steps or p.step == 1 or reason:
        record = {"step": p.step, **values}
        step_time = ctx.timer.pop_mean()
        if step_time is not None:
            record.update(run.throughput.figures(step_time))
        record["data_wait_s"] = p.data_wait
        record["host_peak_rss_gib"] = monitor.host_peak_rss_bytes() / 2 ** 30
        if cfg.eval_every and p.step % cfg.eval_every == 0 and p.step != cfg.steps and not reason:
            record.update(evaluate(run))
        ctx.writer.write(record)
        ctx.last = record
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
    restored_step = 0
    if ctx.ckpt is not None:
        ctx.ckpt.wait()
        good = [s for s in ctx.ckpt.all_steps() if s < trouble_start]
        for s in ctx.ckpt.all_steps():
            if s >= trouble_start:
                ctx.ckpt.manager.delete(s)  # saved from a state already in trouble
        if good:
            restored_step = max(good)
            run.state, _ = ctx.ckpt.restore(restored_step, run.spec.abstract, data_iterator=None)
    if restored_step == 0:
        run.state = state_lib.init_state(run.spec, run.cfg.model, run.cfg.seed)
    run.state = run.state.replace(lr_scale=jnp.asarray(lr_scale, jnp.float32))
    ctx.event({"step": step, "event": "rollback", "reason": reason, "restored_step": restored_step,
               "lr_scale": lr_scale, "skipped_batches": [restored_step + 1, step + 1]})
    return restored_step


class _BatchDocumentLog:
    """Per-process JSON Lines of ``{"step", "doc_index"}``: which documents fed each step."""

    def __init__(self, cfg: TrainConfig):
        os.makedirs(os.path.join(cfg.workdir, "batches"), exist_ok=True)
        self._f = open(os.path.join(cfg.workdir, "batches", f"process_{jax.process_index()}.jsonl"), "a",
                       buffering=1)

    def write(self, step: int, doc_index: np.ndarray) -> None:
        docs = sorted(int(d) for d in np.unique(doc_index) if d >= 0)
        self._f.write(f'{{"step": {step}, "doc_index": {docs}}}\n')


class Preempted(Exception):
    """Raised by the loop after a preemption checkpoint committed; ``main`` exits with
    :data:`PREEMPTED_EXIT_CODE`."""


#: Exit status after a clean preemption (EX_TEMPFAIL: "try again later"); schedulers can requeue on it.
PREEMPTED_EXIT_CODE = 75


def write_operative_config(cfg: TrainConfig) -> str:
    """Write ``<workdir>/config.gin`` (process 0) and return its text."""
    text = config_lib.operative_config_str()
    if jax.process_index() == 0:
        os.makedirs(cfg.workdir, exist_ok=True)
        with open(os.path.join(cfg.workdir, "config.gin"), "w") as f:
            f.write(text)
    return text


def checkpoint_meta(run: Run, config_text: str, batches=None) -> dict[str, Any]:
    """What a checkpoint records besides arrays: enough to rebuild the run and to refuse a wrong one."""
    from jaxpt.checkpoint import library_versions
    cfg = run.cfg
    return {
        "config_gin": config_text,
        "model": dataclasses.asdict(cfg.model),
        "mesh": mesh_lib.mesh_shape(run.mesh),
        "model_layout": {"scan_layers": cfg.model.scan_layers},
        "tokenizer": {"path": os.path.abspath(cfg.data.tokenizer_path), "sha256": run.tokenizer.sha256},
        "data_version": data_version(cfg),
        "process_count": jax.process_count(),
        "data_shards": batches.num_shards if batches is not None else None,
        "global_batch_size": cfg.global_batch_size,
        "seq_len": cfg.seq_len,
        "libraries": library_versions(),
    }


def data_version(cfg: TrainConfig) -> str:
    """An identifier of the training data: the corpus manifest's version, or the prepared sample's hash."""
    d = cfg.data
    candidates = ([os.path.join(d.corpus_dir, "manifest.json")] if d.source == "corpus"
                  else [os.path.join(os.path.dirname(d.train_path), "prepare.json")])
    for path in candidates:
        if os.path.exists(path):
            import hashlib
            import json as _json
            with open(path, "rb") as f:
                raw = f.read()
            try:
                version = _json.loads(raw).get("data_version")
            except ValueError:
                version = None
            return version or f"sha256:{hashlib.sha256(raw).hexdigest()[:16]}"
    return "unknown"


def restore_or_init(run: Run, ckpt, batches) -> int:
    """Resume from the newest committed checkpoint if there is one; returns the step resumed at (0: fresh).

    Raises:
      CheckpointError: checkpoints exist but the newest cannot be restored, or it is from another model.
        Never silently starts from step 0 over existing checkpoints.
    """
    from jaxpt.checkpoint import CheckpointError, check_compatible
    step = ckpt.latest_step()
    if step is None:
        leftovers = [e.name for e in os.scandir(ckpt.directory)] if ckpt.has_checkpoint_dirs() else []
        real = [n for n in leftovers if "tmp" not in n]
        if real:
            raise CheckpointError(f"{ckpt.directory} holds {sorted(real)} but no restorable checkpoint; "
                                  "move it away to start from scratch")
        if leftovers:
            log.warning("only incomplete saves in %s (%s); starting from step 0", ckpt.directory, leftovers)
        return 0
    meta = ckpt.read_meta(step)
    check_compatible(meta, run.cfg.model, f"{ckpt.directory}/{step}")
    saved_tok = meta.get("tokenizer", {}).get("sha256")
    if saved_tok and saved_tok != run.tokenizer.sha256:
        raise CheckpointError(f"{ckpt.directory}/{step} was trained with tokenizer sha256 {saved_tok[:12]}, "
                              f"this run uses {run.tokenizer.sha256[:12]} ({run.cfg.data.tokenizer_path})")
    t0 = time.perf_counter()
    run.state, _ = ckpt.restore(step, run.spec.abstract, batches)
    log.info("restored step %d from %s in %.1f s", step, ckpt.directory, time.perf_counter() - t0)
    return step


def run_training(cfg: TrainConfig, fault_injector=None) -> dict[str, Any]:
    """Set up, resume if the workdir has checkpoints, and train to ``cfg.steps``; returns the final record.

    ``fault_injector`` (``(step, state) -> state``, applied before each step) is for drills and tests.
    """
    from jaxpt.checkpoint import Checkpointer
    config_text = write_operative_config(cfg)
    run = setup(cfg)
    is_main = jax.process_index() == 0
    frac = state_lib.replicated_param_fraction(run.spec)
    log.info("mesh %s over %d devices (%s); %.2fM params; %.2f%% of param bytes fully replicated",
             mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh)), run.mesh.size,
             jax.devices()[0].device_kind, state_lib.num_params(run.spec) / 1e6, 100 * frac)
    log.info("MFU peak: %s", run.peak_note)
    writer = monitor.MetricWriter(cfg.workdir, enabled=is_main)
    ckpt = Checkpointer(cfg.workdir, cfg.checkpoint) if cfg.checkpoint.enabled else None
    num_shards = data_shard_count(cfg, ckpt)
    batches = train_batches(run, num_shards)
    start = restore_or_init(run, ckpt, batches) if ckpt is not None else 0
    meta = checkpoint_meta(run, config_text, batches)
    writer.write({"step": start, "event": "resume" if start else "start",
                  "num_params": state_lib.num_params(run.spec), "replicated_param_fraction": frac,
                  "mesh": mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh)), "peak_flops_note": run.peak_note,
                  "peak_flops_per_device": run.throughput.peak})
    registry = RunRegistry(cfg.workdir, enabled=is_main)
    registry.start(cfg, config_text, run, data_version(cfg))
    try:
        with Preemption() as preemption:
            ctx = LoopContext(run, writer, batches, ckpt, meta, preemption, registry, fault_injector)
            last = train_loop(ctx)
        step = int(jax.device_get(run.state.step))
        if ckpt is not None:
            ckpt.save(step, run.state, batches, meta, force=True)
        final = {"step": step, "event": "final", **evaluate(run, max_batches=0),
                 "train_loss": last.get("loss"),
                 "train_loss_mean_last20": float(np.mean(ctx.recent_losses)) if ctx.recent_losses else None}
        writer.write(final)
        registry.finish("completed", final)
        log.info("step %d: train loss %s (mean of the last 20 steps %s), held-out loss %.4f "
                 "(perplexity %.1f over %d tokens)",
                 final["step"], "n/a" if final["train_loss"] is None else f"{final['train_loss']:.4f}",
                 "n/a" if final["train_loss_mean_last20"] is None else f"{final['train_loss_mean_last20']:.4f}",
                 final["heldout_loss"], final["heldout_perplexity"], final["heldout_tokens"])
        return final
    except Preempted:
        registry.finish("preempted", {})
        raise
    except Exception as e:
        registry.finish("failed", {"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        writer.close()


def main(argv: list[str] | None = None) -> int:
    from jaxpt.checkpoint import CheckpointError
    from jaxpt.stability import DivergenceError
    parser = argparse.ArgumentParser(prog="python -m jaxpt.train", description=__doc__.splitlines()[0])
    config_lib.add_arguments(parser)
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_lib.from_args(args)  # parse first: a config error needs no cluster
        distributed.initialize(args)
        logging.basicConfig(level=logging.WARNING, force=True,
                            format=f"[%(asctime)s p{jax.process_index()}] %(name)s: %(message)s")
        logging.getLogger("jaxpt").setLevel(logging.INFO)
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
