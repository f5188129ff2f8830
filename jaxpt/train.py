"""``python -m jaxpt.train``: build the config, mesh, state and data, then run the train loop.

Reads top to bottom: :func:`main` parses flags; :func:`setup` wires config -> mesh -> state -> steps -> data;
:func:`train_loop` dispatches step t and only then reads the metrics of step t-1, so the host never waits
on the device; :func:`evaluate` reports the held-out loss with the same mesh and one compiled step.
"""

from __future__ import annotations

import argparse
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
from jaxpt import flops as flops_lib
from jaxpt import mesh as mesh_lib
from jaxpt import monitor
from jaxpt import optim
from jaxpt import state as state_lib
from jaxpt import step as step_lib
from jaxpt.config import ConfigError, TrainConfig

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
    from jaxpt.data.tokenizer import Tokenizer
    path = cfg.data.tokenizer_path
    if not os.path.exists(path):
        raise ConfigError(f"DataConfig.tokenizer_path = {path!r}: no such file "
                          "(run `python -m jaxpt.data.prepare --output artifacts/sample` first)")
    return Tokenizer.load(path)


def setup(cfg: TrainConfig) -> Run:
    """Validate, build the mesh, create the sharded state and compile-ready steps."""
    sizes = config_lib.validate(cfg, jax.device_count())
    tokenizer = load_tokenizer(cfg)
    cfg = resolve_model_config(cfg, tokenizer)
    mesh = mesh_lib.make_mesh(sizes)
    rules = cfg.logical_axis_rules
    lr_schedule = optim.learning_rate_schedule(cfg.optimizer, cfg.steps)
    spec = state_lib.make_state_spec(
        cfg.model, lambda p: optim.make_optimizer(cfg.optimizer, cfg.steps, p), mesh, rules)
    state = state_lib.init_state(spec, cfg.model, cfg.seed)
    train_fn = step_lib.jit_train_step(spec, mesh, rules, z_loss_weight=cfg.z_loss_weight,
                                       lr_schedule=lr_schedule)
    eval_fn = step_lib.jit_eval_step(spec, mesh, rules)
    peak, note = flops_lib.peak_flops_per_device(dtype=cfg.model.jnp_compute_dtype)
    throughput = monitor.Throughput(cfg.global_batch_size * cfg.seq_len,
                                    flops_lib.flops_per_token(cfg.model, cfg.seq_len), mesh.size, peak)
    return Run(cfg, mesh, spec, state, tokenizer, train_fn, eval_fn, lr_schedule, throughput, note)


def local_batch_size(cfg: TrainConfig) -> int:
    """Rows this process contributes to each global batch."""
    return cfg.global_batch_size // jax.process_count()


def train_batches(run: Run, start_step: int = 0):
    """This process's Grain iterator of local batches (packed rows), already advanced to ``start_step``."""
    from jaxpt.data import pipeline
    cfg = run.cfg
    ds = pipeline.make_train_dataset(
        cfg.data.train_path, run.tokenizer, seq_len=cfg.seq_len, local_batch_size=local_batch_size(cfg),
        seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count(),
        shuffle=cfg.data.shuffle, add_eos=cfg.data.add_eos)
    return iter(ds)


