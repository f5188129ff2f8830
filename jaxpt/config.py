"""Configuration: gin files and flags -> one typed, validated :class:`TrainConfig`.

Gin usage is T5X-style. Each config dataclass is a gin configurable under its own name::

    ModelConfig.d_model = 256
    OptimizerConfig.peak_learning_rate = 3e-3
    TrainConfig.global_batch_size = 16
    TrainConfig.mesh = 'data=2,fsdp=2,tensor=2'

``--config FILE`` may repeat (later files win), then the plain flags (``--workdir``, ``--steps``, ``--mesh``)
are applied as bindings, then every ``--gin 'BINDING'`` (applied last, so it wins over everything).

Every config dataclass checks its own fields when it is built (types, ``Literal`` choices, ranges; see
:mod:`jaxpt.util.validation`), so :func:`parse` already refuses ``ModelConfig.compute_dtype = 'float8'``, raising
:class:`ConfigError` naming the offending key (a misspelled one with :func:`did_you_mean`'s suggestion). What needs
two configs or the devices is checked by :func:`jaxpt.run.validate.validate`, once per start.

This module holds gin, the config dataclasses (:class:`TrainConfig`, :class:`DataConfig`, :class:`HeldoutEvalConfig`,
and the registration of the others, which live with their owners), the flags every program shares, the operative
config a run writes (:func:`operative_config_str`), and the reading of a config saved in a checkpoint
(:func:`saved_settings`, :func:`check_saved_config`, :func:`changed_settings`). It reads no device, checkpoint or
data file, and never touches ``jax.distributed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import logging
import re
import typing
from typing import Any, Literal, Sequence

import gin
from gin import config_parser

from jaxpt import mesh as mesh_lib
from jaxpt.checkpoint import CheckpointConfig
from jaxpt.data import boundary as boundary_lib, mixture as mixture_lib
from jaxpt.model.config import ModelConfig
from jaxpt.training import batch_ramp
from jaxpt.training.optim import OptimizerConfig
from jaxpt.training.stability import StabilityConfig
from jaxpt.util import cli, fs
from jaxpt.util.errors import CheckpointError, ConfigError
from jaxpt.util.validation import check_types, field_error, non_negative, positive, require

log = logging.getLogger("jaxpt.config")

#: Groupings of held-out figures: by document domain, by language, and by both.
GROUPINGS = ("domain", "lang", "domain_lang")


@dataclasses.dataclass(frozen=True)
class HeldoutEvalConfig:
    """In-loop per-group held-out evaluation (:mod:`jaxpt.eval.inloop`).

    Attributes:
      enabled: add the per-group figures to every held-out evaluation of the loop.
      group_by: groupings to report (``domain``, ``lang``, ``domain_lang``; :data:`GROUPINGS`).
      source: held-out source (file or corpus directory); '' = ``DataConfig.heldout_path`` (or ``corpus_dir``).
      stride: new tokens per later window of a long document; 0 = ``seq_len // 2``.

    Raises:
      ConfigError: at construction, naming ``HeldoutEvalConfig.<field> = <value>``: a wrong type, a grouping
        not in :data:`GROUPINGS`, or a negative ``stride``.
    """

    enabled: bool = False
    group_by: tuple[str, ...] = ("domain", "lang")
    source: str = ""
    stride: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "group_by", set(self.group_by) <= set(GROUPINGS), f"each grouping must be one of {GROUPINGS}")
        non_negative(self, "stride")


def parse_init_from(text: str) -> tuple[str, int | None]:
    """``TrainConfig.init_from``: ``'dir@200'`` -> ``('dir', 200)``; ``'dir'`` -> ``('dir', None)``; ``''`` ->
    ``('', None)``. A trailing ``/checkpoints`` is dropped (the run directory is what is meant).

    Raises:
      ValueError: a step that is not a positive integer.
    """
    if not text:
        return "", None
    path, sep, step = text.rpartition("@")
    if not sep:
        path, step_n = text, None
    else:
        if not step.isdigit() or int(step) < 1:
            raise ValueError(f"'@{step}' is not a step (a positive integer)")
        step_n = int(step)
    path = path.rstrip("/")
    if fs.basename(path) == "checkpoints":
        path = fs.dirname(path)
    return path, step_n


def start_step(cfg) -> int:
    """The global step the run's stage starts from: the ``@step`` of ``TrainConfig.init_from`` (resolved to the
    parent's step by :mod:`jaxpt.run.lineage`), else 0. The learning-rate schedule's horizon is
    ``TrainConfig.steps`` minus it."""
    return (parse_init_from(cfg.init_from)[1] or 0) if cfg.init_from else 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training and held-out text come from.

    Attributes:
      source: ``jsonl`` (documents in JSON Lines files: ``train_path`` and ``heldout_path``, one object with a
        string ``text`` per line, plain, gzip or zstd; what ``python -m jaxpt.data.prepare`` writes; ``sample``,
        its old name, is read as ``jsonl``) or ``corpus`` (a corpus version built by ``data_pipelines.build``).
      train_path: the training documents (``source='jsonl'``): a JSON Lines file or a glob of them (read in
        sorted order), e.g. ``'data/mine/*.jsonl.gz'``.
      heldout_path: the held-out documents for the held-out loss (``source='jsonl'``; a file or a glob; a corpus
        run uses its corpus version's own held-out split, ``<corpus_dir>/heldout/``).
      tokenizer_path: the tokenizer: a SentencePiece model (``tokenizer.model``) or a Hugging Face
        ``tokenizer.json`` (a base model's, with its ``config.json`` / ``tokenizer_config.json`` beside it naming the
        special tokens); the backend is picked from the file (:meth:`jaxpt.data.tokenizer.Tokenizer.load`).
      corpus_dir: a corpus version directory (``source='corpus'``).
      shuffle: shuffle documents (seeded by ``TrainConfig.seed``; a new order each epoch).
      document_boundary: the special tokens around every document, in training and held-out evaluation
        (:mod:`jaxpt.data.boundary`): ``'eos'`` (``text EOS``, the default), ``'bos_eos'`` (``BOS text EOS``, the
        Llama and Mistral convention, which a converted model's ``model.gin`` sets), ``'bos'`` or ``'none'``.
      add_eos: deprecated (use ``document_boundary``); ``False`` removes EOS from ``document_boundary``
        (``'eos'`` -> ``'none'``, ``'bos_eos'`` -> ``'bos'``), as it used to stop appending EOS, so configs and
        checkpoints written before ``document_boundary`` read as they were; ``True`` (the default) changes nothing.
      num_shards: logical data shards (independent pipelines) the global batch is made of; each process
        runs a contiguous block of them. 0: the largest divisor of the global batch (of a batch-size ramp's
        smallest unit) up to 256 (:func:`jaxpt.data.stream.default_shard_count`), recorded in checkpoints. Fixed for
        a run, so a resume on another process count that divides it (more processes or fewer) continues exactly
        (see :mod:`jaxpt.data.shards`).
      mixture_weights: ``(('group', weight), ...)``: the share of the training *tokens* each group gets
        (:mod:`jaxpt.data.mixture`); a group is a domain (``'code'``) or a domain's source, its finer quality
        tier (``'reference/dict-foldoc'``). Normalized; a group left out or at 0 is not read. Both sources:
        the corpus version's ``mixture.json`` weights are replaced, the sample's documents are grouped by their
        ``domain``/``source`` fields. Empty: the corpus's own weights; the sample in its natural proportion.
      mixture_schedule: staged mixtures ``((start_step, (('group', weight), ...)), ...)``: from global step
        ``start_step`` (1-based; the first stage at 1) on, that stage's weights, e.g. a high-quality mixture for
        the decay phase of WSD. Excludes ``mixture_weights``. Recorded in run.json; realized token shares per
        stage are logged (``mixture/...`` in metrics.jsonl).
      long_doc_min_chars, long_doc_weight: a length mixture for ``source='jsonl'`` (e.g. a long-context stage
        upweighting long documents): with ``long_doc_weight`` > 0, each next document is one of at least
        ``long_doc_min_chars`` characters with probability ``long_doc_weight``, else a shorter one
        (:func:`jaxpt.data.loader.make_train_dataset`); 0: the file's natural proportion.

    Raises:
      ConfigError: at construction, naming ``DataConfig.<field> = <value>``: a wrong type, an unknown
        source, a negative ``num_shards``, or ``source='corpus'`` without a ``corpus_dir``; a
        ``long_doc_weight`` outside [0, 1], or above 0 without ``long_doc_min_chars``; a non-positive
        ``mixture_weights`` / ``mixture_schedule`` that is malformed, has a negative, NaN or infinite weight, or
        weights all 0 (naming the group), or both set. A group the data does not have is refused when the stream
        is built (naming the key and the domains that exist).
    """

    source: Literal["jsonl", "sample", "corpus"] = "jsonl"
    train_path: str = "artifacts/sample/train.jsonl.gz"
    heldout_path: str = "artifacts/sample/heldout.jsonl.gz"
    tokenizer_path: str = "artifacts/sample/tokenizer.model"
    corpus_dir: str = ""
    shuffle: bool = True
    document_boundary: Literal["eos", "bos", "bos_eos", "none"] = "eos"
    add_eos: bool = True
    num_shards: int = 0
    mixture_weights: tuple = ()
    mixture_schedule: tuple = ()
    long_doc_min_chars: int = 0
    long_doc_weight: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)
        if self.source == "sample":  # the old name of 'jsonl': one value in configs, records and comparisons
            object.__setattr__(self, "source", "jsonl")
        if not self.add_eos:  # the deprecated switch: folded into the policy (one value everywhere after this)
            object.__setattr__(self, "document_boundary", boundary_lib.strip_eos(self.document_boundary))
        non_negative(self, "num_shards", "long_doc_min_chars")
        require(self, "long_doc_weight", 0.0 <= self.long_doc_weight <= 1.0, "must be in [0, 1]")
        require(self, "long_doc_min_chars", self.long_doc_weight == 0 or self.long_doc_min_chars > 0,
                "must be > 0 when DataConfig.long_doc_weight > 0 (it splits long from short documents)")
        require(self, "mixture_schedule", not (self.mixture_schedule and self.mixture_weights),
                "set it or DataConfig.mixture_weights, not both (a one-stage schedule is mixture_weights)")
        mixture_lib.schedule_from_config(self)  # ConfigError naming the key and the group
        require(self, "mixture_schedule", not any(isinstance(e[1], dict) for e in self.mixture_schedule),
                "write each stage's weights as (('group', weight), ...), not a dict (configs stay hashable)")
        require(self, "long_doc_weight", not (self.long_doc_weight and (self.mixture_weights or self.mixture_schedule)),
                "a length mixture cannot be combined with DataConfig.mixture_weights / mixture_schedule")
        require(self, "corpus_dir", self.source != "corpus" or bool(self.corpus_dir),
                "must be set when DataConfig.source = 'corpus'")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. Nested configs are built from their own gin bindings.

    Attributes:
      model: the model's shape and numerics (:class:`jaxpt.model.config.ModelConfig`).
      optimizer: AdamW and the learning-rate schedule (:class:`jaxpt.training.optim.OptimizerConfig`).
      data: where training and held-out text come from (:class:`DataConfig`).
      checkpoint: when to save and what to keep (:class:`jaxpt.checkpoint.CheckpointConfig`).
      stability: spike skipping and divergence rollback (:class:`jaxpt.training.stability.StabilityConfig`).
      heldout_eval: the loop's per-domain held-out figures (:class:`HeldoutEvalConfig`).
      mesh: mesh sizes, e.g. ``'data=2,fsdp=2,tensor=2'``; one axis may be -1 (the remaining devices).
        With ``dcn_mesh`` set, these are the sizes *within* a slice (ICI). An axis of size > 1 must be
        used by some ``logical_axis_rules`` entry (:func:`validate`).
      dcn_mesh: sizes *across* slices (data-center network), e.g. ``'data=4'`` for data parallelism over 4
        slices; empty for a single slice. The full mesh is their product per axis, built by
        :func:`jaxpt.mesh.mesh_from_config`.
      logical_axis_rules: ``((logical_axis, mesh_axis or tuple or None), ...)``, first match wins.
      global_batch_size: rows per step over all processes.
      grad_accum_steps: micro-batches per step (gradient accumulation); the loss is normalized by the
        global batch's target tokens, so this changes memory, not math.
      seq_len: tokens per row.
      steps: the global step to train up to.
      seed: seeds params, data order and the RNG carried in the train state.
      z_loss_weight: weight of the z-loss ``log(Z)^2`` (PaLM, Chowdhery et al. 2022, sec. 5); 0 disables.
      log_every: steps between metric records.
      eval_every: steps between held-out evaluations (0: only at the end).
      eval_batches: held-out batches per in-loop evaluation (0: the whole held-out set); the final evaluation
        always scores the whole held-out set, so runs of any ``eval_batches`` compare on it.
      workdir: run directory (metrics, TensorBoard, config.gin, checkpoints).
      progress_bar: show a tqdm bar on the terminal.
      log_batch_documents: append, per step, the indices of the documents in this process's rows to
        ``<workdir>/batches/process_<i>.jsonl`` (an audit trail for resumption and data debugging).
      init_from: start this run as a new *stage* from another run's checkpoint: ``'<run dir>[@step]'`` (the newest
        committed step without ``@step``); params and optimizer state are taken from it (``reset_optimizer``), the
        step count goes on from its step, the learning-rate schedule starts afresh with horizon ``steps - step``,
        and the data stream starts where ``stage_data`` says (:mod:`jaxpt.run.lineage`). Empty: start from scratch
        (or resume this workdir's own checkpoints).
      stage_name: the stage's name in ``run.json`` and checkpoint meta (default ``base``, or ``extension`` with
        ``init_from``).
      reset_optimizer: with ``init_from``: a fresh optimizer state instead of the parent's moments. Default False:
        the parent's Adam moments and their count are carried (a converted model has none: always fresh). The
        learning-rate schedule restarts either way; its re-warmup is ``OptimizerConfig.warmup_steps``, counted from
        the stage's start (0: the stage starts at the peak).
      stage_data: with ``init_from``: where the stage's data stream starts (:func:`jaxpt.run.lineage.data_start`).
        ``'continue'``: the parent checkpoint's data-iterator state is carried, so the stage reads on from where the
        parent stopped (its data version, seed, order settings and logical data shards must be the parent's);
        ``'fresh'``: the stage's data from its start, for data other than the parent's (refused on the parent's own
        data version, where it would re-read the parent's documents); ``'replay'``: the stage's data from its start
        even though it is the parent's: the documents the parent trained on come again (in the same order when the
        order settings are the same). Default ``'auto'``: ``'continue'`` when the stage's data version is the
        parent's, ``'fresh'`` when it differs (or the parent is a converted model); refused when the data is the
        parent's but its order changed (seed, shuffle, length mixture, mixture or not), asking for a choice. The
        choice is logged and recorded in the stage's record (run.json, checkpoint meta).
      profile_steps: ``'START:STOP'``: trace steps START..STOP (inclusive) with ``jax.profiler`` into
        ``<workdir>/profile`` (TensorBoard's profile plugin, Perfetto); empty: no trace.
      offload_optimizer_state: keep the optimizer state (Adam moments, counts) in the host's pinned memory
        (``memory_kind="pinned_host"``) between steps; each step copies it to the device for the update and
        back. Moves ~2x the fp32 parameter bytes (per chip: divided by FSDP) out of the persistent device
        state, for host-link traffic each step; whether the step's peak falls depends on where that peak is,
        so check ``python -m jaxpt.tools.compile`` (device and host bytes). A last resort
        (:func:`jaxpt.training.state.make_state_spec`). The same numbers as without it.
      batch_size_schedule: a batch-size ramp, ``'STEP:SIZE,...'``: the global batch from each step on, first
        step 1, sizes not decreasing, the last one ``global_batch_size`` (:mod:`jaxpt.training.batch_ramp`); empty:
        ``global_batch_size`` throughout.
      batch_lr_scaling: with ``batch_size_schedule``, the learning rate at ``B`` rows is the schedule's times
        ``(B / global_batch_size) ** p``: ``sqrt`` (p = 1/2, Malladi et al. 2022 for Adam), ``linear`` (p = 1,
        Goyal et al. 2017) or ``none``.
      shard_optimizer_state: ZeRO-1/2 (Rajbhandari et al. 2020): split the optimizer state over the data-parallel
        mesh axes (those of the ``batch`` and ``length`` rules: ``data``, ``fsdp``, ``expert``, ``sequence``) that a
        param is replicated on; gradients are constrained to those shards, the update runs on ``1/N`` of
        each param per device and the params are all-gathered after it. Per device, the optimizer state of a
        param replicated over ``N`` devices shrinks ``N``-fold (:func:`jaxpt.training.state.zero_sharding`). (Whether the
        gradient all-reduce becomes a reduce-scatter is XLA's choice per backend: on CPU it stays an all-reduce
        followed by slices.) The same
        numbers up to the order of float sums; checkpoints restore across the switch (only shardings differ).
      compilation_cache_dir: the persistent compilation cache, so a restart loads its compiled programs instead of
        recompiling: ``'auto'`` (JAX's own setting, e.g. ``JAX_COMPILATION_CACHE_DIR``, else ``<workdir>/jax_cache``,
        shared by every host of the run), a path, or ``''`` for none (:mod:`jaxpt.run.compile_cache`).

    Raises:
      ConfigError: at construction, naming ``TrainConfig.<field> = <value>``: a wrong type (sub-configs
        included), a malformed ``mesh``/``dcn_mesh`` (unknown axis, non-integer or non-positive size, two
        -1s; -1 at all in ``dcn_mesh``), an unknown axis in ``logical_axis_rules``, a count out of range, an
        ``init_from`` whose ``@step`` is not a positive integer, or ``reset_optimizer`` or ``stage_data`` without
        ``init_from``.
        Checks against the other configs and the devices are :func:`validate`'s.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    stability: StabilityConfig = dataclasses.field(default_factory=StabilityConfig)
    heldout_eval: HeldoutEvalConfig = dataclasses.field(default_factory=HeldoutEvalConfig)
    mesh: str = "data=-1"
    dcn_mesh: str = ""
    logical_axis_rules: tuple = mesh_lib.DEFAULT_RULES
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 256
    steps: int = 300
    seed: int = 0
    z_loss_weight: float = 1e-4
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 0
    workdir: str = "workdirs/default"
    progress_bar: bool = True
    log_batch_documents: bool = False
    profile_steps: str = ""
    init_from: str = ""
    stage_name: str = ""
    reset_optimizer: bool = False
    stage_data: Literal["auto", "continue", "fresh", "replay"] = "auto"
    offload_optimizer_state: bool = False
    batch_size_schedule: str = ""
    batch_lr_scaling: str = "sqrt"
    shard_optimizer_state: bool = False
    compilation_cache_dir: str = "auto"

    def __post_init__(self) -> None:
        check_types(self)
        try:
            parse_init_from(self.init_from)
        except ValueError as e:
            raise field_error(self, "init_from", f"'<run dir>[@step]': {e}") from None
        require(self, "reset_optimizer", self.init_from or not self.reset_optimizer,
                "only means something with TrainConfig.init_from (a stage starting from a checkpoint)")
        require(self, "stage_data", self.init_from or self.stage_data == "auto",
                "only means something with TrainConfig.init_from (a stage starting from a checkpoint)")
        if self.profile_steps:
            try:
                start, stop = (int(x) for x in self.profile_steps.split(":"))
            except ValueError:
                raise field_error(self, "profile_steps", "START:STOP (1-based steps, inclusive), e.g. '20:25'") from None
            require(self, "profile_steps", 1 <= start <= stop, "START:STOP with 1 <= START <= STOP")
            require(self, "profile_steps", stop <= self.steps,
                    f"the window must end by TrainConfig.steps = {self.steps} (a window the run never finishes is "
                    "never measured)")
        positive(self, "global_batch_size", "grad_accum_steps", "seq_len", "steps", "log_every")
        require(self, "batch_lr_scaling", self.batch_lr_scaling in batch_ramp.LR_RULES,
                f"one of {', '.join(batch_ramp.LR_RULES)}")
        if self.batch_size_schedule:
            try:
                batch_ramp.parse_schedule(self.batch_size_schedule)
            except ValueError as e:
                raise field_error(self, "batch_size_schedule", str(e)) from None
        non_negative(self, "z_loss_weight", "eval_every", "eval_batches")
        specs = {}
        for key in ("mesh", "dcn_mesh"):
            try:
                specs[key] = mesh_lib.parse_mesh_spec(getattr(self, key))
            except mesh_lib.MeshError as e:
                raise field_error(self, key, str(e)) from None
        require(self, "dcn_mesh", -1 not in specs["dcn_mesh"].values(),
                "sizes across slices are explicit (their product is the number of slices); -1 is not allowed")
        try:
            mesh_lib.validate_rules(self.logical_axis_rules)
        except ValueError as e:
            raise ConfigError(f"TrainConfig.{e}") from None


#: Every config, registered with gin under its class name (``ModelConfig.d_model = 256``). The dataclasses
#: stay plain Python: only this module knows gin (the model package knows nothing of it).
_GIN = {cls: gin.external_configurable(cls, name=cls.__name__, module="jaxpt")
        for cls in (ModelConfig, OptimizerConfig, DataConfig, CheckpointConfig, StabilityConfig, HeldoutEvalConfig,
                    TrainConfig)}

#: Every config class by its gin name.
CONFIG_CLASSES: dict[str, type] = {cls.__name__: cls for cls in _GIN}

#: Settings that change neither shapes nor numerics of the model or of training (where files go, how often to
#: log, evaluate or save, the device layout; ``None``: every field of that config). Every other setting is
#: taken to change them: :func:`check_saved_config` refuses a checkpoint that has such a
#: setting this version does not know (unless it holds its default), and reports and ignores the others.
BOOKKEEPING: dict[str, frozenset[str] | None] = {
    "CheckpointConfig": None,
    "HeldoutEvalConfig": None,
    # Paths move between machines; the data's identity is the data version and the tokenizer's sha256.
    "DataConfig": frozenset({"train_path", "heldout_path", "tokenizer_path", "corpus_dir"}),
    # The same math, computed another way (recomputed, blockwise, in sequence chunks).
    "ModelConfig": frozenset({"remat_policy", "attention_impl", "fused_projections", "loss_chunk_size",
                              "pipeline_microbatches", "pipeline_repeats"}),
    "TrainConfig": frozenset({"workdir", "steps", "log_every", "eval_every", "eval_batches", "progress_bar",
                              "log_batch_documents", "profile_steps", "mesh", "dcn_mesh", "logical_axis_rules",
                              "grad_accum_steps", "stage_name", "offload_optimizer_state",
                              "shard_optimizer_state", "compilation_cache_dir"}),
}


def is_bookkeeping(key: str) -> bool:
    """Whether setting ``'ClassName.field'`` is in :data:`BOOKKEEPING` (changes no shape or number)."""
    cls, _, name = key.partition(".")
    if cls not in BOOKKEEPING:
        return False
    fields = BOOKKEEPING[cls]
    return fields is None or name in fields


def config_fields() -> dict[str, dict]:
    """``{'ClassName.field': {"default": value, "bookkeeping": bool}}`` for every setting of this version (JSON
    values; sub-config fields of TrainConfig excluded). Checkpoints record it, so a later or earlier jaxpt that
    does not know a setting can tell a harmless one from one that changes numerics."""
    out = {}
    for name, cls in CONFIG_CLASSES.items():
        for f in dataclasses.fields(cls):
            if cls is TrainConfig and f.name in _SUB_CONFIGS:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{name}.{f.name}"] = {"default": json.loads(json.dumps(default)),
                                       "bookkeeping": is_bookkeeping(f"{name}.{f.name}")}
    return out


#: TrainConfig's fields that hold a sub-config (each written under its own class name).
_SUB_CONFIGS = frozenset(f.name for f in dataclasses.fields(TrainConfig)
                         if typing.get_type_hints(TrainConfig)[f.name] in _GIN)

# gin appends "In call to configurable ..." to an exception raised inside a configurable; the key is named
# already, so parse() drops it.
_GIN_CALL_NOTE = "\n  In call to configurable"


def build_config() -> TrainConfig:
    """Instantiate :class:`TrainConfig`, and each sub-config field from its own gin bindings.

    Raises:
      ConfigError: a field check of a config's ``__post_init__`` failed (with gin's call note appended).
    """
    hints = typing.get_type_hints(TrainConfig)
    subs = {f.name: _GIN[hints[f.name]]() for f in dataclasses.fields(TrainConfig) if hints[f.name] in _GIN}
    return _GIN[TrainConfig](**subs)


fs.register_gin_reader()  # --config gs://b/x.gin, include 'gs://b/y.gin'

# ------------------------------------------------------------------------------------------ gin is code

#: Modules a gin file may import (the corpus build's configs name its config classes so). Any other import statement,
#: ``from __gin__ import dynamic_registration`` included, is refused: importing runs a module's code.
GIN_IMPORTS = frozenset({"data_pipelines.config"})
#: The packages whose gin configurables a config may bind: jaxpt's configs and the corpus build's.
GIN_PACKAGES = ("jaxpt", "data_pipelines")
#: Includes deeper than this are refused (a file that includes itself, directly or not).
MAX_GIN_INCLUDE_DEPTH = 16


class _RefusingDelegate(config_parser.ParserDelegate):
    """Parses values as gin does, refusing configurable references (``@name``, ``@name()``): evaluated at build time,
    a reference calls whatever was registered under the name."""

    def __init__(self, where: str):
        self.where = where

    def configurable_reference(self, name, evaluate):
        raise ConfigError(f"{self.where}: the reference @{name}{'()' if evaluate else ''} is refused: a gin "
                          "reference calls registered code; jaxpt's configs bind plain values")

    def macro(self, name):
        return name


def check_gin_text(text: str, where: str, depth: int = 0) -> None:
    """Refuse what would make a gin config run code other than jaxpt's own configs (a gin file is code: gin
    imports modules, registers callables and calls what a reference names): import statements of modules outside
    :data:`GIN_IMPORTS` (``from __gin__ import dynamic_registration`` too), configurable references, and bindings of
    configurables that packages other than :data:`GIN_PACKAGES` registered; included files are checked the same way.
    Plain bindings, macros and includes of checked files pass. Nothing is imported or run by the check.

    Raises:
      ConfigError: naming ``where`` (a file and line, or a binding) and what was refused.
    """
    try:
        statements = list(config_parser.ConfigParser(text, _RefusingDelegate(where)))
    except SyntaxError:
        return  # not gin: gin's own parse reports it, with the file and line
    for st in statements:
        at = f"{where}:{st.location.line_num}" if st.location and st.location.line_num else where
        if isinstance(st, config_parser.ImportStatement):
            if st.module not in GIN_IMPORTS:
                raise ConfigError(f"{at}: `{st.location.line_content.strip()}` is refused: a gin import runs a module's "
                                  f"code (allowed: {', '.join(sorted(GIN_IMPORTS))})")
        elif isinstance(st, config_parser.IncludeStatement):
            if depth >= MAX_GIN_INCLUDE_DEPTH:
                raise ConfigError(f"{at}: include {st.filename!r}: includes nest deeper than {MAX_GIN_INCLUDE_DEPTH}")
            if fs.exists(st.filename):
                check_gin_text(fs.read_text(st.filename), st.filename, depth + 1)
        elif isinstance(st, config_parser.BindingStatement) and st.arg_name:
            match = gin.config._REGISTRY.get_match(st.selector)  # noqa: SLF001  gin's registry has no public lookup
            if match is not None and not match.module.split(".")[0] in GIN_PACKAGES:
                raise ConfigError(f"{at}: binding {st.selector}.{st.arg_name} is refused: {st.selector} is registered "
                                  f"by {match.module}, not by jaxpt's configs")


def parse_gin(config_files: Sequence[str], bindings: Sequence[str]) -> None:
    """Check (:func:`check_gin_text`) and parse gin files, then bindings, into gin's config (cleared first).

    Raises:
      ConfigError: a missing file; a refused statement; a file or binding gin cannot parse (with the file and line, or
        the binding, and :func:`did_you_mean`'s suggestion).
    """
    gin.clear_config()
    for path in config_files:
        if not fs.exists(path):
            raise ConfigError(f"--config {path}: no such file")
        check_gin_text(fs.read_text(path), str(path))
        try:
            gin.parse_config_file(str(path))
        except OSError as e:  # an included file that no reader finds
            raise ConfigError(f"in config file {path}: {e}") from None
        except (ValueError, SyntaxError) as e:
            raise ConfigError(f"in config file {path}: {e}{did_you_mean(str(e))}") from None
    for binding in bindings:
        check_gin_text(binding, f"binding {binding!r}")
        try:
            gin.parse_config(binding)
        except (ValueError, SyntaxError) as e:
            raise ConfigError(f"binding {binding!r}: {e}{did_you_mean(str(e))}") from None


def parse(config_files: Sequence[str] = (), bindings: Sequence[str] = (), *,
          workdir: str | None = None, steps: int | None = None, mesh: str | None = None) -> TrainConfig:
    """Parse gin files and bindings (see the module docstring for order) and build the config.

    Each config checks its own fields as it is built; checks across configs and against the devices are
    :func:`validate`'s.

    Raises:
      ConfigError: missing file, unknown configurable or parameter, a malformed binding (with the file
        and line, or the binding text), or a field a config refuses (``ClassName.field = value: ...``).
    """
    flag_bindings = []
    if workdir is not None:
        flag_bindings.append(f"TrainConfig.workdir = {workdir!r}")
    if steps is not None:
        flag_bindings.append(f"TrainConfig.steps = {int(steps)}")
    if mesh is not None:
        flag_bindings.append(f"TrainConfig.mesh = {mesh!r}")
    parse_gin(config_files, [*flag_bindings, *bindings])
    try:
        return build_config()
    except ConfigError as e:
        raise ConfigError(str(e).split(_GIN_CALL_NOTE)[0]) from None
    except TypeError as e:
        raise ConfigError(f"config: {e}") from None


_TOOL_CLASSES: dict[str, type] = {}


def tool_configurable(cls: type) -> Any:
    """Register a tool's dataclass (``ScalingGrid``, ``MixtureExperiment``) with gin under its class name, so config
    files bind it and a misspelled field gets :func:`did_you_mean`'s suggestion as the train configs' do."""
    _TOOL_CLASSES[cls.__name__] = cls
    return gin.external_configurable(cls, name=cls.__name__, module="jaxpt")


def close_names(name: str, known: Sequence[str]) -> list[str]:
    """Up to three names of ``known`` closest to a misspelled ``name`` (:func:`difflib.get_close_matches`)."""
    return difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)


