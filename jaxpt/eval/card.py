"""Eval cards: versioned YAML that fixes what an evaluation is.

A card lists the task-set version, each probe task (kind, template, parameters, chance level, primary metric,
threshold, whether it is *core* and its regression tolerance), the perplexity breakdown, the decoding
parameters, a spot-check prompt file (by path and sha256) whose generations go to human review, and optionally a
``safety`` section (:mod:`jaxpt.eval.safety`: prompt sets, classifiers and the thresholds a version must meet to
advance).

Versioning: ``content_sha256`` is the sha256 of the card's content (everything except ``version`` and
``content_sha256`` itself, as canonical JSON). :func:`load_card` refuses a card whose content no longer matches
its hash, so a change cannot slip in under an old version: ``python -m jaxpt.tools.evaluate card-stamp FILE`` raises
``version`` by one and records the new hash (the only way to make a changed card loadable again). Reports carry
name, version and hash, and :mod:`jaxpt.eval.regression` refuses to compare reports of different cards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any, Mapping

import yaml

from jaxpt.eval import review, safety as safety_lib
from jaxpt.eval.heldout import GROUPINGS
from jaxpt.eval.probes import KINDS, TaskSpec
from jaxpt.util import fs

_UNHASHED = ("version", "content_sha256")
#: The top-level keys of a card; any other is refused (a misspelled section must not switch a check off).
CARD_KEYS = ("name", "version", "content_sha256", "task_set_version", "seed", "sources", "decontamination",
             "perplexity", "decoding", "tasks", "spot_check", "safety")


class CardError(ValueError):
    """A card that cannot be used; the message names the file and key."""


@dataclasses.dataclass(frozen=True)
class SpotCheck:
    """Spot-check set: ``prompts_path`` (JSON Lines of ``id``, ``prompt``, ``domain``, ``lang``), its sha256,
    ``max_new_tokens`` and the review ``labels`` annotators choose from."""

    prompts_path: str
    prompts_sha256: str
    max_new_tokens: int
    labels: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Card:
    """A loaded, hash-checked card (see ``configs/eval/card_v1.yaml`` for the meaning of every field)."""

    path: str
    name: str
    version: int
    content_sha256: str
    task_set_version: str
    seed: int
    ngram: int
    min_words: int
    heldout_source: str
    train_source: str
    group_by: tuple[str, ...]
    stride: int
    batch_size: int
    core_grouping: str
    perplexity_tolerance: float
    decoding: Mapping[str, Any]
    tasks: tuple[TaskSpec, ...]
    spot_check: SpotCheck | None
    safety: safety_lib.SafetySection | None
    raw: Mapping[str, Any]

    @property
    def ident(self) -> dict[str, Any]:
        """What a report records about its card."""
        return {"name": self.name, "version": self.version, "content_sha256": self.content_sha256,
                "task_set_version": self.task_set_version, "path": self.path}


def check_generation_fits(card: Card, seq_len: int, *, tasks: bool, spot_check: bool) -> None:
    """Refuse, before any scoring, a card whose generations cannot run in a context of ``seq_len`` tokens (the
    evaluated run's ``TrainConfig.seq_len``, the row length of every evaluation): each ``max_new_tokens`` it would
    use must leave at least one prompt token (:func:`jaxpt.infer.decode.greedy` keeps a prompt's last
    ``seq_len - max_new_tokens`` tokens). Checked: ``decoding.max_new_tokens`` when ``tasks`` (the card has generate
    tasks to run), ``spot_check.max_new_tokens`` when ``spot_check`` (a review sheet is asked for), and
    ``safety.max_new_tokens`` when the card has a safety section.

    Raises:
      CardError: naming the card file, the key, its value and ``seq_len``.
    """
    checks = []
    if tasks:
        checks.append(("decoding.max_new_tokens", int(card.decoding["max_new_tokens"])))
    if spot_check and card.spot_check is not None:
        checks.append(("spot_check.max_new_tokens", card.spot_check.max_new_tokens))
    if card.safety is not None:
        checks.append(("safety.max_new_tokens", card.safety.max_new_tokens))
    for key, n in checks:
        if n >= seq_len:
            raise CardError(f"{card.path}: {key} = {n} does not fit this run's context of {seq_len} tokens "
                            f"(TrainConfig.seq_len; a generation needs at least one prompt token, so at most "
                            f"{seq_len - 1}): evaluate with a card written for this context")


def content_hash(raw: Mapping[str, Any]) -> str:
    """sha256 (hex) of a card's content: canonical JSON of every key except ``version`` and ``content_sha256``."""
    content = {k: v for k, v in raw.items() if k not in _UNHASHED}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def file_sha256(path: str) -> str:
    return hashlib.sha256(fs.read_bytes(path)).hexdigest()


def _read(path: str) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(fs.read_text(path))
    except FileNotFoundError:
        raise CardError(f"{path}: no such card") from None
    except yaml.YAMLError as e:
        raise CardError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise CardError(f"{path}: a card is a YAML mapping")
    return raw


def _get(raw: Mapping[str, Any], key: str, typ, where: str, default: Any = ...):
    if key not in raw:
        if default is ...:
            raise CardError(f"{where}: missing key {key!r}")
        return default
    value = raw[key]
    ok = isinstance(value, typ) and not (typ in (int, float, (int, float)) and isinstance(value, bool))
    if not ok:
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise CardError(f"{where}.{key} = {value!r}: expected {name}")
    return value


def _task(name: str, t: Mapping[str, Any], where: str) -> TaskSpec:
    w = f"{where}.tasks.{name}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(name)):
        raise CardError(f"{where}.tasks: the task name {name!r} is not a plain name (letters, digits, _ . -): it names "
                        "files the evaluation writes")
    if not isinstance(t, dict):
        raise CardError(f"{w}: a task is a mapping")
    kind = _get(t, "kind", str, w)
    if kind not in KINDS:
        raise CardError(f"{w}.kind = {kind!r}: choose one of {KINDS}")
    template = _get(t, "template", dict, w)
    needed = ("context", "choice") if kind != "next_line_greedy" else ("context",)
    for k in needed:
        if not isinstance(template.get(k), str):
            raise CardError(f"{w}.template.{k}: missing (a format string)")
    metric = _get(t, "primary_metric", str, w)
    allowed = ("accuracy", "accuracy_norm") if kind != "next_line_greedy" else ("exact_match",)
    if metric not in allowed:
        raise CardError(f"{w}.primary_metric = {metric!r}: choose one of {allowed}")
    threshold = t.get("threshold")
    if threshold is not None and not isinstance(threshold, (int, float)):
        raise CardError(f"{w}.threshold = {threshold!r}: expected a number or null")
    params = _get(t, "params", dict, w, {})
    if kind == "langid" and not params.get("languages"):
        raise CardError(f"{w}.params.languages: a langid task lists its languages")
    spec = TaskSpec(name=name, kind=kind, domain=_get(t, "domain", str, w),
                    max_examples=_get(t, "max_examples", int, w), template=dict(template),
                    chance=float(_get(t, "chance", (int, float), w)), primary_metric=metric,
                    core=bool(_get(t, "core", bool, w, False)),
                    regression_tolerance=float(_get(t, "regression_tolerance", (int, float), w, 0.0)),
                    threshold=None if threshold is None else float(threshold), params=dict(params),
                    description=str(t.get("description", "")).strip())
    if kind == "langid" and abs(spec.chance - 1.0 / len(params["languages"])) > 1e-6:
        raise CardError(f"{w}.chance = {spec.chance}: with {len(params['languages'])} languages chance is "
                        f"1/{len(params['languages'])}")
    if kind in ("cloze", "next_line") and abs(spec.chance - 1.0 / int(params.get("num_choices", 4))) > 1e-6:
        raise CardError(f"{w}.chance = {spec.chance}: with {params.get('num_choices', 4)} choices chance is "
                        f"1/{params.get('num_choices', 4)}")
    return spec


def _spot_check(raw: dict, path: str, where: str, check_files: bool) -> SpotCheck:
    """The card's ``spot_check`` section; with ``check_files``, the prompts file must exist and match its sha256.

    Raises:
      CardError: naming the key and file.
    """
    s = _get(raw, "spot_check", dict, where)
    w = f"{where}.spot_check"
    prompts = _get(s, "prompts", str, w)
    prompts_path = fs.join(fs.dirname(path), prompts)  # an absolute or gs:// ``prompts`` stays as it is
    spot = SpotCheck(prompts_path, _get(s, "prompts_sha256", str, w), _get(s, "max_new_tokens", int, w),
                     tuple(_get(s, "labels", list, w)))
    if check_files:
        if not fs.isfile(prompts_path):
            raise CardError(f"{w}.prompts: {prompts_path}: no such file")
        got = file_sha256(prompts_path)
        if got != spot.prompts_sha256:
            raise CardError(f"{w}.prompts: {prompts_path} has sha256 {got}, the card records "
                            f"{spot.prompts_sha256}: the spot-check set changed, so update "
                            f"prompts_sha256 and run `python -m jaxpt.tools.evaluate card-stamp {path}`")
        review.read_prompts(prompts_path)  # a malformed row is refused now, not after the scoring
    return spot


def load_card(path: str, *, check_files: bool = True) -> Card:
    """Read, hash-check and validate a card.

    Raises:
      CardError: naming the file and key: unreadable YAML, an unknown top-level key, a missing or mistyped key, an
        unknown task kind or
        grouping, content that no longer matches ``content_sha256`` (bump the version with
        ``python -m jaxpt.tools.evaluate card-stamp FILE``), a spot-check file whose sha256 differs from the card's,
        or a ``safety`` section that is malformed or names a prompt set or classifier whose sha256 differs
        (:func:`jaxpt.eval.safety.parse_section`).
    """
    raw = _read(path)
    where = path
    unknown = sorted(set(raw) - set(CARD_KEYS))
    if unknown:  # a misspelled section (`saftey:`) would otherwise switch that part of the evaluation off unseen
        raise CardError(f"{path}: unknown top-level keys {unknown}; a card has {list(CARD_KEYS)}")
    version = _get(raw, "version", int, where)
    stamped = _get(raw, "content_sha256", str, where)
    actual = content_hash(raw)
    if actual != stamped:
        raise CardError(f"{path}: content changed since version {version} was stamped (content sha256 "
                        f"{actual[:12]}, card says {stamped[:12]}). A changed card is a new version: run "
                        f"`python -m jaxpt.tools.evaluate card-stamp {path}` to bump it to {version + 1}")
    name = _get(raw, "name", str, where)
    tsv = _get(raw, "task_set_version", str, where)
    if not re.fullmatch(r"[\w.]+", tsv):
        raise CardError(f"{where}.task_set_version = {tsv!r}: letters, digits, '_' and '.' only (seqio task names)")
    dec = _get(raw, "decontamination", dict, where)
    src = _get(raw, "sources", dict, where, {})
    ppl = _get(raw, "perplexity", dict, where)
    group_by = tuple(_get(ppl, "group_by", list, f"{where}.perplexity"))
    for g in group_by:
        if g not in GROUPINGS:
            raise CardError(f"{where}.perplexity.group_by: unknown grouping {g!r}; choose from {GROUPINGS}")
    core_grouping = _get(ppl, "core_grouping", str, f"{where}.perplexity")
    if core_grouping not in group_by:
        raise CardError(f"{where}.perplexity.core_grouping = {core_grouping!r} is not in group_by {group_by}")
    decoding = _get(raw, "decoding", dict, where)
    if decoding.get("strategy") != "greedy":
        raise CardError(f"{where}.decoding.strategy = {decoding.get('strategy')!r}: only 'greedy' is implemented")
    _get(decoding, "max_new_tokens", int, f"{where}.decoding")
    tasks_raw = _get(raw, "tasks", dict, where)
    tasks = tuple(_task(n, t, where) for n, t in tasks_raw.items())
    spot = _spot_check(raw, path, where, check_files) if "spot_check" in raw else None
    try:
        safety = safety_lib.parse_section(raw["safety"], path, check_files=check_files) if "safety" in raw else None
    except safety_lib.SafetyCardError as e:
        raise CardError(str(e)) from None
    return Card(path=path, name=name, version=version, content_sha256=stamped, task_set_version=tsv,
                seed=_get(raw, "seed", int, where, 0), ngram=_get(dec, "ngram", int, f"{where}.decontamination"),
                min_words=_get(dec, "min_words", int, f"{where}.decontamination"),
                heldout_source=str(src.get("heldout") or ""), train_source=str(src.get("train") or ""),
                group_by=group_by, stride=_get(ppl, "stride", int, f"{where}.perplexity", 0),
                batch_size=_get(ppl, "batch_size", int, f"{where}.perplexity", 16), core_grouping=core_grouping,
                perplexity_tolerance=float(_get(ppl, "regression_tolerance", (int, float), f"{where}.perplexity")),
                decoding=dict(decoding), tasks=tasks, spot_check=spot, safety=safety, raw=raw)


_VERSION_LINE = re.compile(r"^version:.*$", re.M)
_HASH_LINE = re.compile(r"^content_sha256:.*$", re.M)


def stamp_card(path: str) -> tuple[int, str]:
    """Bump a changed card's version by one and record its new content hash, editing only those two lines
    (comments and layout stay). Returns ``(new version, new hash)``.

    Raises:
      CardError: the content did not change (nothing to stamp), or the file lacks top-level ``version:`` /
        ``content_sha256:`` lines.
    """
    raw = _read(path)
    actual = content_hash(raw)
    if raw.get("content_sha256") == actual:
        raise CardError(f"{path}: content unchanged since version {raw.get('version')}; nothing to stamp")
    version = int(raw.get("version") or 0) + 1
    text = fs.read_text(path)
    if not _VERSION_LINE.search(text) or not _HASH_LINE.search(text):
        raise CardError(f"{path}: needs top-level 'version:' and 'content_sha256:' lines to stamp")
    text = _VERSION_LINE.sub(f"version: {version}", text, count=1)
    text = _HASH_LINE.sub(f"content_sha256: {actual}", text, count=1)
    fs.write_text_atomic(path, text)
    return version, actual
