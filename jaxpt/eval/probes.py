"""Probe tasks built from held-out text: examples, templates, and scoring.

Three kinds of probe, each defined by a card entry (:mod:`jaxpt.eval.card`) with a fixed template:

``cloze`` (choice)
  Next-word cloze on reference prose: up to ``context_words`` words of a held-out document, then the true next
  word against ``num_choices - 1`` distractor words (same capitalization) drawn from the other held-out documents
  of the domain. Scored by log-likelihood of each choice after the context.
``next_line`` (choice) and ``next_line_greedy`` (generate)
  Completion of the next line of code: ``context_lines`` preceding lines, then the true line against other lines
  of the same file re-indented like it (choice), or the model's greedy continuation up to the first newline
  compared, whitespace-stripped, with the true line (exact match).
``langid`` (choice)
  Language of a multilingual snippet by comparing likelihoods: for each candidate language the snippet is scored
  after a fixed held-out exemplar in that language; the language whose exemplar makes the snippet most likely is
  the prediction (a Bayes classifier with the LM as class-conditional model).

Choice tasks report ``accuracy`` (sum of log-probabilities) and ``accuracy_norm`` (log-probability per character
of the continuation, lm-evaluation-harness's ``acc_norm``); chance is the mean of ``1 / num_choices``. Generate
tasks report ``exact_match``; their chance level is 0.

Every model input built from a context or prompt starts as the run's training documents did
(:func:`jaxpt.data.boundary.context_start` of ``DataConfig.document_boundary``: BOS first for a Llama or Mistral base;
under jaxpt's default ``eos`` an empty context is ``[EOS]``).

Examples come only from held-out documents and are dropped when they share a word 13-gram with the training
split (:mod:`jaxpt.eval.decontam`). Everything is deterministic given the card's seed and the documents.
The same rows feed the seqio Tasks (:mod:`jaxpt.eval.seqio_tasks`) and the direct path here
(:func:`evaluate_task`), and both use the metric functions below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from typing import Any, Mapping, Sequence

import numpy as np

from jaxpt.data import boundary
from jaxpt.eval import decontam
from jaxpt.eval.heldout import Document
from jaxpt.infer import decode

KINDS = ("cloze", "next_line", "next_line_greedy", "langid")
CHOICE_KINDS = ("cloze", "next_line", "langid")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One probe task as the card states it (see ``configs/eval/card_v1.yaml`` for every field)."""

    name: str
    kind: str
    domain: str
    max_examples: int
    template: Mapping[str, str]
    chance: float
    primary_metric: str
    core: bool = False
    regression_tolerance: float = 0.0
    threshold: float | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""

    @property
    def is_choice(self) -> bool:
        return self.kind in CHOICE_KINDS


def _rng(seed: int, *parts: str) -> random.Random:
    h = hashlib.sha256("\x00".join([str(seed), *parts]).encode("utf-8")).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def _seeded_order(items: Sequence[Any], seed: int, key) -> list[Any]:
    """Items sorted by sha256(seed, key(item)): a fixed pseudo-random order independent of input order."""
    return sorted(items, key=lambda x: hashlib.sha256(f"{seed}\x00{key(x)}".encode("utf-8")).digest())


# ------------------------------------------------------------------------------------------ candidates

_WORD_TOKEN = re.compile(r"\S+")
_CLOZE_WORD = re.compile(r"[A-Za-z]{4,}")