def did_you_mean(gin_message: str) -> str:
    """``"\n  did you mean 'ModelConfig.d_model'?"`` for gin's message about an unknown configurable or parameter
    of a config class or a :func:`tool_configurable` (closest known names by :func:`close_names`), else ``""``."""
    unknown_param = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", gin_message)
    unknown_cls = re.search(r"No configurable matching '([\w.]+)'", gin_message)
    classes = {**CONFIG_CLASSES, **_TOOL_CLASSES}
    if unknown_param and unknown_param.group(1) in classes:
        cls, name = unknown_param.groups()
        names = [f.name for f in dataclasses.fields(classes[cls]) if f.name not in
                 (_SUB_CONFIGS if cls == "TrainConfig" else ())]
        close = [f"{cls}.{n}" for n in close_names(name, names)]
    elif unknown_cls:
        close = close_names(unknown_cls.group(1).split(".")[-1], classes)
    else:
        return ""
    return f"\n  did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def operative_config_str(cfg: TrainConfig) -> str:
    """The operative config of ``cfg``: one gin binding per field of every config, sorted, one a line.

    Rendered from ``cfg`` itself rather than from gin's record of the configurables it called, so every
    setting the run uses is in it (and in :func:`config_hash`) whenever and however ``cfg`` was made: gin
    bindings, ``dataclasses.replace``, or gin state cleared or replaced since (``jaxpt.restore`` parses another
    config). :func:`parse` of these lines gives back a config equal to ``cfg`` (tested).
    """
    configs = {TrainConfig: cfg, **{type(getattr(cfg, name)): getattr(cfg, name) for name in _SUB_CONFIGS}}
    lines = ["# jaxpt operative config: every field of every config, as the run uses it."]
    for cls in sorted(configs, key=lambda c: c.__name__):
        lines += [f"{cls.__name__}.{name} = {getattr(configs[cls], name)!r}"
                  for name in sorted(f.name for f in dataclasses.fields(cls)) if name not in _SUB_CONFIGS]
    return "\n".join(lines) + "\n"


