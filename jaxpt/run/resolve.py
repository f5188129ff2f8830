"""Resolve: every check a run needs, answered once, into one :class:`Resolved` that the later phases read.

:func:`resolve` is what :func:`jaxpt.run.session.run_training` and ``python -m jaxpt.train --dry-run`` run first,
before anything is written or compiled, so a bad input costs seconds, not a booked slice. In order:

1. the config across its parts and against the devices (:func:`jaxpt.run.validate.validate`);
2. every input path (training data or corpus version, held-out set, tokenizer, a reachable bucket) and the
   mixture's groups;
3. the held-out documents (with a token to score) and the tokenizer; the vocabulary (:func:`resolve_vocab`);
4. the run's lineage (:func:`jaxpt.run.lineage.trace`): the resumed checkpoint or the new stage's parent, read once
   and admitted by the one admission check;
5. the data's identity (:func:`jaxpt.data.stream.data_version`), where a new stage's data starts
   (:func:`jaxpt.run.lineage.data_start`, ``TrainConfig.stage_data``) and the logical shard count, which this
   process count must divide (:func:`jaxpt.data.stream.check_shards`).

The builder (:mod:`jaxpt.run.build`) validates nothing: it builds a :class:`Layout`, which a run gets from
:func:`resolve` and a compile-only or benchmark build from :func:`layout` (steps 1 and 3's vocabulary only).
:func:`plan` adds what the run will cost (parameters, per-device memory estimate, tokens per step and in all), still
without compiling; :func:`format_plan` is the dry run's text.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.config import TrainConfig
from jaxpt.data import boundary, corpus, documents, mixture, stream
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.eval import inloop
from jaxpt.model import parametrization
from jaxpt.model.decoder import count_params
from jaxpt.run import compile_cache
from jaxpt.run import lineage as lineage_lib
from jaxpt.run.validate import validate
from jaxpt.training import batch_ramp, memory as memory_lib
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

log = logging.getLogger("jaxpt.run.resolve")

#: The quickstart's prepared sample, ``DataConfig``'s default training data.
DEFAULT_TRAIN_PATH = config_lib.DataConfig().train_path


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config checked against a device count, ready to build (:func:`jaxpt.run.build.build`).

    Attributes:
      cfg: the config, ``ModelConfig.vocab_size`` resolved (and, for a run, ``TrainConfig.init_from`` resolved).
      sizes: the resolved mesh sizes ``{axis: size}`` (ICI x DCN per axis, every axis of ``mesh.MESH_AXES``).
    """

    cfg: TrainConfig
    sizes: dict


def layout(cfg: TrainConfig, num_devices: int, tokenizer=None) -> Layout:
    """``cfg`` validated against ``num_devices`` (:func:`jaxpt.run.validate.validate`) with its vocabulary resolved
    (:func:`resolve_vocab`): what a build needs when there is no run to resolve (a compile for a target slice, a
    benchmark, a sweep point).

    Raises:
      ConfigError: naming the key, from either check.
    """
    sizes = validate(cfg, num_devices)
    return Layout(resolve_vocab(cfg, tokenizer), sizes)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Everything :func:`resolve` found, each answered once.

    Attributes:
      given: the config as given (what the run writes as its operative ``config.gin``: ``vocab_size = 0`` still
        means "the tokenizer's", an ``init_from`` still names what the user named).
      layout: the config (vocabulary and ``init_from`` resolved) and its mesh sizes.
      tokenizer: the run's loaded tokenizer.
      heldout_docs, heldout_set: the held-out documents and all their scoring windows.
      lineage: what the run continues, admitted (:class:`jaxpt.run.lineage.Lineage`).
      data_version: the training data's identifier (:func:`jaxpt.data.stream.data_version`).
      data_shards: the run's logical data shard count (``DataConfig.num_shards``, else the resumed checkpoint's or
        the parent's whose data position a new stage carries, else :func:`jaxpt.data.stream.default_shard_count`).
      data_start: where a new stage's data starts (:func:`jaxpt.run.lineage.data_start`; None: no new stage).
    """

    given: TrainConfig
    layout: Layout
    tokenizer: Any
    heldout_docs: list
    heldout_set: Any
    lineage: lineage_lib.Lineage
    data_version: str
    data_shards: int
    data_start: lineage_lib.DataStart | None = None

    @property
    def cfg(self) -> TrainConfig:
        return self.layout.cfg

    @property
    def sizes(self) -> dict:
        return self.layout.sizes

    @property
    def notes(self) -> list[str]:
        """Saved settings ignored and settings changed since the checkpoint (reported, not refused)."""
        return list(self.lineage.notes)

    @property
    def first_step(self) -> int:
        """The global step the stage's data stream feeds first: one past the step the stage starts from."""
        return config_lib.start_step(self.cfg) + 1


