"""A mixture experiment by proxy runs, from a corpus to a proposed mixture; its command line is
``python -m jaxpt.tools.mixtures``.

    python -m jaxpt.tools.mixtures run --experiment configs/mixtures/sample.gin       # proxies, fit, proposal
    python -m jaxpt.tools.mixtures fit --experiment configs/mixtures/sample.gin       # refit from the database
    python -m jaxpt.tools.mixtures validate --experiment configs/mixtures/sample.gin  # at a larger scale
    python -m jaxpt.train --config configs/quickstart.gin --config runs/mixtures/sample-balanced/proposal.gin

The experiment file is a gin file: a base training config (the usual bindings; the data must carry a ``domain`` per
document) and a :class:`MixtureExperiment`. ``run``:

1. counts each domain's training tokens (the natural mixture, and what each domain has for the availability limit);
2. samples ``proxies`` mixtures (:func:`jaxpt.lab.mixture_search.sample_mixtures`: natural, uniform, Dirichlet
   draws) and trains one proxy run per mixture, one after another, each an ordinary
   :func:`jaxpt.run.session.run_training` run in ``<output>/<name>/proxy-<i>`` (token-true
   ``DataConfig.mixture_weights``, the same seed and data order for all, the proxy model and token budget of the
   experiment, per-domain held-out losses), and records it in the conclusions database
   (:mod:`jaxpt.lab.conclusions`) with the run registry's id, its mixture, FLOPs and metrics. A line per proxy says
   which, its mixture, how far the experiment is and its ETA. Proxies already in the database are not trained
   again, and a proxy killed mid-run resumes from its own checkpoint, so a crashed experiment continues where it
   stopped;
3. computes each proxy's target (the weighted mean of the metrics the target file names), fits the regression
   (:func:`jaxpt.lab.mixture_search.fit_model`), measures its leave-one-out Spearman correlation, and proposes
   the best mixture under the floors, caps and availability limit;
4. writes ``fit.json``, ``predicted_vs_actual.png`` and ``proposal.gin`` (a one-stage
   ``DataConfig.mixture_schedule`` the trainer runs directly, headed by the experiment's id) under
   ``<output>/<name>``, and a ``proposed`` conclusion in the database whose evidence is the proxy runs.

``fit`` repeats steps 3-4 from the database alone (no training). ``validate`` trains the proposed, natural and
uniform mixtures at the validation scale (``validation_model``, ``validation_tokens``; at least 4x a proxy's FLOPs is
the point), one run per ``validation_seeds`` entry, reports each mixture's target with its seed spread, and marks the
conclusion ``confirmed`` when the proposal beats both others by more than the largest seed spread, else
``refuted``.

The target file (JSON): ``{"name": "code+web", "metrics": {"heldout/domain/code/loss": 1, ...}}``: a positive weight
per metric of a proxy's final record (held-out losses per domain: ``heldout/domain/<domain>/loss``); the target is
their weighted mean, lower is better.

A target may also weigh eval-card tasks (:mod:`jaxpt.eval.card`): ``"eval_card": "configs/eval/card_v1.yaml"`` (a
path relative to the working directory, like the target's own) and metrics ``card/<task>/<score>``, a task of that
card and a score it reports (``accuracy`` or ``accuracy_norm`` for a choice task, ``exact_match`` for
``next_line_greedy``). A score is higher-is-better in [0, 1]: it enters the weighted mean as its error
``1 - score``, so the target stays lower-is-better. Such a target is checked before anything trains (the card
loads and is stamped, names the task and score, and the task's domain is in the held-out data); the runs it trains
save checkpoints, and each proxy (and validation run) is scored on those tasks from its final checkpoint after
training (the tasks' examples are built once per process; no perplexity, spot check or safety; scored without
seqio, the same rows and metric functions), the scores recorded with its metrics in the database under
``card/<task>/<score>``, the run linked to the card (``<name>@v<version>``). A ``fit`` for a card target over
proxies trained without one scores them from their final checkpoints first; a proxy whose checkpoint is gone is
refused by name and workdir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from typing import Any, Sequence

import numpy as np

from jaxpt import config as config_lib
from jaxpt.config import ConfigError
from jaxpt.data import boundary, corpus, loader, stream
from jaxpt.eval import card as card_lib
from jaxpt.lab import conclusions, mixture_search as search
from jaxpt.lab.mixture_cards import (CARD, CardEvaluation, card_evaluation, card_pending, card_scores,
                                     record_card_metrics)
from jaxpt.model.config import ModelConfig
from jaxpt.run import resolve as resolve_lib, session
from jaxpt.util import fs, jsonl
from jaxpt.util.progress import format_duration

#: Named after the program, as its progress lines print (``jaxpt.tools.mixtures: [5/16] proxy-004: ...``).
log = logging.getLogger("jaxpt.tools.mixtures")

#: The database's role of a proxy run, and the prefix of a validation run's role (``validation:<label>``).
PROXY_ROLE = "proxy"
VALIDATION_ROLE = "validation"
#: The fewest proxies: the leave-one-out check fits on all runs but one, and a fit needs 3.
MIN_PROXIES = 4
#: Final-record metrics a target may name besides the per-domain ones (``heldout/domain/<domain>/loss|perplexity``).
RUN_METRICS = ("heldout_loss", "heldout_perplexity", "train_loss", "train_loss_mean_last20")
#: The metric prefix of a proxy's realized token share of a domain (:func:`realized_shares`).
REALIZED = "mixture/realized/"
#: The keys of a target file (a misspelled one is refused, never ignored).
TARGET_KEYS = ("name", "metrics", "eval_card")
#: Below this leave-one-out Spearman the fit is reported as not ranking unseen mixtures (published proxy fits reach
#: 0.89 and above; Liu et al. 2024, RegMix): its proposal is printed with a warning.
TRUSTED_SPEARMAN = 0.8
#: Settings that change the proposal or the validation but not the proxies: an experiment may be refit with others.
PROPOSAL_ONLY = ("database", "target", "floors", "caps", "target_tokens", "max_epochs", "validation_model",
                 "validation_tokens", "validation_seeds")
#: The mixtures a validation compares.
VALIDATION_LABELS = ("proposed", "natural", "uniform")


@dataclasses.dataclass(frozen=True)
class MixtureExperiment:
    """A mixture experiment (gin configurable ``MixtureExperiment``; module docstring).

    Attributes:
      name: the experiment's id in the conclusions database and its directory under ``output``.
      output: the root of the experiment directories.
      target: the target file (JSON, module docstring).
      proxies: proxy runs (natural, uniform, then sampled mixtures): at least :data:`MIN_PROXIES` and 2 more than
        the domains.
      proxy_tokens: training tokens per proxy run (steps = ceil(tokens / (global_batch_size x seq_len))).
      proxy_model: ``ModelConfig`` overrides of the proxy model (empty: the base config's model).
      seed: the mixture sampling's seed (the runs all use ``TrainConfig.seed``).
      floors, caps: ``(('domain', share), ...)``: the proposal's per-domain least and largest shares.
      target_tokens: the token budget of the run the mixture is for (0: no availability limit).
      max_epochs: how many times a domain may be read at ``target_tokens``.
      validation_model, validation_tokens: the validation runs' model overrides and tokens.
      validation_seeds: ``TrainConfig.seed`` of each validation run of each mixture.
      database: the conclusions database (''': ``$JAXPT_CONCLUSIONS_DB`` or ``conclusions.sqlite``).
    """

    name: str = ""
    output: str = "runs/mixtures"
    target: str = ""
    proxies: int = 16
    proxy_tokens: int = 0
    proxy_model: Any = None
    seed: int = 0
    floors: tuple = ()
    caps: tuple = ()
    target_tokens: float = 0.0
    max_epochs: float = 4.0
    validation_model: Any = None
    validation_tokens: int = 0
    validation_seeds: tuple = (0, 1)
    database: str = ""

    @property
    def directory(self) -> str:
        """``<output>/<name>``: the experiment's runs, fit, proposal and validation files."""
        return fs.join(self.output, self.name)


_GIN_EXPERIMENT = config_lib.tool_configurable(MixtureExperiment)


def load_experiment(path: str, bindings: Sequence[str] = ()) -> tuple[MixtureExperiment, config_lib.TrainConfig]:
    """Parse the experiment file (+ bindings) into the experiment and the base train config.

    Raises:
      ConfigError: a missing name, target or token budget, an unknown ``ModelConfig`` field in ``proxy_model`` or
        ``validation_model``, naming the file and the key.
    """
    base = config_lib.parse([path], bindings)
    exp = _GIN_EXPERIMENT()
    if not exp.name or "/" in exp.name:
        raise ConfigError(f"{path}: MixtureExperiment.name must be a non-empty name without '/' (got {exp.name!r})")
    if not exp.target:
        raise ConfigError(f"{path}: MixtureExperiment.target: the target file is required")
    if exp.proxy_tokens <= 0:
        raise ConfigError(f"{path}: MixtureExperiment.proxy_tokens must be positive (got {exp.proxy_tokens!r})")
    if exp.proxies < MIN_PROXIES:
        raise ConfigError(f"{path}: MixtureExperiment.proxies = {exp.proxies}: at least {MIN_PROXIES} (the "
                          "leave-one-out check fits on all runs but one, and a fit needs 3)")
    for key in ("floors", "caps"):
        _check_pairs(path, key, getattr(exp, key))
    if not fs.exists(exp.target):
        raise ConfigError(f"{path}: MixtureExperiment.target = {exp.target!r}: no such file")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in ("proxy_model", "validation_model"):
        value = getattr(exp, key) or {}
        if not isinstance(value, dict) or set(value) - fields:
            raise ConfigError(f"{path}: MixtureExperiment.{key} = {value!r}: a dict of ModelConfig fields "
                              f"(unknown: {sorted(set(value) - fields) if isinstance(value, dict) else value!r})")
    return exp, base


def _check_pairs(path: str, key: str, value: Any) -> None:
    """``floors``/``caps`` must be ``(('domain', share), ...)``.

    Raises:
      ConfigError: any other shape (a single pair without the outer tuple is the usual slip), naming the key.
    """
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str)
        and isinstance(e[1], (int, float)) and not isinstance(e[1], bool) for e in value)
    if not ok:
        raise ConfigError(f"{path}: MixtureExperiment.{key} = {value!r}: write (('domain', share), ...), a tuple of "
                          f"pairs, e.g. (('web', 0.05),) for one")


@dataclasses.dataclass(frozen=True)
class Target:
    """The experiment's target: ``name``, ``metrics`` (``{metric name: positive weight}``) and ``eval_card`` (the card
    file its ``card/<task>/<score>`` metrics are scored on; '' for a target without them)."""

    name: str
    metrics: dict
    eval_card: str = ""

    @classmethod
    def load(cls, path: str) -> "Target":
        """Read a target file.

        Raises:
          ConfigError: not a JSON object with ``name`` and a non-empty ``metrics`` of positive weights, a key
            other than :data:`TARGET_KEYS`, or an ``eval_card`` that is not a path (naming the file and the entry).
        """
        raw = fs.read_json(path, "a mixture target file")
        if not isinstance(raw, dict) or not isinstance(raw.get("metrics"), dict) or not raw["metrics"]:
            raise ConfigError(f"{path}: a target file is {{\"name\": ..., \"metrics\": {{metric: weight, ...}}}}")
        unknown = sorted(set(raw) - set(TARGET_KEYS))
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {unknown}; a target file has {list(TARGET_KEYS)}")
        for k, v in raw["metrics"].items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{path}: metrics[{k!r}] = {v!r} must be a positive weight")
        card = raw.get("eval_card") or ""
        if not isinstance(card, str):
            raise ConfigError(f"{path}: eval_card = {card!r} must be the path of an eval card (YAML)")
        return cls(str(raw.get("name") or path), {str(k): float(v) for k, v in raw["metrics"].items()}, card)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Target":
        """The target as :meth:`record` wrote it (``fit.json``, the database)."""
        return cls(record["name"], dict(record["metrics"]), record.get("eval_card") or "")

    def record(self) -> dict[str, Any]:
        """What ``fit.json`` and the database record: name and metrics, and ``eval_card`` only for a target with card
        metrics (a target without them is recorded as before card targets existed)."""
        out = {"name": self.name, "metrics": dict(self.metrics)}
        if self.card_metrics:
            out["eval_card"] = self.eval_card
        return out

    @property
    def card_metrics(self) -> list[str]:
        """The ``card/<task>/<score>`` metrics, in the file's order."""
        return [m for m in self.metrics if m.startswith(CARD)]

    def check_names(self, domains: Sequence[str], path: str) -> None:
        """Refuse, before anything trains, a metric no run of the experiment will have (card metrics: :meth:`card`).

        Raises:
          ConfigError: naming the metric and the file, with the names a target may use.
        """
        known = set(RUN_METRICS) | {f"heldout/domain/{d}/{k}" for d in domains for k in ("loss", "perplexity")}
        unknown = sorted(set(self.metrics) - known - set(self.card_metrics))
        if unknown:
            raise ConfigError(f"{path}: target metric(s) {unknown} are not in a proxy's final record; use "
                              f"{sorted(known)}, or {CARD}<task>/<score> with an eval_card")

    def card(self, path: str) -> card_lib.Card | None:
        """The eval card the card metrics are scored on (``eval_card``, relative to the working directory), reduced to
        the tasks they name, without spot check and safety (which a target does not use); None without card metrics.

        Raises:
          ConfigError: naming the target file and the entry: card metrics without ``eval_card``, a card that does not
            load (not found, not stamped), a task the card does not have, a score the task does not report
            (:func:`card_scores`).
        """
        names = self.card_metrics
        if not names:
            if self.eval_card:
                log.warning("%s: eval_card %s is not used: no metric is a card task's (%s<task>/<score>)", path,
                            self.eval_card, CARD)
            return None
        if not self.eval_card:
            raise ConfigError(f"{path}: metrics {names} are eval-card task scores: name the card in the target file, "
                              '"eval_card": "configs/eval/card_v1.yaml"')
        try:
            card = card_lib.load_card(self.eval_card, check_files=False)
        except card_lib.CardError as e:
            raise ConfigError(f"{path}: eval_card = {self.eval_card!r}: {e}") from None
        specs, needed = {s.name: s for s in card.tasks}, {}
        for m in names:
            task, _, score = m[len(CARD):].partition("/")
            if task not in specs:
                raise ConfigError(f"{path}: metrics[{m!r}]: card {card.name} v{card.version} ({self.eval_card}) has no "
                                  f"task {task!r}; its tasks: {sorted(specs)}")
            if score not in card_scores(specs[task]):
                raise ConfigError(f"{path}: metrics[{m!r}]: task {task!r} ({specs[task].kind}) reports "
                                  f"{list(card_scores(specs[task]))}, not {score!r} (write {CARD}<task>/<score>)")
            needed[task] = specs[task]
        return dataclasses.replace(card, tasks=tuple(needed.values()), spot_check=None, safety=None)

    def value(self, metrics: dict[str, float], run_id: str = "") -> float:
        """The weighted mean of the named metrics of one run (nats per token for losses); a card metric, a score where
        higher is better, enters as its error ``1 - score``, so the target stays lower-is-better.

        Raises:
          ConfigError: a metric the run does not have (naming it and the run).
        """
        missing = [m for m in self.metrics if m not in metrics]
        if missing:
            raise ConfigError(f"run {run_id}: no metric(s) {missing} for the target {self.name!r} (the run has "
                              f"{sorted(k for k in metrics if k.startswith(('heldout', CARD)))[:12]} ...)")
        total = sum(self.metrics.values())
        return sum(w * (1.0 - float(metrics[m]) if m.startswith(CARD) else float(metrics[m]))
                   for m, w in self.metrics.items()) / total


def domain_tokens(cfg: config_lib.TrainConfig) -> dict[str, int]:
    """``{domain: training tokens}`` of the run's data: the manifest's ``tokens_by_domain`` for a corpus version,
    else each training document's tokens plus its boundary tokens, summed by its ``domain``.

    Raises:
      ConfigError: documents without a ``domain``, or a corpus version whose manifest has no token counts.
    """
    d = cfg.data
    if d.source == "corpus":
        counts = corpus.read_corpus_version(d.corpus_dir).manifest.get("tokens_by_domain")
        if not counts:
            raise ConfigError(f"DataConfig.corpus_dir = {d.corpus_dir!r}: its manifest has no tokens_by_domain")
        return {k: int(v) for k, v in counts.items()}
    tok = resolve_lib.load_tokenizer(cfg)
    marks = boundary.for_tokenizer(d.document_boundary, tok)
    counts: dict[str, int] = {}
    for i, doc in enumerate(loader.load_documents(d.train_path)):
        domain = doc.get("domain")
        if not domain:
            raise ConfigError(f"DataConfig.train_path = {d.train_path!r}: document {doc.get('id', i)!r} has no "
                              "'domain'; a mixture experiment mixes domains")
        counts[domain] = counts.get(domain, 0) + len(marks.wrap(tok.encode(doc["text"])))
    return dict(sorted(counts.items()))


def run_bindings(exp: MixtureExperiment, base: config_lib.TrainConfig, workdir: str, domains: Sequence[str],
                 weights: np.ndarray, model: dict | None, tokens: int, seed: int | None = None,
                 checkpoint: bool = False) -> list[str]:
    """The gin bindings of one run of the experiment: its model, token budget (a schedule over its own steps),
    workdir, mixture and per-domain held-out evaluation; with ``checkpoint`` (a target with card metrics, scored
    from the run's final checkpoint), checkpoints on."""
    steps = max(1, math.ceil(tokens / (base.global_batch_size * base.seq_len)))
    mix = tuple((d, float(w)) for d, w in zip(domains, weights))
    b = [f"ModelConfig.{k} = {v!r}" for k, v in (model or {}).items()]
    b += [f"TrainConfig.steps = {steps}", f"TrainConfig.workdir = {workdir!r}",
          f"OptimizerConfig.warmup_steps = {max(1, round(0.05 * steps))}", "OptimizerConfig.decay_steps = 0",
          "TrainConfig.progress_bar = False", f"DataConfig.mixture_weights = {mix!r}",
          "DataConfig.mixture_schedule = ()", "HeldoutEvalConfig.enabled = True",
          "HeldoutEvalConfig.group_by = ('domain',)",
          # one compile cache for the experiment: proxies of one shape compile once
          f"TrainConfig.compilation_cache_dir = {fs.join(exp.directory, 'jax_cache')!r}"]
    if seed is not None:
        b.append(f"TrainConfig.seed = {seed}")
    if checkpoint:  # bookkeeping (config.BOOKKEEPING): not a proxy setting; the last step is always saved
        b += ["CheckpointConfig.enabled = True", f"CheckpointConfig.keep_last = {max(1, base.checkpoint.keep_last)}"]
    return b


def _train(path: str, bindings: Sequence[str], run_bindings_: list[str]) -> config_lib.TrainConfig:
    cfg = config_lib.parse([path], [*run_bindings_, *bindings])
    session.run_training(cfg)
    return cfg


def _import(db, exp: MixtureExperiment, workdir: str, role: str, ev: CardEvaluation | None) -> dict[str, Any]:
    """Record a finished run of the experiment, scored on the card target's tasks when there is one."""
    rec = conclusions.import_run(db, workdir, experiment_id=exp.name, role=role)
    return record_card_metrics(db, ev, [rec])[0]


def open_database(exp: MixtureExperiment) -> "conclusions.ConclusionsDB":
    """The experiment's conclusions database (``MixtureExperiment.database`` or the default path), after creating
    the experiment's output folder (where a team often keeps the file)."""
    fs.makedirs(exp.directory)
    return conclusions.ConclusionsDB(exp.database or conclusions.default_path())


def experiment_record(exp: MixtureExperiment, target: Target, domains: Sequence[str], tokens: dict[str, int],
                      proxy_settings: dict[str, Any]) -> dict[str, Any]:
    """What identifies an experiment in the database: its settings, domains and their token counts, and every
    setting of a proxy run that can change its numbers (``proxy_settings``); the target is recorded as first given
    (a later ``fit`` may use another)."""
    return {"experiment": dataclasses.asdict(exp), "target": target.record(), "domains": list(domains),
            "domain_tokens": tokens, "proxy_settings": proxy_settings}


def proxy_settings(path: str, bindings: Sequence[str], exp: MixtureExperiment, base: config_lib.TrainConfig,
                   domains: Sequence[str]) -> dict[str, Any]:
    """``{'Class.field': value}`` of a proxy run's operative config that can change its numbers (bookkeeping, the
    workdir and the mixture, which differs per proxy, left out): a base config changed between two runs of one
    experiment is refused by name, since its proxies would no longer differ by their mixture alone."""
    weights = np.full(len(domains), 1.0 / len(domains))
    cfg = config_lib.parse([path], [*run_bindings(exp, base, "proxy", domains, weights, exp.proxy_model,
                                                  exp.proxy_tokens), *bindings])
    settings = config_lib.saved_settings({"config_gin": config_lib.operative_config_str(cfg)})
    return {k: json.loads(json.dumps(v, default=repr)) for k, v in sorted(settings.items())
            if not config_lib.is_bookkeeping(k) and k not in ("DataConfig.mixture_weights",
                                                               "DataConfig.mixture_schedule")}


def _register(db, exp: MixtureExperiment, record: dict[str, Any], data_version: str) -> None:
    """Add the experiment, or check that the one already there has the same settings (a resume).

    Raises:
      ConfigError: an experiment of that name with other settings (naming the keys that differ).
    """
    known = db.experiment(exp.name) if db.has(exp.name) else None
    if known is None:
        db.add_experiment(exp.name, kind="mixture", config=record, data_version=data_version,
                          target=record["target"])
        return
    old = known["config"]
    differ = sorted(k for k in set(old["experiment"]) | set(record["experiment"])
                    if old["experiment"].get(k) != record["experiment"].get(k) and k not in PROPOSAL_ONLY)
    differ += [k for k in ("domains", "domain_tokens") if old.get(k) != record[k]]
    settings_old, settings_new = old.get("proxy_settings", {}), record["proxy_settings"]
    differ += sorted(k for k in set(settings_old) | set(settings_new)
                     if not config_lib.same_value(settings_old.get(k), settings_new.get(k)))
    if differ:
        raise ConfigError(f"mixture experiment {exp.name!r} is already in {db.path} with other settings "
                          f"({', '.join(differ)}): choose a new MixtureExperiment.name to start another")


def proxy_mixtures(exp: MixtureExperiment, domains: Sequence[str], tokens: dict[str, int]) -> np.ndarray:
    """The experiment's proxy mixtures, float64 [proxies, n] (deterministic in ``seed``)."""
    return search.sample_mixtures(search.natural_shares(tokens, domains), exp.proxies, exp.seed)


def run_proxies(path: str, bindings: Sequence[str] = (), only: Sequence[int] = ()) -> dict[str, Any] | None:
    """``run``: train the proxies not yet in the database, then fit and propose (:func:`fit_and_propose`).

    ``only``: train just these proxy indices (0-based), e.g. one per job of a cluster scheduler writing one local
    database file; the fit then waits for every proxy, and None is returned while some are missing.

    Raises:
      ConfigError: an index in ``only`` outside the experiment's proxies; as :func:`load_experiment`,
        :meth:`Target.check_names`, :func:`card_evaluation` and :func:`card_pending` (proxies recorded without the
        target's card metrics whose checkpoints are gone).
    """
    exp, base = load_experiment(path, bindings)
    if any(not 0 <= i < exp.proxies for i in only):
        raise ConfigError(f"--proxy {list(only)}: the experiment has proxies 0-{exp.proxies - 1}")
    target = Target.load(exp.target)
    tokens = domain_tokens(base)
    domains = tuple(sorted(tokens))
    target.check_names(domains, exp.target)
    ev = card_evaluation(target, exp.target, base)
    constraints(exp, domains, tokens).bounds()  # a floor naming no domain fails now, not after the proxies
    if exp.proxies < len(domains) + 2:
        raise ConfigError(f"{path}: MixtureExperiment.proxies = {exp.proxies} with {len(domains)} domains: at least "
                          f"{len(domains) + 2}, else the fit has as many unknowns as runs")
    mixtures = proxy_mixtures(exp, domains, tokens)
    db = open_database(exp)
    data_version = stream.data_version(base)
    record = experiment_record(exp, target, domains, tokens, proxy_settings(path, bindings, exp, base, domains))
    _register(db, exp, record, data_version)
    conclusions.record_data_version(db, base, data_version)  # fails now, not after the first proxy
    done = {fs.absolute(r["workdir"]): r for r in db.runs(experiment_id=exp.name, role=PROXY_ROLE)}
    card_pending(ev, list(done.values()))  # each can still be scored (by the fit)
    db.set_experiment_status(exp.name, "running")
    workdirs = [fs.absolute(fs.join(exp.directory, f"proxy-{i:03d}")) for i in range(len(mixtures))]
    t0, trained = time.perf_counter(), 0
    for i, (w, workdir) in enumerate(zip(mixtures, workdirs)):
        if workdir in done:
            _check_same_mixture(done[workdir], domains, w)
            continue
        if only and i not in only:
            continue
        left = sum(wd not in done and (not only or j in only) for j, wd in enumerate(workdirs) if j >= i)
        log.info("[%d/%d] proxy-%03d: %s; %d done, %d to train, ETA %s", i + 1, len(mixtures), i,
                 search.describe(w, domains), len(done) + trained, left, _eta(t0, trained, left))
        cfg = _train(path, bindings, run_bindings(exp, base, workdir, domains, w, exp.proxy_model, exp.proxy_tokens,
                                                  checkpoint=ev is not None))
        rec = _import(db, exp, cfg.workdir, PROXY_ROLE, ev)
        db.add_metrics(rec["id"], realized_shares(cfg.workdir, domains, rec["tokens"]))
        rec = db.resolve(rec["id"])[1]
        log.info("proxy-%03d: target %.4f (run %s)", i, target.value(rec["metrics"], rec["id"]), rec["id"])
        trained += 1
    missing = len(mixtures) - len(done) - trained
    if missing:
        log.info("%d of %d proxies still to train: `run` them (or `fit` once all are in %s)", missing, len(mixtures),
                 db.path)
        return None
    return fit_and_propose(path, bindings)


def _eta(t0: float, trained: int, left: int) -> str:
    """``H:MM:SS`` left for ``left`` runs at the mean time of the ``trained`` ones since ``t0`` (``?`` before one)."""
    return format_duration((time.perf_counter() - t0) / trained * left if trained else float("nan"))


def realized_shares(workdir: str, domains: Sequence[str], tokens: int) -> dict[str, float]:
    """``{REALIZED + domain: share}``: each domain's share of the tokens the run trained on, from the last step
    record of ``metrics.jsonl`` (``mixture/share/<group>``). The token-true mixture keeps a group within a few rows
    of its weight, which for a share of 0.1% over a proxy's few hundred rows is several times the weight: the fit
    uses what was trained on. Empty (the nominal weights are used, and that is logged) when the record does not
    cover the whole run: a resumed run counts shares from its last session's start."""
    last = None
    for _, rec in jsonl.iter_objects(fs.join(workdir, "metrics.jsonl")):
        if "mixture/stage_tokens" in rec:
            last = rec
    if last is None or int(last["mixture/stage_tokens"]) != int(tokens):
        log.info("%s: no step record covers all %s tokens (a resumed run): its nominal weights stand for its "
                 "mixture", workdir, tokens)
        return {}
    return {REALIZED + d: float(last.get(f"mixture/share/{d}", 0.0)) for d in domains}


def run_weights(run: dict[str, Any], domains: Sequence[str]) -> np.ndarray:
    """The mixture a recorded run trained on, float64 [n] in ``domains`` order: its realized shares
    (:func:`realized_shares`) when recorded, else its last stage's weights as ``run.json`` records the schedule.

    Raises:
      ConfigError: a run with no recorded mixture, or with groups that are not these domains.
    """
    metrics = run.get("metrics") or {}
    if all(REALIZED + d in metrics for d in domains):
        w = np.array([float(metrics[REALIZED + d]) for d in domains])
        return w / w.sum()
    return nominal_weights(run, domains)


def nominal_weights(run: dict[str, Any], domains: Sequence[str]) -> np.ndarray:
    """A recorded run's mixture weights (its last stage's, as ``run.json`` records the schedule), float64 [n].

    Raises:
      ConfigError: as :func:`run_weights`.
    """
    stages = run.get("mixture") or []
    if not stages:
        raise ConfigError(f"run {run['id']} ({run['workdir']}): no recorded mixture")
    weights = stages[-1]["weights"]
    if set(weights) - set(domains):
        raise ConfigError(f"run {run['id']}: mixture groups {sorted(set(weights) - set(domains))} are not the "
                          f"experiment's domains {list(domains)}")
    w = np.array([float(weights.get(d, 0.0)) for d in domains])
    return w / w.sum()


def _check_same_mixture(run: dict[str, Any], domains: Sequence[str], w: np.ndarray) -> None:
    have = nominal_weights(run, domains)
    if not np.allclose(have, w, rtol=0, atol=1e-12):
        raise ConfigError(f"{run['workdir']}: the database's proxy run {run['id']} trained mixture "
                          f"{search.describe(have, domains)}, not this experiment's {search.describe(w, domains)}")


def proxy_table(db, exp: MixtureExperiment, domains: Sequence[str],
                target: Target) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    """The experiment's proxy runs from the database, in proxy order: ``(runs, weights [k, n], targets [k])``.
    A proxy whose target is not finite (a diverged run) is left out and logged by name."""
    runs = sorted(db.runs(experiment_id=exp.name, role=PROXY_ROLE), key=lambda r: fs.basename(r["workdir"]))
    kept, w, y = [], [], []
    for r in runs:
        value = target.value(r["metrics"], r["id"])
        if not math.isfinite(value):
            log.warning("proxy run %s (%s): target %s is not finite; left out of the fit", r["id"], r["workdir"],
                        value)
            continue
        kept.append(r)
        w.append(run_weights(r, domains))
        y.append(value)
    return kept, np.asarray(w, np.float64), np.asarray(y, np.float64)


def constraints(exp: MixtureExperiment, domains: Sequence[str], tokens: dict[str, int]) -> search.Constraints:
    """The proposal's constraints from the experiment's floors, caps and availability settings."""
    return search.Constraints(tuple(domains), dict(exp.floors), dict(exp.caps), tokens, float(exp.target_tokens),
                              float(exp.max_epochs))


def fit_and_propose(path: str, bindings: Sequence[str] = ()) -> dict[str, Any]:
    """``fit``: fit the regression to the database's proxy runs, propose a mixture, write the files and the
    ``proposed`` conclusion. Returns the fit's summary (also ``fit.json``).

    The target is the experiment file's (``MixtureExperiment.target``, read now): proxies do not depend on it, so one
    experiment may be refit for another target; ``fit.json``, ``proposal.gin`` and the conclusion name it and the
    constraints used. A target with card metrics the proxies were not scored on scores them first, each from its
    final checkpoint (:func:`record_card_metrics`), and records the scores in the database.

    Raises:
      ConfigError: an experiment not in the database, with fewer than :data:`MIN_PROXIES` finished proxy runs, or
        a target naming a metric the proxies lack; as :func:`card_evaluation` and :func:`card_pending` (a proxy to
        score whose checkpoint is gone, naming the run and its workdir).
    """
    exp, base = load_experiment(path, bindings)
    db = open_database(exp)
    if not db.has(exp.name):
        raise ConfigError(f"mixture experiment {exp.name!r} is not in {db.path}: `run` it first")
    rec = db.experiment(exp.name)["config"]
    domains, tokens, target = tuple(rec["domains"]), rec["domain_tokens"], Target.load(exp.target)
    target.check_names(domains, exp.target)
    ev = card_evaluation(target, exp.target, base)
    record_card_metrics(db, ev, db.runs(experiment_id=exp.name, role=PROXY_ROLE))  # proxies trained without them
    runs, w, y = proxy_table(db, exp, domains, target)
    if len(runs) < MIN_PROXIES:
        raise ConfigError(f"mixture experiment {exp.name!r}: {len(runs)} finished proxy runs with a finite target; "
                          f"a fit and its leave-one-out check need {MIN_PROXIES}")
    model = search.fit_model(w, y)
    rho, loo = search.cross_validated_spearman(w, y)
    natural = search.natural_shares(tokens, domains)
    proposal = search.round_mixture(search.propose(model, constraints(exp, domains, tokens), natural,
                                                   seed=exp.seed))
    summary = _summary(exp, domains, runs, w, y, model, rho, loo, proposal, natural)
    summary["target"] = {**target.record(), **({"card": ev.ident} if ev else {})}
    summary["constraints"] = {"floors": dict(exp.floors), "caps": dict(exp.caps), "target_tokens": exp.target_tokens,
                              "max_epochs": exp.max_epochs}
    summary["conclusion"] = _conclude(db, exp, runs, summary)
    fs.write_text_atomic(fs.join(exp.directory, "fit.json"), jsonl.dumps(summary, indent=1))
    fs.write_text_atomic(fs.join(exp.directory, "proposal.gin"), proposal_gin(exp, path, domains, proposal, summary))
    plot_fit(y, loo, fs.join(exp.directory, "predicted_vs_actual.png"), target.name)
    return summary


def _summary(exp, domains, runs, w, y, model, rho, loo, proposal, natural) -> dict[str, Any]:
    return {"experiment": exp.name, "domains": list(domains), "proxies": len(runs),
            "runs": [r["id"] for r in runs], "weights": w.tolist(), "targets": y.tolist(),
            "model": {"coef": model.coef.tolist(), "intercept": model.intercept, "alpha": model.alpha,
                      "eps": model.eps, "r2": model.r2},
            "loo_predictions": loo.tolist(), "loo_spearman": rho,
            "proposal": dict(zip(domains, proposal.tolist())), "natural": dict(zip(domains, natural.tolist())),
            "uniform": {d: 1.0 / len(domains) for d in domains},
            "predicted": {"proposal": float(model.predict(proposal)), "natural": float(model.predict(natural)),
                          "uniform": float(model.predict(np.full(len(domains), 1 / len(domains))))},
            "proxy_flops": float(np.mean([r["flops"] for r in runs])),
            "proxy_tokens": float(np.mean([r["tokens"] for r in runs]))}


def proposal_gin(exp: MixtureExperiment, path: str, domains: Sequence[str], proposal: np.ndarray,
                 summary: dict[str, Any]) -> str:
    """The proposal as a staged mixture file the trainer runs after its base config; it also turns on the
    per-domain held-out evaluation, so the run records the metrics the target names."""
    stage = tuple((d, float(w)) for d, w in zip(domains, proposal))  # a 0 leaves that domain out
    pred, c = summary["predicted"], summary["constraints"]
    return (f"# Mixture experiment {exp.name!r} (python -m jaxpt.tools.mixtures, {path}): the proposed mixture.\n"
            f"# experiment id: {exp.name}; conclusion {summary['conclusion']}; target {summary['target']['name']!r}; "
            f"{summary['proxies']} proxy runs; leave-one-out Spearman {summary['loo_spearman']:.3f}.\n"
            f"# predicted target {pred['proposal']:.4f} (natural {pred['natural']:.4f}, uniform {pred['uniform']:.4f});"
            f" floors {c['floors']}, caps {c['caps']}, at most {c['max_epochs']:g} epochs of a domain at "
            f"{c['target_tokens']:g} tokens (0: no limit).\n"
            f"#   python -m jaxpt.train --config <base config> --config {fs.join(exp.directory, 'proposal.gin')}\n"
            + (f"# the target's card scores ({summary['target']['card']}) come from the evaluation, not the run:\n"
               f"#   python -m jaxpt.tools.evaluate --workdir <run> --card {summary['target']['eval_card']}\n"
               if summary["target"].get("card") else "") +
            f"DataConfig.mixture_schedule = ((1, {stage!r}),)\n"
            "DataConfig.mixture_weights = ()\n"
            "HeldoutEvalConfig.enabled = True\n"
            "HeldoutEvalConfig.group_by = ('domain',)\n")


def plot_fit(actual: np.ndarray, predicted: np.ndarray, out: str, target_name: str) -> None:
    """Scatter of leave-one-out predicted against measured targets, with the identity line."""
    import matplotlib  # matplotlib: imported only to draw
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(actual, predicted)
    lo, hi = float(min(actual.min(), predicted.min())), float(max(actual.max(), predicted.max()))
    ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--")
    ax.set_xlabel(f"measured target ({target_name})")
    ax.set_ylabel("predicted (leave-one-out)")
    fig.tight_layout()
    fs.write_figure(fig, out)
    plt.close(fig)


def _conclude(db, exp: MixtureExperiment, runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The experiment's ``proposed`` conclusion, naming the target and the constraints (a refit with more runs,
    another target or other constraints supersedes the earlier proposed one)."""
    c = summary["constraints"]
    statement = (f"mixture {search.describe(np.array(list(summary['proposal'].values())), summary['domains'])} "
                 f"minimizes target {summary['target']['name']!r} among mixtures with floors {c['floors']}, caps "
                 f"{c['caps']} and at most {c['max_epochs']:g} epochs at {c['target_tokens']:g} tokens (predicted "
                 f"{summary['predicted']['proposal']:.4f} vs natural {summary['predicted']['natural']:.4f}); "
                 f"{len(runs)} proxies, leave-one-out Spearman {summary['loo_spearman']:.3f}")
    previous = [c for c in db.conclusions(experiment_id=exp.name) if c["status"] == "proposed"]
    if previous and previous[-1]["statement"] == statement:
        return previous[-1]["id"]
    cid = db.add_conclusion(statement, evidence=[exp.name, *[r["id"] for r in runs]], status="proposed",
                            experiment_id=exp.name, author="jaxpt.tools.mixtures")
    for c in previous:
        db.set_status(c["id"], "superseded", superseded_by=cid)
    return cid


# --------------------------------------------------------------------------------------------------
# validate


def validation_mixtures(summary: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{label: mixture}`` of the validation: the proposal, the natural and the uniform mixture."""
    domains = summary["domains"]
    return {"proposed": np.array([summary["proposal"][d] for d in domains]),
            "natural": np.array([summary["natural"][d] for d in domains]),
            "uniform": np.full(len(domains), 1.0 / len(domains))}


def validation_jobs(exp: MixtureExperiment, summary: dict[str, Any]) -> list[tuple[str, np.ndarray, int, str]]:
    """``(label, mixture, seed, workdir)`` of every validation run. The workdir names a digest of the mixture, the
    validation model and tokens, so a refit's new proposal or a new validation scale trains new runs instead of
    reading old ones."""
    jobs = []
    for label, w in validation_mixtures(summary).items():
        key = json.dumps([np.round(w, 6).tolist(), exp.validation_model or {}, exp.validation_tokens], sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        for seed in exp.validation_seeds:
            jobs.append((label, w, seed, fs.absolute(fs.join(exp.directory, f"validate-{label}-{digest}-seed{seed}"))))
    return jobs


def validate(path: str, bindings: Sequence[str] = ()) -> dict[str, Any]:
    """``validate``: train each validation mixture at the validation scale for each seed (resumable: runs already
    in the database are not trained again), then report and settle the conclusion (module docstring).

    A fit whose target has card metrics scores each validation run on its card tasks after training (and one
    recorded without them before the report), as the proxies are (:func:`record_card_metrics`).

    Raises:
      ConfigError: no ``validation_tokens`` or seeds, or no ``fit.json`` (run ``run`` or ``fit`` first); as
        :func:`card_evaluation` and :func:`card_pending`.
    """
    exp, base = load_experiment(path, bindings)
    if exp.validation_tokens <= 0 or not exp.validation_seeds:
        raise ConfigError(f"{path}: MixtureExperiment.validation_tokens and validation_seeds must be set to validate")
    fit_file = fs.join(exp.directory, "fit.json")
    if not fs.exists(fit_file):
        raise ConfigError(f"{fit_file}: no fit yet; `run` (or `fit`) the experiment first")
    summary = fs.read_json(fit_file, "a mixture experiment's fit")
    ev = card_evaluation(Target.from_record(summary["target"]), fit_file, base)
    db = open_database(exp)
    done = {fs.absolute(r["workdir"]): r for r in db.runs(experiment_id=exp.name)}
    jobs = validation_jobs(exp, summary)
    card_pending(ev, [done[j[3]] for j in jobs if j[3] in done])
    t0, trained = time.perf_counter(), 0
    for i, (label, w, seed, workdir) in enumerate(jobs):
        if workdir in done:
            continue
        left = sum(j[3] not in done for j in jobs[i:])
        log.info("[%d/%d] validation %s seed %d: %s; %d to train, ETA %s", i + 1, len(jobs), label, seed,
                 search.describe(w, summary["domains"]), left, _eta(t0, trained, left))
        cfg = _train(path, bindings, run_bindings(exp, base, workdir, summary["domains"], w, exp.validation_model,
                                                  exp.validation_tokens, seed, checkpoint=ev is not None))
        done[workdir] = _import(db, exp, cfg.workdir, f"{VALIDATION_ROLE}:{label}", ev)
        trained += 1
    for r in record_card_metrics(db, ev, [done[j[3]] for j in jobs]):  # runs recorded before they were scored
        done[fs.absolute(r["workdir"])] = r
    for j in jobs:  # each run's realized token shares, as a proxy's (compare --metric mixture/realized/<domain>)
        r = done[j[3]]
        if not any(k.startswith(REALIZED) for k in r.get("metrics", {})):
            db.add_metrics(r["id"], realized_shares(r["workdir"], summary["domains"], r["tokens"]))
    report = validation_report(db, exp, summary, {j[3]: (j[0], j[2]) for j in jobs}, done)
    fs.write_text_atomic(fs.join(exp.directory, "validation.json"), jsonl.dumps(report, indent=1))
    return report


def validation_report(db, exp: MixtureExperiment, summary: dict[str, Any], labels: dict[str, tuple[str, int]],
                      runs_by_workdir: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each validation mixture's target per seed (mean over seeds, seed spread), the proposal's margins over the
    others (of the means, and paired by seed: ``other - proposed`` at each seed, in nats, positive where the proposal
    is better; a seed shifts every mixture alike when it sets the initialization and data order), the compute ratio
    to a proxy (warned about under 4x), and the verdict: ``confirmed`` when the proposal's mean beats both others by
    more than the largest seed spread, else ``refuted``; recorded in the database (:func:`_settle`).
    ``labels``: ``{workdir: (label, seed)}`` of this validation's runs; ``runs_by_workdir``: their database rows."""
    target = Target.from_record(summary["target"])  # the fit's target: the one the proposal was made for
    figures, runs = {}, []
    for label in VALIDATION_LABELS:
        by_seed = sorted((seed, runs_by_workdir[w]) for w, (lab, seed) in labels.items() if lab == label)
        rows = [r for _, r in by_seed]
        values = [target.value(r["metrics"], r["id"]) for r in rows]
        runs += rows
        figures[label] = {"runs": [r["id"] for r in rows], "seeds": [seed for seed, _ in by_seed], "targets": values,
                          "mean": float(np.mean(values)), "spread": search.spread(values)}
    worst_spread = max((f["spread"] for f in figures.values() if math.isfinite(f["spread"])), default=float("nan"))
    diffs = {k: figures[k]["mean"] - figures["proposed"]["mean"] for k in ("natural", "uniform")}
    proposed = dict(zip(figures["proposed"]["seeds"], figures["proposed"]["targets"]))
    paired = {k: {str(seed): t - proposed[seed] for seed, t in zip(figures[k]["seeds"], figures[k]["targets"])
                  if seed in proposed} for k in ("natural", "uniform")}
    beats = math.isfinite(worst_spread) and all(d > worst_spread for d in diffs.values())
    ratio = float(np.mean([r["flops"] for r in runs])) / summary["proxy_flops"]
    if ratio < 4:
        log.warning("the validation runs have %.1fx a proxy's FLOPs: a test of the proposal at a larger scale wants "
                    "at least 4x (MixtureExperiment.validation_model, validation_tokens)", ratio)
    report = {"experiment": exp.name, "target": target.name, "proposal": summary["proposal"], "figures": figures,
              "improvement_over": diffs, "improvement_by_seed": paired, "largest_seed_spread": worst_spread,
              "validation_flops": float(np.mean([r["flops"] for r in runs])), "compute_ratio_to_proxy": ratio,
              "status": "confirmed" if beats else "refuted"}
    report["conclusion"] = _settle(db, exp, runs, report, summary.get("conclusion"))
    db.set_experiment_status(exp.name, "completed")
    return report


def _settle(db, exp: MixtureExperiment, runs: list[dict[str, Any]], report: dict[str, Any],
            proposed: str | None) -> str:
    """Record the validation as a claim with its verdict as status ("the proposal beats natural and uniform at this
    scale by more than the seed spread": confirmed or refuted), citing the validation runs and the proposal's
    conclusion; the proposal's conclusion takes the same status."""
    f, mix = report["figures"], report["proposal"]
    statement = (f"the proposed mixture ({search.describe(np.array(list(mix.values())), list(mix))}) beats the "
                 f"natural and the uniform mixture on target {report['target']!r} by more than the seed spread at "
                 f"{report['compute_ratio_to_proxy']:.1f}x a proxy's FLOPs: proposed {f['proposed']['mean']:.4f}, "
                 f"natural {f['natural']['mean']:.4f}, uniform {f['uniform']['mean']:.4f}, largest seed spread "
                 f"{report['largest_seed_spread']:.4f}")
    same = [c for c in db.conclusions(experiment_id=exp.name) if c["statement"] == statement]
    cid = same[-1]["id"] if same else db.add_conclusion(
        statement, evidence=[exp.name, *([proposed] if proposed and db.has(proposed) else []),
                             *[r["id"] for r in runs]],
        status=report["status"], experiment_id=exp.name, author="jaxpt.tools.mixtures")
    if proposed and db.has(proposed) and db.resolve(proposed)[1]["status"] != "superseded":
        db.set_status(proposed, report["status"])
    return cid


def outside_proxies(summary: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """``{domain: (proposed share, least proxy share, largest proxy share)}`` for each domain whose proposed share
    lies outside the shares the proxies trained on (``fit.json``'s ``weights``): there the fit extrapolates, and a
    proposal at a floor below every proxy's share is a guess about how that domain's loss grows (measured on raw-v1:
    multilingual proposed at 0.05, the proxies' least 0.086, lost to the uniform mixture at validation)."""
    w = np.asarray(summary["weights"], dtype=np.float64)
    out = {}
    for j, d in enumerate(summary["domains"]):
        share, lo, hi = float(summary["proposal"][d]), float(w[:, j].min()), float(w[:, j].max())
        if not lo <= share <= hi:
            out[d] = (share, lo, hi)
    return out
