"""Human review: the spot-check prompt set, generation sheets for annotators, and inter-annotator agreement.

A review sheet is JSON Lines, one generation per line, with the fields annotators fill in::

    {"id": ..., "domain": ..., "lang": ..., "prompt": ..., "generation": ..., "card": ..., "card_version": ...,
     "checkpoint": ..., "step": ..., "labels": [...allowed...],
     "annotator_1": null, "annotator_2": null, "adjudicator": null, "notes": ""}

``annotator_1`` and ``annotator_2`` label every item independently; ``adjudicator`` labels the items they
disagree on. :func:`agreement` reports Cohen's kappa between the two annotators (Cohen 1960,
"A coefficient of agreement for nominal scales"): ``kappa = (p_o - p_e) / (1 - p_e)`` with ``p_o`` the share
of items given the same label and ``p_e = sum_k p1(k) p2(k)`` the agreement expected from each annotator's
label frequencies.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any, Iterable, Sequence

from jaxpt.eval.heldout import Document
from jaxpt.eval.probes import _seeded_order
from jaxpt.util import jsonl
from jaxpt.util.errors import FileFormatError

#: Spot-check prompts per domain in the default set (>= 200 in all).
DEFAULT_MIX = {"reference": 70, "code": 60, "multilingual": 50, "web": 20}


def _prompt_from(text: str, start: int, words: int) -> str:
    toks = list(re.finditer(r"\S+", text[start:]))
    if not toks:
        return ""
    end = toks[min(words, len(toks)) - 1].end()
    return text[start:start + end]


def build_spot_check(docs: Sequence[Document], *, mix: dict[str, int] | None = None, seed: int = 0,
                     prompt_words: int = 16) -> list[dict[str, Any]]:
    """A fixed set of prompts from held-out documents: for each domain, its quota of prompts taken from the
    documents in a seeded order, the first ``prompt_words`` words from the start of a line of at least four
    words (the k-th such line of each document in round k, so a domain with few documents gives several
    prompts per document).

    Returns: rows ``{"id", "domain", "lang", "source_id", "prompt"}``.

    Raises:
      ValueError: a domain cannot supply its quota.
    """
    mix = dict(mix or DEFAULT_MIX)
    out = []
    for domain, quota in mix.items():
        docs_d = _seeded_order([d for d in docs if d.domain == domain], seed, lambda d: d.id)
        starts = {d.id: [m.start() for m in re.finditer(r"^[^\n]*$", d.text, re.M) if len(m.group(0).split()) >= 4]
                  for d in docs_d}
        taken = 0
        round_ = 0
        while taken < quota and any(round_ < len(s) for s in starts.values()):
            for d in docs_d:
                if taken >= quota:
                    break
                if round_ >= len(starts[d.id]):
                    continue
                prompt = _prompt_from(d.text, starts[d.id][round_], prompt_words)
                if len(prompt.split()) < 4:
                    continue
                out.append({"id": f"{domain}-{taken:03d}", "domain": domain, "lang": d.lang,
                            "source_id": d.id, "prompt": prompt})
                taken += 1
            round_ += 1
        if taken < quota:
            raise ValueError(f"spot check: domain {domain!r} gives only {taken} prompts, quota {quota}")
    return out


def review_rows(prompts: Sequence[dict], generations: Sequence[str], *, card, checkpoint: str, step: int,
                labels: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a review sheet (see the module docstring), annotation fields empty."""
    return [{"id": p["id"], "domain": p.get("domain"), "lang": p.get("lang"), "prompt": p["prompt"],
             "generation": g, "card": card.name, "card_version": card.version, "checkpoint": checkpoint,
             "step": step, "labels": list(labels), "annotator_1": None, "annotator_2": None,
             "adjudicator": None, "notes": ""} for p, g in zip(prompts, generations)]


def cohen_kappa(a: Sequence[str], b: Sequence[str]) -> dict[str, float]:
    """Cohen's kappa of two annotators' labels on the same items.

    Returns ``{"n", "observed", "expected", "kappa"}``; kappa is NaN when ``expected == 1`` (both gave one
    and the same label to everything: agreement beyond chance is undefined).

    Raises:
      ValueError: the lists differ in length or are empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"cohen_kappa: need two non-empty label lists of one length, got {len(a)} and {len(b)}")
    n = len(a)
    p_o = sum(x == y for x, y in zip(a, b)) / n
    ca, cb = collections.Counter(a), collections.Counter(b)
    p_e = sum(ca[k] * cb[k] for k in set(ca) | set(cb)) / (n * n)
    kappa = (p_o - p_e) / (1 - p_e) if p_e < 1 else math.nan
    return {"n": n, "observed": p_o, "expected": p_e, "kappa": kappa}


def read_sheet(path: str) -> list[dict[str, Any]]:
    """Rows of a review sheet, in file order.

    Raises:
      FileFormatError: (a ConfigError) a line breaks the JSON Lines rules of :mod:`jaxpt.util.jsonl` (a blank line,
        not JSON, not an object, ...), naming ``file:line`` and the reason.
    """
    return jsonl.read_objects(path)


def read_prompts(path: str) -> list[dict[str, Any]]:
    """The spot-check prompts (JSON Lines of ``id``, ``prompt``, ``domain``, ``lang``), in file order.

    Raises:
      FileFormatError: a line breaks the JSON Lines rules, or reason ``missing_prompt``: a row without a string
        ``prompt`` (names ``file:line``).
    """
    rows = []
    for line_no, row in jsonl.iter_objects(path):
        if not isinstance(row.get("prompt"), str):
            raise FileFormatError.at(path, line_no, "missing_prompt", "'prompt' must be a string")
        rows.append(row)
    return rows


def agreement(rows: Iterable[dict[str, Any]], path: str = "sheet") -> dict[str, Any]:
    """Inter-annotator agreement of a review sheet.

    Items both annotators labeled count for kappa; the report also counts items each left unlabeled,
    disagreements, and how many of those the adjudicator resolved, plus the final label distribution
    (the adjudicator's label where given, else the agreed one).

    Raises:
      ValueError: a label outside the row's ``labels`` list (naming the item), or no item labeled by both.
    """
    rows = list(rows)
    a, b = [], []
    missing = {"annotator_1": 0, "annotator_2": 0}
    disagreements = adjudicated = 0
    final = collections.Counter()
    for r in rows:
        allowed = r.get("labels")
        for who in ("annotator_1", "annotator_2", "adjudicator"):
            v = r.get(who)
            if v is not None and allowed and v not in allowed:
                raise ValueError(f"{path}: item {r.get('id')!r}: {who} label {v!r} is not one of {allowed}")
        l1, l2, adj = r.get("annotator_1"), r.get("annotator_2"), r.get("adjudicator")
        for who, v in (("annotator_1", l1), ("annotator_2", l2)):
            if v is None:
                missing[who] += 1
        if l1 is None or l2 is None:
            continue
        a.append(l1)
        b.append(l2)
        if l1 != l2:
            disagreements += 1
            if adj is not None:
                adjudicated += 1
                final[adj] += 1
        else:
            final[adj if adj is not None else l1] += 1
    if not a:
        raise ValueError(f"{path}: no item is labeled by both annotators")
    out = cohen_kappa(a, b)
    out.update({"items": len(rows), "unlabeled": missing, "disagreements": disagreements,
                "adjudicated": adjudicated, "unresolved": disagreements - adjudicated,
                "final_labels": dict(sorted(final.items()))})
    return out
