"""Spike diagnosis: was a skipped spike the batch's fault or the optimizer state's?

``python -m jaxpt.tools.runs diagnose WORKDIR --step N`` restores the newest checkpoint before step ``N`` (its
params, optimizer state and data-iterator position), replays the steps from there to ``N - 1`` on the same
batches, and runs step ``N``'s batch on the replayed state. Training is deterministic, so the replayed state
is the one the run had, up to a fault that left no trace in the checkpoint (a flipped bit, a corrupted
update):

* the spike **reproduces** with the same batch on the same state: **bad batch** (the seed material's
  "telling them apart takes a controlled comparison": the batch alone brings it back);
* it does **not** reproduce: **optimizer state**, the state the run had at ``N - 1`` differed from the one
  the checkpoint and the batches give (the cause was in the state, not in the data).

As the control, step ``N``'s batch and ``--refs`` following batches are also run on the replayed state and on
the checkpoint's older state, each without keeping the update: the report gives the z-score of batch ``N``'s
loss and its grad norm against the other batches on each state (a bad batch stands out on both). The batch's
documents are listed by ``doc_index`` with their ``id`` and ``source`` when the training data is a document
file (:func:`jaxpt.data.documents.read_documents`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jaxpt import config as config_lib
from jaxpt.checkpoint import Checkpointer
from jaxpt.data import documents, stream
from jaxpt.run import monitor, session
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError


class RandomTokens:
    """A batch injector for drills and tests (``(step, local_batch) -> local_batch``): at step ``step``, the
    batch's tokens become uniform random ids from the upper half ``[vocab_size // 2, vocab_size)`` of the
    vocabulary (a SentencePiece vocabulary orders pieces by frequency, so these are rare pieces; seeded by
    ``seed``, the same each call), an obviously bad batch; other steps pass through. Padding, segment ids,
    positions and ``doc_index`` are kept."""

    def __init__(self, step: int, vocab_size: int, seed: int = 0):
        self.step, self.vocab_size, self.seed = step, vocab_size, seed

    def __call__(self, step: int, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if step != self.step:
            return local
        rng = np.random.default_rng(self.seed)
        tokens = rng.integers(self.vocab_size // 2, self.vocab_size, local["tokens"].shape,
                              dtype=local["tokens"].dtype)
        return {**local, "tokens": np.where(local["segment_ids"] > 0, tokens, local["tokens"])}


@dataclasses.dataclass
class Diagnosis:
    """What :func:`diagnose` found. Losses in nats per target token; ``*_z``: (loss - mean) / std of the
    reference batches' losses on the same state; ``*_gn_ratio``: grad norm / median reference grad norm."""

    step: int
    checkpoint_step: int
    logged: dict[str, Any]
    replay: dict[str, float]
    reproduces: bool
    verdict: str
    on_replayed_state_z: float
    on_replayed_state_gn_ratio: float
    on_checkpoint_state_z: float
    on_checkpoint_state_gn_ratio: float
    documents: list[dict[str, Any]]

    def text(self) -> str:
        """The diagnosis as a few lines of text."""
        lg = self.logged
        lines = [f"step {self.step}: logged {lg.get('event', 'no skip event')} (loss {_f(lg.get('loss'))}, grad norm "
                 f"{_f(lg.get('grad_norm'))}, thresholds {_f(lg.get('loss_threshold'))} / "
                 f"{_f(lg.get('grad_norm_threshold'))})",
                 f"replayed from checkpoint {self.checkpoint_step}: loss {_f(self.replay['loss'])}, grad norm "
                 f"{_f(self.replay['grad_norm'])}, skipped {bool(self.replay['skipped'])} -> the spike "
                 f"{'reproduces' if self.reproduces else 'does not reproduce'} with the same batch",
                 f"control, batch {self.step} against the following batches: on the replayed state loss z = "
                 f"{self.on_replayed_state_z:+.1f}, grad norm {self.on_replayed_state_gn_ratio:.2f}x; on the "
                 f"checkpoint's state loss z = {self.on_checkpoint_state_z:+.1f}, grad norm "
                 f"{self.on_checkpoint_state_gn_ratio:.2f}x",
                 f"verdict: {self.verdict}",
                 f"documents of the batch ({len(self.documents)}):"]
        lines += [f"  doc_index {d['doc_index']}" + "".join(f", {k} {d[k]!r}" for k in ("id", "source") if k in d)
                  for d in self.documents[:50]]
        if len(self.documents) > 50:
            lines.append(f"  ... {len(self.documents) - 50} more")
        return "\n".join(lines)