def resolve(cfg: TrainConfig, devices: Sequence[Any] | None = None) -> Resolved:
    """Every check of the module docstring, in order, each once; creates and compiles nothing.

    Args:
      devices: the devices the run will have (default: this job's, ``jax.devices()``); compile-only devices of a
        target slice (``python -m jaxpt.train --dry-run --topology v5p-128``) plan that slice from any host: its
        device count, and its host count for the data-shard rule.

    Raises:
      ConfigError: naming the key, file or line (exit 2).
      CheckpointError: the resumed checkpoint or the parent cannot continue this run (exit 3).
    """
    num_devices = len(devices) if devices is not None else jax.device_count()
    processes = len({getattr(d, "process_index", 0) for d in devices}) if devices is not None else None
    given, sizes = cfg, validate(cfg, num_devices)
    check_paths(cfg)
    check_mixture_groups(cfg)
    docs = inloop.load_heldout(cfg)  # a missing or malformed held-out set fails now, not after the last step
    tokenizer = load_tokenizer(cfg)
    cfg = resolve_vocab(cfg, tokenizer)
    if cfg.model.parametrization != "sp":
        log.info("parametrization: %s", parametrization.describe(cfg.model))
    for note in parametrization.notes(cfg.model):
        log.warning("%s", note)
    hset = inloop.heldout_set(cfg, docs, tokenizer)
    cfg, lineage = lineage_lib.trace(cfg, tokenizer)
    for note in lineage.notes:
        log.warning("%s", note)
    version = stream.data_version(cfg)
    start = lineage_lib.data_start(cfg, lineage.parent, version)
    if start is not None:
        (log.warning if start.choice == "replay" else log.info)("stage data: %s (%s)", start.choice, start.note)
    saved_shards = lineage.resume.meta.get("data_shards") if lineage.resume is not None else (
        start.shards if start is not None else None)
    shards = stream.data_shard_count(cfg, saved_shards)
    stream.check_shards(cfg, shards, recorded=bool(saved_shards) and not cfg.data.num_shards, processes=processes)
    return Resolved(given, Layout(cfg, sizes), tokenizer, docs, hset, lineage, version, shards, start)


def load_tokenizer(cfg: TrainConfig):
    """The run's :class:`jaxpt.data.tokenizer.Tokenizer` from ``DataConfig.tokenizer_path`` (a SentencePiece model
    or a Hugging Face ``tokenizer.json``, :meth:`jaxpt.data.tokenizer.Tokenizer.load`), checked against
    ``DataConfig.document_boundary`` (a policy needing a BOS the tokenizer lacks is refused now).

    Raises:
      ConfigError: the file is missing (names the key and the command that writes it), is not a tokenizer, or its
        special tokens cannot be resolved (names the key and what to add), or the boundary policy needs a token it
        does not have.
    """
    path = cfg.data.tokenizer_path
    if not fs.exists(path):
        raise ConfigError(f"DataConfig.tokenizer_path = {path!r}: no such file "
                          "(run `python -m jaxpt.data.prepare --output artifacts/sample` first)")
    try:
        tokenizer = Tokenizer.load(path)
    except ValueError as e:
        raise ConfigError(f"DataConfig.tokenizer_path = {path!r}: {e}") from None
    boundary.for_tokenizer(cfg.data.document_boundary, tokenizer)
    return tokenizer


def resolve_vocab(cfg: TrainConfig, tokenizer=None) -> TrainConfig:
    """``cfg`` with ``ModelConfig.vocab_size`` resolved: 0 means "the tokenizer's vocabulary".

    The one place the vocabulary is resolved. ``tokenizer`` (a loaded tokenizer) is used when given;
    otherwise it is loaded from ``DataConfig.tokenizer_path`` only when ``vocab_size`` is 0.

    Raises:
      ConfigError: ``vocab_size`` is 0 and the tokenizer file is missing, or a non-zero ``vocab_size`` is
        smaller than the tokenizer's vocabulary (token ids would index past the embedding table).
    """
    m = cfg.model
    if tokenizer is None and m.vocab_size > 0:
        return cfg
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg)
    vocab = tokenizer.vocab_size
    if m.vocab_size == 0:
        m = dataclasses.replace(m, vocab_size=vocab)
    elif m.vocab_size < vocab:
        raise ConfigError(f"ModelConfig.vocab_size = {m.vocab_size} is smaller than the tokenizer's "
                          f"{vocab} pieces ({cfg.data.tokenizer_path}); set it to 0 to follow the tokenizer")
    return dataclasses.replace(cfg, model=m)


