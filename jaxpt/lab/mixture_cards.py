"""Eval-card tasks in a mixture experiment's target (:mod:`jaxpt.lab.mixtures`): which scores a task reports, the
checks before anything trains, and the scoring of a finished run from the checkpoint of its final step.

A target names a card task's score as ``card/<task>/<score>`` (:data:`CARD`); higher is better, so it enters the
target's weighted mean as its error ``1 - score`` (:meth:`jaxpt.lab.mixtures.Target.value`). A run is scored as
``python -m jaxpt.tools.evaluate --no-seqio`` scores it (the same examples, batch sizes and metric functions) and
its scores are recorded with its metrics in the conclusions database, the run linked to the card
(``<name>@v<version>``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from jaxpt import config as config_lib
from jaxpt.checkpoint import CheckpointConfig, CheckpointError, Checkpointer
from jaxpt.config import ConfigError
from jaxpt.eval import card as card_lib, heldout as heldout_lib, tasks as tasks_lib
from jaxpt.eval.scorer import scorer_for_restored
from jaxpt.infer.restore import restore as restore_checkpoint
from jaxpt.util import fs

log = logging.getLogger("jaxpt.tools.mixtures")

#: The metric prefix of an eval-card task's score (``card/<task>/<score>``, :func:`card_scores`).
CARD = "card/"


def card_scores(spec) -> tuple[str, ...]:
    """The scores (in [0, 1], higher is better) a card task reports (:func:`jaxpt.eval.tasks.score_tasks`):
    ``accuracy`` and ``accuracy_norm`` for a choice task (cloze, next_line, langid), ``exact_match`` for a generate
    task (next_line_greedy). Its ``num_examples`` is a count, not a score a target may name."""
    return ("accuracy", "accuracy_norm") if spec.is_choice else ("exact_match",)



#: Probe tasks built in this process, by card content, task names and sources: building them decontaminates the
#: examples against every training text, which on a real corpus is the expensive part, so it is done once.
_PROBE_TASKS: dict[tuple, dict[str, Any]] = {}


@dataclasses.dataclass
class CardEvaluation:
    """How the runs of an experiment are scored on a card target's tasks: ``card`` (reduced to those tasks,
    :meth:`Target.card`), the held-out and training sources its examples come from (the card's ``sources``, else
    the experiment's data, as ``python -m jaxpt.tools.evaluate`` chooses them), and the held-out documents."""

    card: card_lib.Card
    heldout: str
    train: str
    docs: list

    @property
    def ident(self) -> str:
        """The card's id in the conclusions database (``<name>@v<version>``)."""
        return f"{self.card.name}@v{self.card.version}"

    @property
    def metrics(self) -> list[str]:
        """Every score of every task (recorded together: a refit naming another score of a task scores nothing)."""
        return [f"{CARD}{s.name}/{m}" for s in self.card.tasks for m in card_scores(s)]

    def tasks(self) -> dict[str, Any]:
        """The tasks' examples (:func:`jaxpt.eval.tasks.build_probe_tasks`), built once per process."""
        key = (self.card.content_sha256, tuple(s.name for s in self.card.tasks), fs.absolute(self.heldout),
               fs.absolute(self.train))
        if key not in _PROBE_TASKS:
            log.info("card %s: building the examples of %s (decontaminated against %s)", self.ident,
                     [s.name for s in self.card.tasks], self.train)
            _PROBE_TASKS[key] = tasks_lib.build_probe_tasks(self.card, self.docs,
                                                               heldout_lib.training_texts(self.train))
        return _PROBE_TASKS[key]


def card_evaluation(target: Any, path: str, base: config_lib.TrainConfig) -> CardEvaluation | None:
    """The scoring of ``target``'s card metrics (a :class:`jaxpt.lab.mixtures.Target`; None when it names none),
    checked before anything trains: the names (:meth:`Target.card`), that every task's domain is in the held-out data
    its examples come from, and that a generate task's ``decoding.max_new_tokens`` fits the runs' context. ``path``:
    the target's file, for messages.

    Raises:
      ConfigError: as :meth:`Target.card`; a task whose domain the held-out data lacks, or a generation longer than
        ``TrainConfig.seq_len`` allows (naming the file, the card and the task).
    """
    card = target.card(path)
    if card is None:
        return None
    run_heldout, run_train = heldout_lib.run_sources(base.data)
    heldout, train = card.heldout_source or run_heldout, card.train_source or run_train
    docs = heldout_lib.load_documents(heldout, "heldout")
    have = sorted({d.domain for d in docs})
    for spec in card.tasks:
        if spec.domain not in have:
            raise ConfigError(f"{path}: metrics name task {spec.name!r} of card {card.name} v{card.version} "
                              f"({target.eval_card}), whose examples come from held-out documents of domain "
                              f"{spec.domain!r}; the experiment's held-out data ({heldout}) has domains {have}")
    try:
        card_lib.check_generation_fits(card, base.seq_len, tasks=any(not s.is_choice for s in card.tasks),
                                       spot_check=False)
    except card_lib.CardError as e:
        raise ConfigError(f"{path}: eval_card: {e}") from None
    return CardEvaluation(card, heldout, train, docs)


def _check_final_checkpoint(run: dict[str, Any]) -> None:
    """Raises ConfigError naming the run and its workdir when the checkpoint of its final step is gone."""
    step = int(run["metrics"].get("step", -1))
    try:
        ckpt = Checkpointer(run["workdir"], CheckpointConfig(enabled=False), read_only=True)
        try:
            ckpt.committed_step(step)
        finally:
            ckpt.close()
    except CheckpointError as e:
        raise ConfigError(f"run {run['id']} ({run['workdir']}): no checkpoint of its final step {step} to score the "
                          f"target's card tasks on ({e}); runs already in the database are not trained again, so "
                          "start a new experiment (another MixtureExperiment.name: a card target saves the checkpoints "
                          "of the runs it trains), or use a target without card metrics") from None


def card_pending(ev: CardEvaluation | None, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded ``runs`` that lack one of ``ev``'s card metrics (none when ``ev`` is None), checked before any
    is scored or anything trains.

    Raises:
      ConfigError: a run linked to another eval card in the database (its card metrics are that card's), or one
        whose final checkpoint is gone (naming the run and its workdir).
    """
    pending = []
    for run in runs if ev is not None else ():
        if run.get("eval_card") not in (None, ev.ident):
            raise ConfigError(f"run {run['id']} ({run['workdir']}) was scored on eval card {run['eval_card']}, the "
                              f"target's card is {ev.ident}: a run's card metrics are one card's; name that card, or "
                              "start a new experiment")
        if any(m not in run["metrics"] for m in ev.metrics):
            _check_final_checkpoint(run)
            pending.append(run)
    return pending


def score_card(ev: CardEvaluation, run: dict[str, Any]) -> dict[str, float]:
    """``{card/<task>/<score>: value}`` of a recorded run, from the checkpoint of its final step: the card's tasks
    scored as :func:`jaxpt.tools.evaluate.run_card` scores them (same examples, batch sizes and metric functions),
    without seqio (the same rows and metrics, without TensorFlow), perplexity, spot check or safety.

    Raises:
      ConfigError: the checkpoint cannot be restored (naming the run and its workdir).
    """
    step = int(run["metrics"]["step"])
    try:
        restored = restore_checkpoint(run["workdir"], step=step)
    except CheckpointError as e:
        raise ConfigError(f"run {run['id']} ({run['workdir']}): cannot restore its final step {step}: {e}") from None
    tasks = ev.tasks()
    scorer = scorer_for_restored(restored, batch_size=ev.card.batch_size)
    generator = (scorer.decode_step(batch_size=int(ev.card.decoding.get("batch_size", 64)))
                 if any(not s.is_choice for s in ev.card.tasks) else None)
    metrics = tasks_lib.score_tasks(ev.card, tasks, scorer, generator, restored, use_seqio=False)
    return {f"{CARD}{n}/{m}": float(v) for n, ms in metrics.items() for m, v in ms.items()
            if m in card_scores(tasks[n].spec)}


def record_card_metrics(db, ev: CardEvaluation | None, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Score each of ``runs`` that lacks a card metric (:func:`card_pending`, :func:`score_card`) and record the
    scores with its metrics, the run linked to the card (its ``name@v<version>`` id in the eval_cards table).
    Returns the runs' rows as the database has them now (``runs`` itself when ``ev`` is None: nothing is written).

    Raises:
      ConfigError: as :func:`card_pending` and :func:`score_card`.
    """
    pending = card_pending(ev, runs)
    if not pending:
        return list(runs)
    card_id = db.add_eval_card(ev.card.name, ev.card.version, ev.card.content_sha256)
    for i, run in enumerate(pending):
        log.info("[%d/%d] card %s: scoring run %s (%s)", i + 1, len(pending), card_id, run["id"], run["workdir"])
        scores = score_card(ev, run)
        db.link_eval_card(run["id"], card_id)
        db.add_metrics(run["id"], {k: v for k, v in scores.items() if k not in run["metrics"]})
    return [db.resolve(r["id"])[1] for r in runs]
