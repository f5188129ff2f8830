"""Checks before anything is created or compiled, and the plan ``python -m jaxpt.train --dry_run`` prints.

:func:`check` is what :func:`jaxpt.run.session.run_training` runs first, before it creates the workdir or compiles
anything, so a bad input costs seconds, not a booked slice: the config across its parts and against the devices
(:func:`jaxpt.config.validate`), every input path (training data, tokenizer, held-out set, with a token to score),
and the resume target: the newest committed checkpoint of the workdir must be of this model, tokenizer and data
layout, its saved settings must pass :func:`jaxpt.checkpoint.check_saved_config`, and ``TrainConfig.steps`` must
not be below its step. :func:`plan` adds what the run will cost (parameters, per-device memory estimate, tokens
per step and in all), still without compiling.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from jaxpt.training import batch_ramp
from jaxpt.run import build as builder_lib
from jaxpt import config as config_lib
from jaxpt.util import fs
from jaxpt.config import TrainConfig
from jaxpt.util.errors import ConfigError

log = logging.getLogger("jaxpt.run.resolve")


@dataclasses.dataclass
class Preflight:
    """What :func:`check` found.

    Attributes:
      cfg: the config with ``ModelConfig.vocab_size`` resolved from the tokenizer.
      sizes: the resolved mesh sizes ``{axis: size}``.
      tokenizer: the run's loaded tokenizer.
      heldout_docs, heldout_set: the held-out documents and all their scoring windows.
      resume_step: the newest committed checkpoint's step (0: none, the run starts fresh).
      resume_meta: that checkpoint's ``meta`` item ({} when none).
      notes: saved settings ignored, and settings changed since the checkpoint (reported, not refused).
      parent: the checkpoint a new stage starts from (``TrainConfig.init_from``, :class:`jaxpt.run.lineage.Parent`);
        None when the run resumes its own checkpoint or starts from scratch.
    """

    cfg: TrainConfig
    sizes: dict[str, int]
    tokenizer: Any
    heldout_docs: list
    heldout_set: Any
    resume_step: int = 0
    resume_meta: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    parent: Any = None

    @property
    def nothing_to_do(self) -> bool:
        """The newest checkpoint is already at ``TrainConfig.steps``."""
        return self.resume_step > 0 and self.resume_step == self.cfg.steps


def check_paths(cfg: TrainConfig) -> None:
    """Every input path of the run exists and the workdir can be one.

    Raises:
      ConfigError: naming the key and the path: a missing ``DataConfig.train_path`` (sample source), a
        ``DataConfig.corpus_dir`` that is not a corpus version (corpus source), or a ``TrainConfig.workdir``
        that is a file. (The tokenizer and held-out set are checked as they are loaded.)
    """
    from jaxpt.data import corpus
    d = cfg.data
    for key, p in (("TrainConfig.workdir", cfg.workdir), ("DataConfig.train_path", d.train_path),
                   ("DataConfig.corpus_dir", d.corpus_dir), ("DataConfig.tokenizer_path", d.tokenizer_path),
                   ("DataConfig.heldout_path", d.heldout_path)):
        _check_reachable(key, p)
    if d.source == "sample" and not fs.isfile(d.train_path):
        raise ConfigError(f"DataConfig.train_path = {d.train_path!r}: no such file "
                          "(run `python -m jaxpt.data.prepare --output artifacts/sample` first)")
    if d.source == "corpus" and not corpus.is_corpus_version(d.corpus_dir):
        raise ConfigError(f"DataConfig.corpus_dir = {d.corpus_dir!r}: not a corpus version directory "
                          "(no mixture.json; build one with `python -m data_pipelines.build`)")
    if fs.isfile(cfg.workdir):
        raise ConfigError(f"TrainConfig.workdir = {cfg.workdir!r}: a file, not a directory")


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


def check_resume(cfg: TrainConfig, tokenizer) -> tuple[int, dict, list[str]]:
    """The resume target: ``(newest committed step or 0, its meta, notes)``; reads, never writes.

    Raises:
      ConfigError: ``TrainConfig.steps`` is below the newest checkpoint's step (training cannot go back).
      CheckpointError: the checkpoint is of another model (:func:`jaxpt.checkpoint.check_compatible`), another
        tokenizer or data-shard count, or saves an unknown setting that changes numerics.
    """
    from jaxpt import checkpoint as ckpt_lib
    directory = fs.join(cfg.workdir, "checkpoints")
    if not cfg.checkpoint.enabled or not fs.isdir(directory):
        return 0, {}, []
    ckpt = ckpt_lib.Checkpointer(cfg.workdir, cfg.checkpoint, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is None:
            return 0, {}, []  # only leftovers: Checkpointer.resume decides (start over, or refuse junk)
        if cfg.steps < step:
            raise ConfigError(f"TrainConfig.steps = {cfg.steps} is below step {step} of the newest checkpoint in "
                              f"{ckpt.directory}: training cannot go back; pass --steps above {step}, or another "
                              "--workdir")
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    where = f"{ckpt.directory}/{step}"
    notes = [f"ignored saved setting {s}" for s in ckpt_lib.check_saved_config(meta, where)]
    ckpt_lib.check_compatible(meta, cfg.model, where)
    saved_tok = (meta.get("tokenizer") or {}).get("sha256")
    if saved_tok and saved_tok != tokenizer.sha256:
        raise ckpt_lib.CheckpointError(f"{where} was trained with tokenizer sha256 {saved_tok[:12]}, this run uses "
                                       f"{tokenizer.sha256[:12]} (DataConfig.tokenizer_path)")
    shards = meta.get("data_shards")
    if shards and cfg.data.num_shards and shards != cfg.data.num_shards:
        raise ckpt_lib.CheckpointError(f"{where} has {shards} data shards, DataConfig.num_shards = "
                                       f"{cfg.data.num_shards} (it must stay fixed for a run)")
    _check_ramp_unchanged(meta, cfg, where)
    return step, meta, notes + changed_settings(meta, cfg)


def _check_ramp_unchanged(meta: dict, cfg: TrainConfig, where: str) -> None:
    """A batch-size ramp cannot change at a resume: the data iterator's saved position counts loader batches
    whose size comes from the ramp (:mod:`jaxpt.training.batch_ramp`), so another ramp would read from a wrong position.

    Raises:
      CheckpointError: naming ``TrainConfig.batch_size_schedule``, both values and the way out.
    """
    from jaxpt import checkpoint as ckpt_lib
    key = "TrainConfig.batch_size_schedule"
    saved = ckpt_lib.saved_settings({"config_gin": meta.get("config_gin")}).get(key, "")
    saved = saved.strip("'\"") if isinstance(saved, str) else saved
    if (saved or cfg.batch_size_schedule) and saved != cfg.batch_size_schedule:
        raise ckpt_lib.CheckpointError(
            f"{where} was trained with {key} = {saved!r}, this run sets {cfg.batch_size_schedule!r}: the data "
            "iterator's position counts batches of the ramp's sizes, so a run cannot change its ramp at a resume "
            "(keep the saved schedule, or start a new stage from this checkpoint with TrainConfig.init_from)")


def changed_settings(meta: dict, cfg: TrainConfig) -> list[str]:
    """Settings that change numerics and differ between the checkpoint's saved config and ``cfg`` (reported on
    resume: a deliberate change, such as a new learning rate, is allowed, but never silent)."""
    from jaxpt import checkpoint as ckpt_lib
    saved = ckpt_lib.saved_settings({"config_gin": meta.get("config_gin")})
    now = ckpt_lib.saved_settings({"config_gin": config_lib.operative_config_str(cfg)})
    return [f"changed since the checkpoint: {k} = {saved[k]!r} -> {now[k]!r}" for k in sorted(now)
            if k in saved and not config_lib.is_bookkeeping(k) and k != "ModelConfig.vocab_size"
            and not ckpt_lib.same_value(saved[k], now[k])]


def check(cfg: TrainConfig) -> Preflight:
    """Every check of the module docstring, in order; creates and compiles nothing.

    Raises:
      ConfigError: naming the key, file or line (exit 2).
      CheckpointError: the resume target cannot continue this run (exit 3).
    """
    from jaxpt.eval import inloop
    sizes = config_lib.validate(cfg, jax.device_count())
    check_paths(cfg)
    check_mixture_groups(cfg)
    docs = inloop.load_heldout(cfg)  # a missing or malformed held-out set fails now, not after the last step
    tokenizer = builder_lib.load_tokenizer(cfg)
    resolved = builder_lib.resolve_vocab(cfg, tokenizer)
    hset = inloop.heldout_set(resolved, docs, tokenizer)
    step, meta, notes = check_resume(resolved, tokenizer)
    resolved, parent, stage_notes = check_stage(resolved, tokenizer, step, meta)
    notes = notes + stage_notes
    for note in notes:
        log.warning("%s", note)
    return Preflight(resolved, sizes, tokenizer, docs, hset, step, meta, notes, parent)


def check_mixture_groups(cfg: TrainConfig) -> None:
    """Every group named by ``DataConfig.mixture_weights`` / ``mixture_schedule`` has documents in the training
    data (a ``'domain'`` group: that domain; ``'domain/source'``: that source of the domain), checked before
    anything is written or compiled. A corpus version is checked by its ``mixture.json`` domains; a source group
    of a corpus version is checked when its records are read (reading every record's source is the loader's
    job).

    Raises:
      ConfigError: as :func:`jaxpt.data.mixture.assign_groups`, naming the key, the group and what exists.
    """
    from jaxpt.data import corpus, documents, mixture
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


def check_stage(cfg: TrainConfig, tokenizer, resume_step: int, resume_meta: dict):
    """``(cfg with TrainConfig.init_from resolved to '<abs dir>@<step>', parent or None, notes)``.

    A run resuming its own checkpoint must name the parent that checkpoint records (or none);
    a new stage's parent is found and checked (:func:`jaxpt.run.lineage.find_parent`), and the settings changed since
    it are noted. The schedule is checked again against the stage's horizon.

    Raises:
      ConfigError, CheckpointError: as :func:`jaxpt.run.lineage.check_resumed_stage` and :func:`jaxpt.run.lineage.find_parent`.
    """
    from jaxpt.run import lineage as stage_lib
    from jaxpt.training.optim import check_schedule
    parent, notes = None, []
    if resume_step:
        where = fs.join(fs.absolute(cfg.workdir), "checkpoints", str(resume_step))
        init_from = stage_lib.check_resumed_stage(cfg, resume_meta, where)
    elif cfg.init_from:
        parent = stage_lib.find_parent(cfg, tokenizer.sha256)
        init_from = parent.spec
    else:
        return cfg, None, []
    cfg = dataclasses.replace(cfg, init_from=init_from)
    check_schedule(cfg.optimizer, cfg.steps - stage_lib.start_step(cfg))
    if parent is not None:
        changed = [n.split(": ", 1)[1] for n in changed_settings(parent.meta, cfg)
                   if "TrainConfig.init_from" not in n]
        parent = dataclasses.replace(parent, changed=tuple(changed))
        notes = [f"stage {cfg.stage_name or 'extension'} from {parent.spec} changes {c}" for c in changed]
    return cfg, parent, notes


def plan(cfg: TrainConfig) -> dict[str, Any]:
    """:func:`check`, then what the run will cost, without compiling: parameters, the per-device memory estimate
    of :func:`jaxpt.training.memory.estimate_memory` (against the device's memory when the runtime reports it), tokens
    per step, steps and tokens left to train, and the held-out tokens scored by each full evaluation.

    Raises: as :func:`check`.
    """
    from jaxpt import mesh as mesh_lib
    from jaxpt.model.decoder import count_params
    from jaxpt.training import memory as memory_lib
    pre = check(cfg)
    c = pre.cfg
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends (CPU) report no memory statistics
        stats = {}
    mem = memory_lib.estimate_memory(c, pre.sizes, stats.get("bytes_limit"))
    tokens_per_step = c.global_batch_size * c.seq_len
    ramp = batch_ramp.from_config(c)  # a batch-size ramp's steps before the full batch hold fewer tokens
    start = pre.resume_step or (pre.parent.step if pre.parent is not None else 0)  # a new stage: its parent's step
    return {"workdir": fs.absolute(c.workdir), "mesh": mesh_lib.format_mesh(pre.sizes),
            "devices": {"count": jax.device_count(), "kind": jax.devices()[0].device_kind},
            "params": count_params(c.model)["total"], "vocab_size": c.model.vocab_size,
            "memory_per_device": mem.as_dict(), "tokens_per_step": tokens_per_step,
            "resume_step": start, "target_steps": c.steps, "steps_to_train": c.steps - start,
            "tokens_to_train": (ramp.rows_through(c.steps) - ramp.rows_through(start)) * c.seq_len,
            **({"stage_parent": pre.parent.spec} if pre.parent is not None else {}),
            "heldout_tokens": int(sum(w.num_scored for w in pre.heldout_set.windows)),
            "data_source": c.data.corpus_dir if c.data.source == "corpus" else c.data.train_path,
            "tokenizer_sha256": pre.tokenizer.sha256, "notes": pre.notes}


def last_final(workdir: str, step: int) -> dict[str, Any]:
    """The last ``final`` record of ``<workdir>/metrics.jsonl`` (what a run already at its target step returns),
    or ``{"step": step, "event": "nothing_to_do"}`` when there is none."""
    from jaxpt.run import monitor
    path = monitor.metrics_path(workdir)
    finals = [r for r in monitor.read_metrics(workdir) if r.get("event") == "final"] if fs.exists(path) else []
    return finals[-1] if finals else {"step": step, "event": "nothing_to_do"}


def format_plan(p: dict[str, Any]) -> str:
    """The :func:`plan` as lines of text."""
    mem = p["memory_per_device"]
    fits = {None: "device memory unknown", True: "fits", False: "DOES NOT FIT"}[mem["fits"]]
    lines = [f"dry run: every check passed; nothing compiled, nothing written ({p['workdir']})",
             f"  mesh {p['mesh']} over {p['devices']['count']} x {p['devices']['kind']}",
             f"  params {p['params']:,} (vocabulary {p['vocab_size']:,})",
             f"  memory per device (estimate, a floor): {mem['total'] / 2 ** 30:.3f} GiB ({fits})",
             f"  tokens per step {p['tokens_per_step']:,}; steps {p['resume_step']} -> {p['target_steps']} "
             f"({p['steps_to_train']:,} steps, {p['tokens_to_train']:,} tokens)",
             f"  held-out tokens per full evaluation {p['heldout_tokens']:,}"]
    if "stage_parent" in p:
        lines.append(f"  a new stage from {p['stage_parent']} (jaxpt.run.lineage)")
    return "\n".join(lines + [f"  note: {n}" for n in p["notes"]])