def write_operative_config(cfg: TrainConfig, write: bool = True) -> str:
    """Write ``<workdir>/config.gin`` (when ``write``: process 0 of a run), :func:`operative_config_str` of
    ``cfg``; return its text. Called after every check passed, so a refused run leaves no workdir behind."""
    text = operative_config_str(cfg)
    if write:
        fs.makedirs(cfg.workdir)
        fs.write_text_atomic(fs.join(cfg.workdir, "config.gin"), text)
    return text


def data_named() -> bool:
    """Whether the gin config :func:`parse` read last names its training data (binds ``DataConfig.source``,
    ``train_path`` or ``corpus_dir``); without that a run reads ``DataConfig``'s default, the quickstart's sample."""
    for key in ("DataConfig.source", "DataConfig.train_path", "DataConfig.corpus_dir"):
        try:
            gin.query_parameter(key)
            return True
        except ValueError:
            continue
    return False


#: The note a run whose config names no training data gets (logged, and in the dry run's plan).
DEFAULT_DATA_NOTE = ("no data config: the training data is DataConfig's default, the quickstart's sample "
                     f"({DataConfig().train_path}); name yours with a data config (--config artifacts/mine/data.gin, "
                     "from python -m jaxpt.data.prepare) or DataConfig.train_path / corpus_dir")