def _cloze_candidates(docs: Sequence[Document], spec: TaskSpec, seed: int) -> list[dict]:
    p = spec.params
    min_ctx, max_ctx, k = int(p.get("min_context_words", 12)), int(p.get("context_words", 40)), int(p.get("num_choices", 4))
    pool = sorted({m.group(0).lower() for d in docs for m in _WORD_TOKEN.finditer(d.text)
                   if _CLOZE_WORD.fullmatch(m.group(0))})
    out = []
    for d in docs:
        toks = list(_WORD_TOKEN.finditer(d.text))
        eligible = [j for j in range(min_ctx, len(toks))
                    if _CLOZE_WORD.fullmatch(toks[j].group(0)) and d.text[toks[j].start() - 1] == " "]
        if not eligible:
            continue
        rng = _rng(seed, spec.name, d.id)
        j = rng.choice(eligible)
        answer = toks[j].group(0)
        context = d.text[toks[max(0, j - max_ctx)].start():toks[j].start() - 1]
        distractors: list[str] = []
        while len(distractors) < k - 1:
            w = rng.choice(pool)
            if w != answer.lower() and w not in distractors:
                distractors.append(w)
        style = (str.upper if answer.isupper() and len(answer) > 1 else
                 str.capitalize if answer[0].isupper() else str.lower)
        choices = [answer] + [style(w) for w in distractors]
        order = list(range(k))
        rng.shuffle(order)
        out.append({"id": f"{d.id}#w{j}", "fields": {"context": context}, "choices": [choices[i] for i in order],
                    "label": order.index(0), "decontam_text": f"{context} {answer}"})
    return out


def _line_ok(line: str, p: Mapping[str, Any]) -> bool:
    s = line.strip()
    return int(p.get("min_line_chars", 10)) <= len(s) <= int(p.get("max_line_chars", 100))


def _next_line_candidates(docs: Sequence[Document], spec: TaskSpec, seed: int, per_doc: int) -> list[dict]:
    p = spec.params
    n_ctx, k = int(p.get("context_lines", 8)), int(p.get("num_choices", 4))
    out = []
    for d in docs:
        lines = d.text.split("\n")
        ok = [i for i in range(len(lines)) if _line_ok(lines[i], p)]
        eligible = [i for i in ok if i >= 3 and lines[i].strip() not in {x.strip() for x in lines[max(0, i - n_ctx):i]}]
        rng = _rng(seed, spec.name, d.id)
        picks = sorted(rng.sample(eligible, min(per_doc, len(eligible))))
        for i in picks:
            answer = lines[i]
            context = "\n".join(lines[max(0, i - n_ctx):i]) + "\n"
            ex = {"id": f"{d.id}#L{i + 1}", "fields": {"context": context}, "answer": answer,
                  "decontam_text": context + answer}
            if spec.kind == "next_line":
                indent = answer[:len(answer) - len(answer.lstrip())]
                others = sorted({lines[j].strip() for j in ok if lines[j].strip() != answer.strip()})
                if len(others) < k - 1:
                    continue
                distractors = [indent + s for s in rng.sample(others, k - 1)]
                choices = [answer] + distractors
                order = list(range(k))
                rng.shuffle(order)
                ex.update(choices=[choices[i] for i in order], label=order.index(0))
            out.append(ex)
    return out


def _langid_candidates(docs: Sequence[Document], spec: TaskSpec, seed: int,
                       index: decontam.NgramIndex, decontam_kw) -> tuple[list[dict], dict[str, str], dict[str, int]]:
    p = spec.params
    langs = list(p["languages"])
    max_chars = int(p.get("snippet_chars", 300))
    by_lang: dict[str, list[Document]] = {l: [] for l in langs}
    for d in docs:
        if d.lang in by_lang:
            by_lang[d.lang].append(d)
    # Exemplars: per language, the first document (seeded order) with enough words and no training overlap.
    exemplar_words = int(p.get("exemplar_min_words", 15))
    cands = {l: [d for d in _seeded_order(by_lang[l], seed, lambda d: d.id)
                 if len(decontam.words(d.text)) >= exemplar_words] for l in langs}
    texts = [d.text for l in langs for d in cands[l]]
    verdict = decontam.decontaminate(texts, index, **decontam_kw)
    exemplars: dict[str, Document] = {}
    i = 0
    for l in langs:
        for d in cands[l]:
            if verdict.clean[i] and l not in exemplars:
                exemplars[l] = d
            i += 1
        if l not in exemplars:
            raise ValueError(f"task {spec.name}: no clean held-out exemplar with >= {exemplar_words} words "
                             f"for language {l!r}")
    out = []
    for l in langs:
        for d in by_lang[l]:
            if d.id == exemplars[l].id:
                continue
            snippet = _cut(d.text.strip(), max_chars)
            out.append({"id": d.id, "fields": {"snippet": snippet}, "label": langs.index(l),
                        "exemplar_fields": [{"exemplar": _cut(exemplars[x].text.strip(), max_chars)} for x in langs],
                        "decontam_text": snippet})
    info = {l: exemplars[l].id for l in langs}
    return out, info, {"exemplars_checked": len(texts)}


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, at the last line end (else space) when there is one."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n", " "):
        i = head.rfind(sep)
        if i > max_chars // 2:
            return head[:i]
    return head