def to_device(run: Run, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    from jaxpt.data import pipeline
    sharding = mesh_lib.batch_sharding(run.mesh, run.cfg.logical_axis_rules)
    return pipeline.to_global_batch({k: local_batch[k] for k in step_lib.BATCH_KEYS}, sharding)


def evaluate(run: Run, max_batches: int | None = None) -> dict[str, float]:
    """Held-out cross-entropy (nats per target token) and perplexity over the held-out documents.

    Each process builds the same held-out stream and contributes its slice of rows to each global batch.
    ``max_batches`` (default ``TrainConfig.eval_batches``; 0 = all) bounds the work for in-loop evaluations.
    """
    from jaxpt.data import pipeline
    cfg = run.cfg
    ds = pipeline.make_eval_dataset(cfg.data.heldout_path, run.tokenizer, seq_len=cfg.seq_len,
                                    batch_size=local_batch_size(cfg), process_index=jax.process_index(),
                                    process_count=jax.process_count(), add_eos=cfg.data.add_eos)
    limit = cfg.eval_batches if max_batches is None else max_batches
    loss_sum = tokens = 0.0
    for i, batch in enumerate(ds):
        if limit and i >= limit:
            break
        out = jax.device_get(run.eval_step(run.state.params, to_device(run, batch)))
        loss_sum += float(out["loss_sum"])
        tokens += float(out["num_target_tokens"])
    loss = loss_sum / max(tokens, 1.0)
    return {"heldout_loss": loss, "heldout_perplexity": float(np.exp(loss)), "heldout_tokens": tokens}


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


def train_loop(run: Run, writer: monitor.MetricWriter, batches: Iterator, ckpt: "Checkpointer | None" = None,
               meta: dict | None = None, preemption: Preemption | None = None) -> dict[str, Any]:
    """Train from ``run.state.step`` up to ``cfg.steps``. Returns the last logged record.

    The loop dispatches step t, then fetches the metrics of step t-1 (already finished or about to), so
    the host never blocks the device. The first step's time (compile) is excluded from throughput.
    Checkpoints are started after a step when the save policy says so; on preemption the loop saves,
    waits for the save to commit and raises :class:`Preempted`.
    """
    cfg = run.cfg
    step = int(jax.device_get(run.state.step))
    timer, bar, pending, last = monitor.StepTimer(), _progress(cfg, step), None, {}
    doc_log = _BatchDocumentLog(cfg) if cfg.log_batch_documents else None
    while step < cfg.steps:
        t0 = time.perf_counter()
        local = next(batches)
        batch = to_device(run, local)
        data_wait = time.perf_counter() - t0
        if doc_log is not None:
            doc_log.write(step + 1, local["doc_index"])
        run.state, metrics = run.train_step(run.state, batch)
        step += 1
        if pending is not None:
            last = _report(run, writer, bar, timer, *pending) or last
        pending = (step, metrics, data_wait)
        if ckpt is not None and ckpt.should_save(step):
            ckpt.save(step, run.state, batches, meta)
        if preemption is not None and preemption.should_stop(step):
            last = _report(run, writer, bar, timer, *pending) or last
            if ckpt is not None:
                ckpt.save(step, run.state, batches, meta, force=True)
                ckpt.wait()
            writer.write({"step": step, "event": "preempted"})
            writer.flush()
            raise Preempted(step)
    if pending is not None:
        last = _report(run, writer, bar, timer, *pending) or last
    if bar is not None:
        bar.close()
    return last


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


def _report(run: Run, writer, bar, timer: monitor.StepTimer, step: int, metrics, data_wait: float):
    """Fetch one step's metrics (blocks until that step is done), time it, and log every log_every steps."""
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    timer.tick()
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{values['loss']:.3f}")
    cfg = run.cfg
    if step % cfg.log_every and step != cfg.steps and step != 1:
        return None
    record = {"step": step, **values}
    step_time = timer.pop_mean()
    if step_time is not None:
        record.update(run.throughput.figures(step_time))
    record["data_wait_s"] = data_wait
    record["host_peak_rss_gib"] = monitor.host_peak_rss_bytes() / 2 ** 30
    if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
        record.update(evaluate(run))
    writer.write(record)
    return record


def write_operative_config(cfg: TrainConfig) -> str:
    """Write ``<workdir>/config.gin`` (process 0) and return its text."""
    text = config_lib.operative_config_str()
    if jax.process_index() == 0:
        os.makedirs(cfg.workdir, exist_ok=True)
        with open(os.path.join(cfg.workdir, "config.gin"), "w") as f:
            f.write(text)
    return text


def checkpoint_meta(run: Run, config_text: str) -> dict[str, Any]:
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


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Set up, resume if the workdir has checkpoints, and train to ``cfg.steps``; returns the final record."""
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
    batches = train_batches(run)
    start = restore_or_init(run, ckpt, batches) if ckpt is not None else 0
    meta = checkpoint_meta(run, config_text)
    writer.write({"step": start, "event": "resume" if start else "start",
                  "num_params": state_lib.num_params(run.spec), "replicated_param_fraction": frac,
                  "mesh": mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh)), "peak_flops_note": run.peak_note,
                  "peak_flops_per_device": run.throughput.peak})
    try:
        with Preemption() as preemption:
            last = train_loop(run, writer, batches, ckpt, meta, preemption)
        step = int(jax.device_get(run.state.step))
        if ckpt is not None:
            ckpt.save(step, run.state, batches, meta, force=True)
        final = {"step": step, "event": "final", **evaluate(run, max_batches=0),
                 "train_loss": last.get("loss")}
        writer.write(final)
        log.info("step %d: train loss %s, held-out loss %.4f (perplexity %.1f over %d tokens)",
                 final["step"], "n/a" if final["train_loss"] is None else f"{final['train_loss']:.4f}",
                 final["heldout_loss"], final["heldout_perplexity"], final["heldout_tokens"])
        return final
    finally:
        if ckpt is not None:
            ckpt.close()
        writer.close()


def main(argv: list[str] | None = None) -> int:
    from jaxpt.checkpoint import CheckpointError
    parser = argparse.ArgumentParser(prog="python -m jaxpt.train", description=__doc__.splitlines()[0])
    config_lib.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s p{jax.process_index()}] %(message)s")
    try:
        cfg = config_lib.from_args(args)
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
    except Preempted as e:
        print(f"preempted at step {e.args[0]}: checkpoint committed; rerun the same command to resume",
              file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