def config_hash(text: str) -> str:
    """sha256 of the operative config text (hex), used in run records."""
    return hashlib.sha256(text.encode()).hexdigest()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config flags shared by every entry point that builds a TrainConfig."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="gin file; may repeat, later files win")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="gin binding such as 'TrainConfig.seed = 1'; may repeat; applied last")
    parser.add_argument("--workdir", help="run directory (TrainConfig.workdir)")
    parser.add_argument("--steps", type=int, help="global step to train up to (TrainConfig.steps)")
    parser.add_argument("--mesh", help="mesh sizes, e.g. data=2,fsdp=2,tensor=2 (TrainConfig.mesh)")
    cli.add_flag(parser, "--profile-steps", "--profile_steps", metavar="START:STOP",
                 help="trace these steps with jax.profiler (TrainConfig.profile_steps)")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the config from parsed :func:`add_arguments` flags."""
    extra = [f"TrainConfig.profile_steps = {args.profile_steps!r}"] if getattr(args, "profile_steps", None) else []
    return parse(args.config, [*extra, *args.gin], workdir=args.workdir, steps=args.steps, mesh=args.mesh)


# ------------------------------------------------------------------------------------------ saved configs


class _Literal:
    """What a gin reference (``@name``) or macro (``%name``) in a saved config stands for here: its text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def saved_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """``{'ClassName.field': value}`` of a checkpoint: every binding of its operative config (``config_gin``,
    any gin layout, multi-line values included), and its recorded ``model`` fields as ``ModelConfig.<field>``
    where the config text lacks them.

    Raises:
      CheckpointError: the config text is not gin.
    """
    class Delegate(config_parser.ParserDelegate):
        def configurable_reference(self, name, evaluate):
            return _Literal(f"@{name}{'()' if evaluate else ''}")

        def macro(self, name):
            return _Literal(f"%{name}")

    out: dict[str, Any] = {}
    try:
        for st in config_parser.ConfigParser(meta.get("config_gin") or "", Delegate()):
            if isinstance(st, config_parser.BindingStatement):
                out[f"{st.selector.rsplit('.', 1)[-1]}.{st.arg_name}"] = st.value
    except SyntaxError as e:
        raise CheckpointError(f"its saved config is not gin: {e}") from None
    for k, v in (meta.get("model") or {}).items():
        out.setdefault(f"ModelConfig.{k}", v)
    return out