# ------------------------------------------------------------------------------------------ examples


@dataclasses.dataclass
class TaskExamples:
    """A task's examples and how they were chosen.

    ``examples``: dicts with ``id`` and, for choice tasks, ``contexts`` / ``continuations`` (one per choice,
    rendered through the template) and ``label``; for generate tasks ``prompt`` and ``target``.
    ``counts``: candidates, dropped by reason, kept. ``info``: task-specific facts (e.g. langid exemplars).
    """

    spec: TaskSpec
    examples: list[dict]
    counts: dict[str, int]
    info: dict[str, Any]

    @property
    def sha256(self) -> str:
        """Hash of the rendered examples: two reports compare only if their example sets are identical."""
        return hashlib.sha256(json.dumps(self.examples, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    @property
    def chance(self) -> float:
        """Chance level measured on these examples: mean ``1/num_choices`` (0 for generate tasks)."""
        if not self.spec.is_choice or not self.examples:
            return 0.0
        return float(np.mean([1.0 / len(e["continuations"]) for e in self.examples]))


def _render(template: str, fields: Mapping[str, str]) -> str:
    try:
        return template.format(**fields)
    except (KeyError, IndexError) as e:
        raise ValueError(f"template {template!r} needs field {e} (has {sorted(fields)})") from None


def build_task(spec: TaskSpec, docs: Sequence[Document], index: decontam.NgramIndex, *, seed: int, ngram: int = 13,
               min_words: int = 8) -> TaskExamples:
    """Build, decontaminate and cap one task's examples.

    Args:
      spec: the card's task.
      docs: held-out documents (all domains; the task selects its own).
      index: word n-grams of the training split (:class:`jaxpt.eval.decontam.NgramIndex`).
      seed: the card's seed.
      ngram, min_words: decontamination settings (:func:`jaxpt.eval.decontam.decontaminate`).

    Raises:
      ValueError: an unknown kind, a template field the examples lack, or no example left.
    """
    if spec.kind not in KINDS:
        raise ValueError(f"task {spec.name}: unknown kind {spec.kind!r}; choose from {KINDS}")
    mine = [d for d in docs if d.domain == spec.domain]
    info: dict[str, Any] = {}
    dkw = {"n": ngram, "min_words": min_words}
    if spec.kind == "cloze":
        cands = _cloze_candidates(mine, spec, seed)
    elif spec.kind in ("next_line", "next_line_greedy"):
        per_doc = max(1, math.ceil(2 * spec.max_examples / max(len(mine), 1)))
        cands = _next_line_candidates(mine, spec, seed, per_doc)
    else:
        cands, exemplars, _ = _langid_candidates(mine, spec, seed, index, dkw)
        info["exemplars"] = exemplars
    verdict = decontam.decontaminate([c["decontam_text"] for c in cands], index, **dkw)
    counts = {"candidates": len(cands), **{k: v for k, v in verdict.counts().items() if k != "kept"}}
    clean = [c for c, ok in zip(cands, verdict.clean) if ok]
    clean = _seeded_order(clean, seed, lambda c: c["id"])[:spec.max_examples]
    clean.sort(key=lambda c: c["id"])
    examples = []
    t = spec.template
    for c in clean:
        if spec.kind == "langid":
            ex = {"id": c["id"], "contexts": [_render(t["context"], f) for f in c["exemplar_fields"]],
                  "continuations": [_render(t["choice"], c["fields"])] * len(c["exemplar_fields"]),
                  "label": c["label"]}
        elif spec.is_choice:
            ctx = _render(t["context"], c["fields"])
            ex = {"id": c["id"], "contexts": [ctx] * len(c["choices"]),
                  "continuations": [_render(t["choice"], {"choice": ch}) for ch in c["choices"]],
                  "label": c["label"]}
        else:
            ex = {"id": c["id"], "prompt": _render(t["context"], c["fields"]), "target": c["answer"]}
        examples.append(ex)
    counts["kept"] = len(examples)
    counts["over_cap"] = len([c for c, ok in zip(cands, verdict.clean) if ok]) - len(examples)
    if not examples:
        raise ValueError(f"task {spec.name}: no example left after decontamination ({counts}); "
                         f"held-out documents of domain {spec.domain!r}: {len(mine)}")
    return TaskExamples(spec, examples, counts, info)


# ------------------------------------------------------------------------------------------ rows and metrics


def choice_rows(examples: Sequence[dict]) -> list[dict]:
    """One row per (example, choice): ``inputs``, ``targets`` (text), ``example_idx``, ``choice_idx``,
    ``label``, ``target_chars`` (the continuation's length, for ``accuracy_norm``)."""
    rows = []
    for e, ex in enumerate(examples):
        for c, (ctx, cont) in enumerate(zip(ex["contexts"], ex["continuations"])):
            rows.append({"inputs": ctx, "targets": cont, "example_idx": e, "choice_idx": c, "label": ex["label"],
                         "target_chars": len(cont)})
    return rows


def generate_rows(examples: Sequence[dict]) -> list[dict]:
    """One row per example: ``inputs`` (prompt), ``targets`` (true line), ``example_idx``."""
    return [{"inputs": ex["prompt"], "targets": ex["target"], "example_idx": e} for e, ex in enumerate(examples)]


def choice_target(row: Mapping[str, Any]) -> dict[str, int]:
    """What the choice metric needs of a row (the seqio postprocessed target)."""
    return {"example_idx": int(row["example_idx"]), "choice_idx": int(row["choice_idx"]),
            "label": int(row["label"]), "target_chars": int(row["target_chars"])}


def choice_metrics(targets: Sequence[Mapping[str, int]], scores: Sequence[float]) -> dict[str, float]:
    """Accuracy of picking, per example, the choice with the highest log-likelihood (``accuracy``) and the
    highest log-likelihood per character (``accuracy_norm``). Ties go to the lowest choice index.

    Args:
      targets: one per row, as :func:`choice_target` gives.
      scores: the row's continuation log-likelihood in nats (same order).
    """
    best: dict[int, list] = {}
    for t, s in zip(targets, scores):
        e = t["example_idx"]
        entry = best.setdefault(e, [t["label"], (-math.inf, 0), (-math.inf, 0)])
        raw = (float(s), -t["choice_idx"])
        norm = (float(s) / max(t["target_chars"], 1), -t["choice_idx"])
        entry[1] = max(entry[1], raw)
        entry[2] = max(entry[2], norm)
    n = len(best)
    acc = sum(-v[1][1] == v[0] for v in best.values())
    acc_norm = sum(-v[2][1] == v[0] for v in best.values())
    return {"accuracy": acc / n if n else float("nan"), "accuracy_norm": acc_norm / n if n else float("nan"),
            "num_examples": float(n)}


def first_line(text: str) -> str:
    """The text before the first newline, stripped: how a greedy next-line completion is compared."""
    return text.split("\n", 1)[0].strip()


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Share of predictions equal to their target (both already :func:`first_line`-normalized)."""
    n = len(targets)
    hits = sum(t == p for t, p in zip(targets, predictions))
    return {"exact_match": hits / n if n else float("nan"), "num_examples": float(n)}


# ------------------------------------------------------------------------------------------ direct scoring


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``context`` and of ``continuation`` as they are in the encoding of the joined text.

    SentencePiece encodes text as a whole (a leading word-boundary mark, merges across the join), so the
    continuation's ids are taken from ``encode(context + continuation)`` after the longest prefix it shares
    with ``encode(context)`` (lm-evaluation-harness splits the same way). At least one id stays in the
    continuation.

    Returns: ``(context ids int32 [c], continuation ids int32 [k >= 1])``; ``c`` may be 0.
    """
    whole = np.asarray(tokenizer.encode(context + continuation), np.int32)
    ctx = np.asarray(tokenizer.encode(context), np.int32) if context else np.zeros(0, np.int32)
    m = min(len(ctx), len(whole) - 1)
    n = 0
    while n < m and ctx[n] == whole[n]:
        n += 1
    return whole[:n], whole[n:]


def score_choice_rows(scorer, tokenizer, rows: Sequence[Mapping[str, Any]],
                      document_boundary: str = "eos") -> list[float]:
    """Log-likelihood (nats) of each row's ``targets`` after its ``inputs``, via :func:`encode_pair`, the context
    started as ``document_boundary`` says (:func:`jaxpt.data.boundary.context_start`)."""
    start = boundary.context_start(document_boundary, tokenizer)
    reqs = []
    for r in rows:
        c, k = encode_pair(tokenizer, r["inputs"], r["targets"])
        reqs.append((start.apply(c), k))
    return [lp for lp, _ in scorer.loglikelihood(reqs)]


def next_line_greedy(step, tokenizer, prompts: Sequence[np.ndarray], max_new_tokens: int,
                     progress: str | None = None) -> list[decode.Generation]:
    """Greedy continuations of prompt ids (:func:`jaxpt.infer.decode.greedy` on ``step``, a
    :class:`jaxpt.infer.decode.DecodeStep`), each stopped at EOS or at its first newline (``text`` cut before it);
    ``progress``: as :func:`jaxpt.infer.decode.greedy`."""
    return decode.greedy(step, prompts, max_new_tokens, eos_id=tokenizer.eos_id,
                         stop_strings=[("\n",)] * len(prompts), tokenizer=tokenizer, progress=progress)


def evaluate_task(scorer, tokenizer, task: TaskExamples, *, max_new_tokens: int = 32,
                  generator=None, document_boundary: str = "eos") -> dict[str, float]:
    """Metrics of one task computed directly (no seqio): the same rows and metric functions as the seqio Task.

    ``generator``: the :class:`jaxpt.infer.decode.DecodeStep` of generate tasks (default ``scorer.decode_step()``; a
    wider batch amortizes the per-step calls). ``document_boundary``: the run's ``DataConfig.document_boundary``, how
    every context and prompt starts (:func:`jaxpt.data.boundary.context_start`)."""
    if task.spec.is_choice:
        rows = choice_rows(task.examples)
        return choice_metrics([choice_target(r) for r in rows],
                              score_choice_rows(scorer, tokenizer, rows, document_boundary))
    rows = generate_rows(task.examples)
    start = boundary.context_start(document_boundary, tokenizer)
    prompts = [start.apply(tokenizer.encode(r["inputs"])) for r in rows]
    gens = next_line_greedy(generator or scorer.decode_step(), tokenizer, prompts, max_new_tokens,
                            progress=f"{task.spec.name} generations")
    return exact_match([first_line(r["targets"]) for r in rows], [first_line(g.text) for g in gens])