def _f(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else "-"


def _logged_event(workdir: str, step: int) -> dict[str, Any]:
    events = [r for r in monitor.read_metrics(workdir) if r["step"] == step
              and r.get("event") in ("spike_skip", "nonfinite_skip")]
    return events[-1] if events else {}


def document_info(cfg, doc_indices: list[int]) -> list[dict[str, Any]]:
    """``[{"doc_index", "id", "source"}, ...]``: the ``id`` and ``source`` of each document when the training
    data is one document file (its ``doc_index`` is the line index); ``doc_index`` alone otherwise."""
    path = cfg.data.train_path
    if cfg.data.source == "jsonl" and path and documents.expand(path):
        docs = documents.read_documents(path)
        return [{"doc_index": i, "id": docs[i].get("id", ""), "source": docs[i].get("source", "")}
                if 0 <= i < len(docs) else {"doc_index": i} for i in doc_indices]
    return [{"doc_index": i} for i in doc_indices]


def _zscore(x: float, refs: list[float]) -> float:
    mean, std = float(np.mean(refs)), float(np.std(refs))
    return (x - mean) / max(std, 1e-3 * abs(mean), 1e-12)


def _setup_before(workdir: str, step: int):
    """The run of ``workdir`` set up from its operative config, its read-only checkpointer, and the newest
    committed checkpoint step before ``step``: ``(cfg, run, ckpt, checkpoint_step)``.

    Raises:
      ConfigError: no config.gin, or no committed checkpoint before ``step``.
    """
    gin_path = fs.join(workdir, "config.gin")
    if not fs.isfile(gin_path):
        raise ConfigError(f"{gin_path}: no operative config; is {workdir} a training workdir?")
    cfg = config_lib.parse([gin_path], ["TrainConfig.progress_bar = False"])
    run = session.setup(cfg)
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    before = [s for s in ckpt.all_steps() if s < step]
    if not before:
        raise ConfigError(f"no committed checkpoint before step {step} in {workdir}/checkpoints "
                          f"(has {ckpt.all_steps()})")
    return cfg, run, ckpt, max(before)


def diagnose(workdir: str, step: int, refs: int = 4,
             batch_injector: Callable[[int, dict], dict] | None = None) -> Diagnosis:
    """Replay step ``step`` of the run in ``workdir`` from the newest checkpoint before it (module docstring).

    Args:
      workdir: the run's directory (its ``config.gin``, checkpoints and metrics).
      step: the (1-based) step whose spike to diagnose.
      refs: reference batches after ``step`` for the control (>= 2).
      batch_injector: the ``(step, local_batch) -> local_batch`` the run was trained with, if any (drills).

    Raises:
      ConfigError: no config.gin, or no committed checkpoint before ``step``.
      CheckpointError: the checkpoint cannot be restored.
    """
    import jax
    import jax.numpy as jnp
    if refs < 2:
        raise ConfigError(f"refs = {refs}: need at least 2 reference batches")
    cfg, run, ckpt, c = _setup_before(workdir, step)
    meta = ckpt.read_meta(c)
    batches = stream.train_batches(cfg, run.tokenizer, stream.data_shard_count(cfg, meta.get("data_shards")),
                                   first_step=config_lib.start_step(cfg) + 1)
    state = ckpt.restore(c, run.spec.abstract, batches, meta=meta)
    inject = batch_injector or (lambda s, b: b)
    local = {s: inject(s, stream.next_batch(batches, run.built.ramp.units(s))) for s in range(c + 1, step + refs + 1)}
    on_device = {s: stream.to_device(run.mesh, cfg.logical_axis_rules, b) for s, b in local.items()}
    # The train step donates its state: copies keep a state for the next batch. Every program is waited for
    # before the next is dispatched: with several sharded programs in flight, XLA's CPU collectives can wait on
    # each other (a rendezvous that never completes).
    copy = lambda st: jax.block_until_ready(jax.tree.map(jnp.copy, st))  # noqa: E731

    def metrics_on(st, s) -> dict[str, float]:
        _, m = run.built.train_step_for(s)(copy(st), on_device[s])
        return {k: float(v) for k, v in jax.device_get(m).items()}

    at_checkpoint = copy(state)
    for s in range(c + 1, step):
        state, _ = jax.block_until_ready(run.built.train_step_for(s)(state, on_device[s]))
    replay = metrics_on(state, step)
    controls = {}
    for name, st in (("replayed", state), ("checkpoint", at_checkpoint)):
        spike, others = metrics_on(st, step), [metrics_on(st, s) for s in range(step + 1, step + refs + 1)]
        controls[name] = (_zscore(spike["loss"], [o["loss"] for o in others]),
                          spike["grad_norm"] / float(np.median([o["grad_norm"] for o in others])))
    reproduces = bool(replay["skipped"]) or not math.isfinite(replay["loss"])
    verdict = ("bad batch: the spike reproduces with the same batch on the same state" if reproduces else
               "optimizer state: the same batch on the replayed state does not spike; the state the run had "
               "differed from the one the checkpoint and the batches give")
    docs = sorted(int(d) for d in np.unique(local[step]["doc_index"]) if d >= 0)
    return Diagnosis(step, c, _logged_event(workdir, step), replay, reproduces, verdict,
                     *controls["replayed"], *controls["checkpoint"], document_info(cfg, docs))