def check_paths(cfg: TrainConfig) -> None:
    """Every input path of the run exists and the workdir can be one.

    Raises:
      ConfigError: naming the key and the path: a ``DataConfig.train_path`` that names no file (jsonl source), a
        ``DataConfig.corpus_dir`` that is not a corpus version (corpus source), or a ``TrainConfig.workdir``
        that is a file. (The tokenizer and held-out set are checked as they are loaded.)
    """
    d = cfg.data
    for key, p in (("TrainConfig.workdir", cfg.workdir), ("DataConfig.train_path", d.train_path),
                   ("DataConfig.corpus_dir", d.corpus_dir), ("DataConfig.tokenizer_path", d.tokenizer_path),
                   ("DataConfig.heldout_path", d.heldout_path)):
        _check_reachable(key, p)
    if d.source == "jsonl" and not documents.expand(d.train_path):
        raise ConfigError(f"DataConfig.train_path = {d.train_path!r}: " + (
            "no file matches" if documents.is_pattern(d.train_path) else "no such file") + (
            " (run `python -m jaxpt.data.prepare --output artifacts/sample` first)"
            if d.train_path == DEFAULT_TRAIN_PATH else " (a JSON Lines file of your documents, one object with a "
            "string 'text' per line, or a glob of such files; `python -m jaxpt.data.prepare --source FILES "
            "--output DIR` splits them and trains a tokenizer)"))
    if d.source == "corpus" and not corpus.is_corpus_version(d.corpus_dir):
        raise ConfigError(f"DataConfig.corpus_dir = {d.corpus_dir!r}: not a corpus version directory "
                          "(no mixture.json; build one with `python -m data_pipelines.build`)")
    if fs.isfile(cfg.workdir):
        raise ConfigError(f"TrainConfig.workdir = {cfg.workdir!r}: a file, not a directory")
    fs.check_private_dir(cfg.workdir, "TrainConfig.workdir")  # what it resumes and loads must be this user's
    fs.check_private_dir(fs.join(cfg.workdir, "checkpoints"), "TrainConfig.workdir's checkpoints folder")
    cache = compile_cache.resolve_cache_dir(cfg.compilation_cache_dir, cfg.workdir)
    if cache is not None:  # a compilation cache is code the run loads
        fs.check_private_dir(cache, compile_cache.setting_name(cfg.compilation_cache_dir))


def _check_reachable(key: str, path: str) -> None:
    """An object-storage path (``gs://...``) whose bucket cannot be reached (no credentials, no network, a
    wrong emulator address) is a ConfigError naming ``key`` and the way out, not a library traceback."""
    if not path or not fs.is_remote(path):
        return
    try:
        fs.exists(path)
    except Exception as e:  # noqa: BLE001 - any client failure here means "cannot reach the bucket"
        cause = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        raise ConfigError(f"{key} = {path!r}: cannot reach object storage ({cause}); give this machine "
                          "credentials (`gcloud auth application-default login`, or a service account on the VM), or "
                          "point STORAGE_EMULATOR_HOST at an emulator") from e


def check_mixture_groups(cfg: TrainConfig) -> None:
    """Every group named by ``DataConfig.mixture_weights`` / ``mixture_schedule`` has documents in the training
    data (a ``'domain'`` group: that domain; ``'domain/source'``: that source of the domain), checked before
    anything is written or compiled. A corpus version is checked by its ``mixture.json`` domains; a source group
    of a corpus version is checked when its records are read (reading every record's source is the loader's
    job).

    Raises:
      ConfigError: as :func:`jaxpt.data.mixture.assign_groups`, naming the key, the group and what exists.
    """
    schedule = mixture.schedule_from_config(cfg.data)
    if schedule is None:
        return
    key = mixture.config_key(cfg.data)
    groups = mixture.group_names(schedule)
    if cfg.data.source == "corpus":
        domains = list(corpus.read_mixture(cfg.data.corpus_dir)["weights"])
        mixture.assign_groups(domains, [""] * len(domains), sorted({g.split("/", 1)[0] for g in groups}), key)
        return
    docs = documents.read_documents(cfg.data.train_path)
    mixture.assign_groups([str(d.get("domain", "")) for d in docs], [str(d.get("source", "")) for d in docs],
                          groups, key)