def same_value(a: Any, b: Any) -> bool:
    """Equal as JSON values (a tuple from gin equals a list from JSON)."""
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except TypeError:
        return False


def check_saved_config(meta: dict[str, Any], where: str) -> list[str]:
    """The one rule for settings a checkpoint's saved config has and this version of jaxpt does not know, applied
    by both restore paths (training resume, :func:`jaxpt.restore`).

    Such a setting is harmless, and reported (logged) and ignored, when the checkpoint records it as bookkeeping
    (:data:`jaxpt.config.BOOKKEEPING` of the writing version) or at its default (the writer's behaviour without
    it, which is this version's); for an older checkpoint that records neither, when its config is all
    bookkeeping (``CheckpointConfig``, ``HeldoutEvalConfig``) or not a jaxpt config at all. Any other unknown
    setting may change shapes or numerics: the checkpoint is refused, naming it.

    Returns the ignored settings as ``'ClassName.field = value'``.

    Raises:
      CheckpointError: naming every refused setting and its value.
    """
    known = config_fields()
    recorded = meta.get("config_fields") or {}
    refused, ignored = [], []
    for key, value in sorted(saved_settings(meta).items()):
        if key in known:
            continue
        info = recorded.get(key)
        if info is not None:
            harmless = bool(info.get("bookkeeping")) or same_value(value, info.get("default"))
        else:
            harmless = key.split(".")[0] not in CONFIG_CLASSES or is_bookkeeping(key)
        (ignored if harmless else refused).append(f"{key} = {value!r}")
    if refused:
        raise CheckpointError(f"{where}: its saved config sets {', '.join(refused)}, unknown to this version of "
                              "jaxpt and able to change shapes or numerics; restore it with the jaxpt that wrote it "
                              "(run.json names its git commit)")
    if ignored:
        log.warning("%s: ignoring saved settings this version does not know (harmless): %s", where,
                    ", ".join(ignored))
    return ignored


#: Setting values renamed since earlier versions wrote them: ``{key: {old value: new value}}`` (the same setting).
RENAMED_VALUES = {"DataConfig.source": {"sample": "jsonl"}}


def changed_settings(meta: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Settings that change numerics and differ between a checkpoint's saved config (its ``meta``) and ``cfg``, as
    ``'changed since the checkpoint: Class.field = old -> new'`` (reported on resume and at a stage start: a
    deliberate change, such as a new learning rate, is allowed, but never silent). ``ModelConfig.vocab_size`` is
    left out (0 in a config means "the tokenizer's"; the admission check compares the params it shapes)."""
    saved = {k: RENAMED_VALUES.get(k, {}).get(v, v) if isinstance(v, str) else v
             for k, v in saved_settings({"config_gin": meta.get("config_gin")}).items()}
    now = saved_settings({"config_gin": operative_config_str(cfg)})
    return [f"changed since the checkpoint: {k} = {saved[k]!r} -> {now[k]!r}" for k in sorted(now)
            if k in saved and not is_bookkeeping(k) and k != "ModelConfig.vocab_size"
            and not same_value(saved[k], now[k])]