def plan(r: Resolved, devices: Sequence[Any] | None = None, device_bytes: int | None = None,
         notes: Sequence[str] = ()) -> dict[str, Any]:
    """What the resolved run will cost, without compiling: parameters, the per-device memory estimate of
    :func:`jaxpt.training.memory.estimate_memory` (against ``device_bytes``, else the device's memory when the runtime
    reports it), tokens per step, steps and tokens left to train, and the held-out tokens scored by each full
    evaluation. ``devices``: those :func:`resolve` planned for (default ``jax.devices()``); ``notes``: more notes."""
    c = r.cfg
    devices = list(jax.devices() if devices is None else devices)
    if device_bytes is None:
        try:
            device_bytes = (devices[0].memory_stats() or {}).get("bytes_limit")
        except Exception:  # some backends (CPU, compile-only devices) report no memory statistics
            device_bytes = None
    mem = memory_lib.estimate_memory(c, r.sizes, device_bytes)
    tokens_per_step = c.global_batch_size * c.seq_len
    ramp = batch_ramp.from_config(c)  # a batch-size ramp's steps before the full batch hold fewer tokens
    start, parent = r.lineage.start_step, r.lineage.parent
    return {"workdir": fs.absolute(c.workdir), "mesh": mesh_lib.format_mesh(r.sizes),
            "devices": {"count": len(devices), "kind": devices[0].device_kind},
            "params": count_params(c.model)["total"], "vocab_size": c.model.vocab_size,
            "parametrization": parametrization.describe(c.model),
            "memory_per_device": mem.as_dict(), "tokens_per_step": tokens_per_step,
            "resume_step": start, "target_steps": c.steps, "steps_to_train": c.steps - start,
            "tokens_to_train": (ramp.rows_through(c.steps) - ramp.rows_through(start)) * c.seq_len,
            **({"stage_parent": parent.spec} if parent is not None else {}),
            **({"stage_data": f"{r.data_start.choice} ({r.data_start.note})"} if r.data_start is not None else {}),
            "heldout_tokens": int(sum(w.num_scored for w in r.heldout_set.windows)),
            "data_source": c.data.corpus_dir if c.data.source == "corpus" else c.data.train_path,
            "tokenizer_sha256": r.tokenizer.sha256, "notes": [*r.notes, *_vocab_notes(c, r.tokenizer),
                                                          *parametrization.notes(c.model), *notes]}


#: Model vocabulary rows past the tokenizer's pieces that pass as padding (a table rounded up for sharding).
VOCAB_PADDING = 1024


def _vocab_notes(cfg: TrainConfig, tokenizer) -> list[str]:
    """A note when the model's vocabulary is far larger than the tokenizer's (a model preset's own vocabulary kept
    over a data config's ``vocab_size = 0``, say, by the order of ``--config`` files): rows no token id reaches."""
    extra = cfg.model.vocab_size - tokenizer.vocab_size
    if extra <= VOCAB_PADDING:
        return []
    return [f"ModelConfig.vocab_size = {cfg.model.vocab_size:,} but the tokenizer ({cfg.data.tokenizer_path}) has "
            f"{tokenizer.vocab_size:,} pieces: {extra:,} embedding rows no token uses; bind ModelConfig.vocab_size = "
            "0 (after the model's config file) to follow the tokenizer"]


def format_plan(p: dict[str, Any]) -> str:
    """The :func:`plan` as lines of text."""
    mem = p["memory_per_device"]
    fits = {None: "device memory unknown", True: "fits", False: "DOES NOT FIT"}[mem["fits"]]
    lines = [f"dry run: every check passed; nothing compiled, nothing written ({p['workdir']})",
             f"  mesh {p['mesh']} over {p['devices']['count']} x {p['devices']['kind']}",
             f"  params {p['params']:,} (vocabulary {p['vocab_size']:,}; {p['parametrization']})",
             f"  memory per device (estimate, a floor): {mem['total'] / 2 ** 30:.3f} GiB ({fits})",
             f"  tokens per step {p['tokens_per_step']:,}; steps {p['resume_step']} -> {p['target_steps']} "
             f"({p['steps_to_train']:,} steps, {p['tokens_to_train']:,} tokens)",
             f"  held-out tokens per full evaluation {p['heldout_tokens']:,}"]
    if "stage_parent" in p:
        lines.append(f"  a new stage from {p['stage_parent']} (jaxpt.run.lineage)"
                     + (f"; data: {p['stage_data']}" if "stage_data" in p else ""))
    if "target" in p:
        t = p["target"]
        lines.insert(1, f"  target {t['topology']}: {t['chips']} chips in {t['num_slices']} slice(s), planned from this "
                        "host (compile it with python -m jaxpt.tools.compile --topology ...)")
    return "\n".join(lines + [f"  note: {n}" for n in p["notes"]])
