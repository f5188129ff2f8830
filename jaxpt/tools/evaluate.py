"""``python -m jaxpt.tools.evaluate``: evaluate a checkpoint (eval cards, length extrapolation), compare reports.

    python -m jaxpt.tools.evaluate --workdir DIR [--step N] --card configs/eval/card_v1.yaml --output report.json
        [--heldout SRC] [--train SRC] [--mesh data=8] [--no-seqio] [--review-sheet FILE]
    python -m jaxpt.tools.evaluate heldout --workdir DIR [--step N] [--heldout SRC] [--output FILE]  # any data
        [--routing causal|train]
    python -m jaxpt.tools.evaluate extrapolation --workdir DIR [--step N] --lengths 512,1024,2048,4096
        [--tolerance 0.05] [--trained-length T] [--heldout SRC] [--max-tokens 16384] [--batch-size 1]
        [--mesh data=8] [--output FILE]
    python -m jaxpt.tools.evaluate compare BASE NEW [--card CARD] [--output FILE]   # reports, or workdirs + --card
    python -m jaxpt.tools.evaluate agreement SHEET                                  # Cohen's kappa of a review sheet
    python -m jaxpt.tools.evaluate card-stamp CARD                                  # bump a changed card's version
    python -m jaxpt.tools.evaluate spot-check-build --heldout SRC --output FILE    # (re)build a spot-check prompt set
    python -m jaxpt.tools.evaluate export-probes --card CARD --heldout SRC --train SRC --output DIR
    python -m jaxpt.tools.evaluate lm-eval --workdir DIR --tasks T1,T2 [--include-path DIR] [--limit N]
    python -m jaxpt.tools.evaluate safety-train [--labels data/labels/safety-1] --output configs/eval/safety
    python -m jaxpt.tools.evaluate safety-review REPORT --write-template FILE [--rates harmful_rate,...]
    python -m jaxpt.tools.evaluate safety-review REPORT --labels FILE [--output REVIEWED]  # labels decide the rates

The card report (JSON) names the card (name, version, content hash, task-set version) and the checkpoint, and holds
held-out perplexity per domain, per language and per (domain, language), each probe task's metrics beside its
chance level and threshold, the decontamination counts, and where the spot-check review sheet went.

``heldout``: held-out perplexity alone, on any documents (the run's held-out set, or ``--heldout`` FILE, glob or
directory): overall and per domain and language, as the card report computes it, with no task that needs particular
domains. A model converted from Hugging Face has no held-out set of its own: ``--heldout`` is then required. A
mixture of experts is scored with each token routed by itself (``causal``) and every report says which routing
produced its figures; ``--routing train`` scores it as it trains (capacity and balancing over whole rows, so later
tokens move earlier scores), to measure that difference.

``extrapolation``: the length-extrapolation report (:mod:`jaxpt.eval.extrapolation`): held-out loss by position
bucket at each length, and the effective extrapolation length (the longest length whose tail loss stays within
``--tolerance``, relative, of the trained length's). It prints a table, writes the JSON (default
``<workdir>/extrapolation/step_<N>.json``) and a PNG plot next to it (same name, ``.png``). It was ``python -m
jaxpt.evaluate --lengths ...``; that form still works for one release.

A card with a ``safety`` section (:mod:`jaxpt.eval.safety`) adds the harmful-content, refusal and false-refusal
rates to the report, each beside its threshold, and says whether the version advances; the generations and their
classifier scores go to ``<output>.safety.jsonl``.

``safety-review``: a person's labels decide the safety rates instead of the classifiers
(:func:`jaxpt.eval.safety.apply_review`). ``--write-template`` writes the generations to label (by default those of
the rates that blocked the version), each with its label key null; ``--labels`` takes the filled file and writes the
reviewed report (default ``<report>.reviewed.json``) with each labelled rate recomputed from the labels, what the
classifier counted beside it, and the verdict again; ``compare`` reads it as any report.

Exit status: 0 ok; 1 a regression (``compare``) crossed a tolerance, or a safety rate crossed its card threshold
(the card run, ``compare`` and ``safety-review --labels``: the version does not advance); 2 bad input (card,
report, sheet, labels, paths, no checkpoint, a held-out set shorter than the longest length).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from jaxpt.checkpoint import CheckpointError
from jaxpt.data import boundary
from jaxpt.eval import extrapolation, heldout, heldout as heldout_lib, regression, review, safety
from jaxpt.eval.card import CardError, check_generation_fits, file_sha256, load_card, stamp_card
from jaxpt.eval.regression import IncompatibleReports
from jaxpt.eval.scorer import scorer_for_restored
from jaxpt.eval.tasks import build_probe_tasks, extra_module, score_tasks
from jaxpt.infer import decode
from jaxpt.infer.restore import restore as restore_checkpoint
from jaxpt.util import cli, fs, jsonl, progress as progress_lib

log = logging.getLogger("jaxpt.tools.evaluate")

#: The subcommands; without one, the command evaluates a checkpoint on an eval card.
SUBCOMMANDS = ("heldout", "extrapolation", "compare", "agreement", "card-stamp", "spot-check-build", "export-probes", "lm-eval",
               "safety-train", "safety-review")


# ------------------------------------------------------------------------------------------ one evaluation


def run_card(restored, card, *, workdir: str = "", heldout: str | None = None, train: str | None = None,
             use_seqio: bool = True, review_sheet: str | None = None, tasks=None,
             safety_sheet: str | None = None) -> dict[str, Any]:
    """Evaluate a restored checkpoint (:func:`jaxpt.restore`) on ``card``; returns the report dict.

    Args:
      heldout, train: sources (file or directory); default: the card's, else the run's own.
      use_seqio: score probe tasks through their seqio Tasks and ``seqio.Evaluator`` (imports TensorFlow);
        False scores the same rows directly (same metric functions).
      review_sheet: where to write the spot-check generations for human review (skipped when None).
      tasks: prebuilt probe tasks (:func:`build_probe_tasks`), to reuse them across checkpoints.
      safety_sheet: where to write the safety generations and their classifier scores (a card with a ``safety``
        section is judged either way; the sheet is skipped when None).
    """
    t0 = time.perf_counter()
    cfg = restored.config
    if use_seqio and restored.tokenizer.kind != "sentencepiece":  # refused before any scoring (seqio is SP only)
        restored.tokenizer.as_seqio_vocabulary()  # raises ValueError naming the file and --no-seqio
    run_heldout, run_train = heldout_lib.run_sources(cfg.data)
    heldout = heldout or card.heldout_source or heldout_source(restored, None)
    train = train or card.train_source or run_train
    docs = heldout_lib.load_documents(heldout, "heldout")
    if tasks is None:
        check_card_domains(card, docs, heldout)
    generate_tasks = any(not spec.is_choice for spec in card.tasks) if tasks is None else \
        any(not te.spec.is_choice for te in tasks.values())
    check_generation_fits(card, cfg.seq_len, tasks=generate_tasks, spot_check=bool(review_sheet))
    scorer = scorer_for_restored(restored, batch_size=card.batch_size)
    hset = heldout_lib.HeldoutSet.build(docs, restored.tokenizer, seq_len=scorer.seq_len,
                                        stride=card.stride or None, document_boundary=cfg.data.document_boundary)
    ppl = heldout_lib.perplexity_report(scorer, hset, group_by=card.group_by, progress="held-out perplexity")
    generator = scorer.decode_step(batch_size=int(card.decoding.get("batch_size", 64)))
    ppl.update(core_grouping=card.core_grouping, regression_tolerance=card.perplexity_tolerance,
               source=heldout, stride=card.stride or scorer.seq_len // 2, seq_len=scorer.seq_len)
    t_ppl = time.perf_counter()
    if tasks is None:
        tasks = build_probe_tasks(card, docs, heldout_lib.training_texts(train))
    metrics = score_tasks(card, tasks, scorer, generator, restored, use_seqio)
    t_tasks = time.perf_counter()
    report = {
        "card": card.ident,
        "checkpoint": {"workdir": fs.absolute(workdir) if workdir else None, "step": restored.step,
                       "data_version": restored.meta.get("data_version"),
                       "tokenizer_sha256": restored.tokenizer.sha256, "num_params": restored.num_params},
        "heldout": ppl,
        "tasks": {n: _task_entry(card, te, metrics[n], use_seqio) for n, te in tasks.items()},
        "train_source": train,
    }
    if review_sheet and card.spot_check is not None:
        report["spot_check"] = write_review_sheet(restored, card, generator, review_sheet, workdir)
    t_safety = time.perf_counter()
    if card.safety is not None:
        report["safety"] = run_safety(restored, card, generator, safety_sheet)
    report["timing_s"] = {"perplexity": t_ppl - t0, "tasks": t_tasks - t_ppl,
                          "safety": time.perf_counter() - t_safety, "total": time.perf_counter() - t0}
    return report


def _task_entry(card, te, metrics: dict[str, float], use_seqio: bool) -> dict[str, Any]:
    spec = te.spec
    score = metrics[spec.primary_metric]
    return {
        "seqio_task": f"jaxpt.{card.task_set_version}.{spec.name}", "scored_with": "seqio" if use_seqio else "direct",
        "kind": spec.kind, "domain": spec.domain, "description": spec.description, "metrics": metrics,
        "primary_metric": spec.primary_metric, "score": score, "chance": spec.chance,
        "chance_measured": te.chance, "above_chance": score - spec.chance, "threshold": spec.threshold,
        "passes_threshold": None if spec.threshold is None else score >= spec.threshold, "core": spec.core,
        "regression_tolerance": spec.regression_tolerance, "num_examples": len(te.examples),
        "examples_sha256": te.sha256, "decontamination": te.counts, **({"info": te.info} if te.info else {}),
    }


def greedy_texts(restored, step, prompts: list[str], max_new_tokens: int, *, progress: str) -> list[str]:
    """Greedy continuations (text, without the prompt) of ``prompts``, stopped at EOS, each prompt started as the
    run's documents were (:func:`jaxpt.data.boundary.context_start`). ``step``: the
    :class:`jaxpt.infer.decode.DecodeStep` to decode with (its class and batch size are kept; a shorter row is used
    when the prompts allow, which makes a smaller cache)."""
    tok = restored.tokenizer
    start = boundary.context_start(restored.config.data.document_boundary, tok)
    ids = [start.apply(tok.encode(p)) for p in prompts]
    need = -(-(max(len(i) for i in ids) + max_new_tokens) // 8) * 8
    if need < step.seq_len:
        step = type(step).for_restored(restored, seq_len=need, batch_size=step.batch_size)
    return [g.text for g in decode.greedy(step, ids, max_new_tokens, eos_id=tok.eos_id, tokenizer=tok,
                                          progress=progress)]


def write_review_sheet(restored, card, step, path: str, workdir: str) -> dict[str, Any]:
    """Generate greedily from every spot-check prompt (:func:`greedy_texts`) and write the review sheet; returns its
    summary."""
    spot = card.spot_check
    prompts = review.read_prompts(spot.prompts_path)
    gens = greedy_texts(restored, step, [p["prompt"] for p in prompts], spot.max_new_tokens,
                        progress="spot-check generations")
    rows = review.review_rows(prompts, gens, card=card, checkpoint=fs.absolute(workdir) if workdir else "",
                              step=restored.step, labels=spot.labels)
    _write_jsonl(path, rows)
    return {"sheet": fs.absolute(path), "prompts": len(rows), "max_new_tokens": spot.max_new_tokens,
            "labels": list(spot.labels)}


def run_safety(restored, card, step, sheet: str | None) -> dict[str, Any]:
    """The report's ``safety`` entry (:func:`jaxpt.eval.safety.judge`): the model continues every prompt of the
    card's three safety sets greedily, the card's classifiers judge the outputs; with ``sheet``, every prompt, output,
    probability and count goes there as JSON Lines (its path is in the entry)."""
    section = card.safety
    extra_module("sklearn", f"the safety section of card {card.name} (its classifiers)")
    judges = safety.Judges(section)
    prompts = {n: safety.read_prompt_set(s.path) for n, s in section.sets.items()}
    outputs = {n: greedy_texts(restored, step, safety.model_prompts(section, n, rows), section.max_new_tokens,
                               progress=f"safety {n} generations") for n, rows in prompts.items()}
    entry = safety.judge(section, judges, outputs)
    if sheet:
        _write_jsonl(sheet, safety.sheet_rows(section, judges, prompts, outputs))
        entry["sheet"] = fs.absolute(sheet)
    return entry


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    fs.makedirs(fs.dirname(fs.absolute(path)))
    with fs.open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(jsonl.dumps(r, ensure_ascii=False) + "\n")


def format_report(report: dict[str, Any]) -> str:
    """Plain-text summary: perplexity per group, each task's score beside its chance level, and the safety rates
    with the verdict."""
    c = report["card"]
    h = report["heldout"]
    routing = f", {h['routing']} routing" if "routing" in h else ""
    lines = [f"card {c['name']} v{c['version']} ({c['task_set_version']}), step {report['checkpoint']['step']}",
             f"held-out perplexity {h['overall']['perplexity']:.2f} over {h['overall']['tokens']} tokens "
             f"({h['overall']['bits_per_byte']:.3f} bits/byte{routing})"]
    for key in ("by_domain", "by_lang"):
        for g, f in h.get(key, {}).items():
            lines.append(f"  {key[3:]:<7} {g:<14} ppl {f['perplexity']:>10.2f}  tokens {f['tokens']:>7}  "
                         f"bits/byte {f['bits_per_byte']:.3f}")
    for n, t in report["tasks"].items():
        thr = "" if t["threshold"] is None else f"  threshold {t['threshold']:.3f} ({'pass' if t['passes_threshold'] else 'FAIL'})"
        lines.append(f"  task {n:<24} {t['primary_metric']:<14} {t['score']:.3f}  chance {t['chance']:.3f}  "
                     f"n={t['num_examples']}{thr}")
    if "safety" in report:
        lines += safety.format_section(report["safety"])
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI


def _restore(workdir: str, step: int | None, mesh: str | None):
    return restore_checkpoint(workdir, step=step, mesh=mesh)


def cmd_run(args) -> int:
    card = load_card(args.card)
    restored = _restore(args.workdir, args.step, args.mesh)
    sheet = args.review_sheet
    if sheet is None and args.output:
        sheet = os.path.splitext(args.output)[0] + ".review.jsonl"
    report = run_card(restored, card, workdir=args.workdir, heldout=args.heldout, train=args.train,
                      use_seqio=not args.no_seqio, review_sheet=sheet,
                      safety_sheet=os.path.splitext(args.output)[0] + ".safety.jsonl" if args.output else None)
    _write_json(args.output, report)
    print(format_report(report))
    return 0 if report.get("safety", {}).get("advances", True) else 1


def check_card_domains(card, docs, source: str) -> None:
    """Every probe task of ``card`` finds held-out documents of its domain in ``docs`` (checked before anything is
    scored).

    Raises:
      ValueError: naming the tasks, the domains they need, the domains ``source`` has, and what to do instead.
    """
    have = sorted({d.domain for d in docs})
    missing = {spec.name: spec.domain for spec in card.tasks if spec.domain not in have}
    if missing:
        raise ValueError(f"card {card.ident['name']} v{card.ident['version']}: its tasks need held-out documents of "
                         f"domains {sorted(set(missing.values()))} ({', '.join(sorted(missing))}); {source} has "
                         f"{have}. For held-out figures on any data run `python -m jaxpt.tools.evaluate heldout "
                         "--workdir DIR`; for probe tasks on your data, write a card whose tasks name your domains "
                         "(configs/eval/card_v1.yaml is the model)")


def heldout_source(restored, explicit: str | None) -> str:
    """The held-out documents to score ``restored`` on: ``explicit``, else its run's (``DataConfig.heldout_path`` or
    its corpus version's held-out split).

    Raises:
      ValueError: no ``explicit`` source for a model converted from Hugging Face (its config's held-out path is a
        default, not data it was trained beside).
    """
    if explicit:
        return explicit
    if restored.meta.get("params_only"):
        source = (restored.meta.get("source") or {}).get("path", "Hugging Face")
        raise ValueError(f"the checkpoint is a model converted from {source}: it has no held-out set of its own; "
                         "pass --heldout FILE (JSON Lines documents, a glob, or a prepared folder) to score it on")
    return heldout.run_sources(restored.config.data)[0]


def cmd_heldout(args) -> int:
    """Held-out perplexity alone (module docstring): prints a table, writes the JSON when ``--output`` is given."""
    restored = _restore(args.workdir, args.step, args.mesh)
    source = heldout_source(restored, args.heldout)
    docs = heldout.load_documents(source, "heldout")
    scorer = scorer_for_restored(restored, batch_size=args.batch_size, routing=args.routing)
    hset = heldout.HeldoutSet.build(docs, restored.tokenizer, seq_len=scorer.seq_len,
                                    document_boundary=restored.config.data.document_boundary)
    report = heldout.perplexity_report(scorer, hset, progress="held-out perplexity")
    report.update(source=source, checkpoint={"workdir": fs.absolute(args.workdir), "step": restored.step,
                                             "data_version": restored.meta.get("data_version")})
    _write_json(args.output, report)
    o = report["overall"]
    routing = f", {report['routing']} routing" if "routing" in report else ""
    lines = [f"step {restored.step}: held-out loss {o['loss']:.4f}, perplexity {o['perplexity']:.2f} over "
             f"{o['tokens']:,} tokens of {o['documents']:,} documents ({source}{routing})"]
    for by in ("domain", "lang"):
        lines += [f"  {by} {g:<16} loss {f['loss']:.4f}  perplexity {f['perplexity']:9.2f}  tokens {f['tokens']:,}"
                  for g, f in report[f"by_{by}"].items()]
    print("\n".join(lines + ([f"wrote {args.output}"] if args.output else [])))
    return 0


def cmd_extrapolation(args) -> int:
    """The length-extrapolation report (module docstring); returns the exit status."""
    restored = _restore(args.workdir, args.step, args.mesh)
    source = heldout_source(restored, args.heldout)
    texts = [d.text for d in heldout.load_documents(source)]
    tol = extrapolation.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    report = extrapolation.measure(restored, args.lengths, texts=texts, trained_length=args.trained_length,
                                   tolerance=tol, max_tokens=args.max_tokens, batch_size=args.batch_size)
    report["checkpoint"]["workdir"] = fs.absolute(args.workdir)
    report["heldout_source"] = source
    output = args.output or fs.join(args.workdir, "extrapolation", f"step_{restored.step}.json")
    fs.makedirs(fs.dirname(fs.absolute(output)))
    report["plot"] = os.path.splitext(output)[0] + ".png"
    extrapolation.plot(report, report["plot"], label=fs.basename(fs.absolute(args.workdir)))  # local or gs://
    fs.write_text_atomic(output, jsonl.dumps(report, indent=2))
    print(extrapolation.format_report(report))
    print(f"wrote {output} and {report['plot']}")
    return 0


def _write_json(path: str | None, obj: Any) -> None:
    if not path:
        return
    fs.makedirs(fs.dirname(fs.absolute(path)))
    fs.write_text_atomic(path, jsonl.dumps(obj, indent=1, ensure_ascii=False))


def read_report(path: str) -> dict[str, Any]:
    """A report written by this command (a JSON object).

    Raises:
      ConfigError, ValueError: the file is not JSON or not an object (naming it: a sheet or labels file passed by
        mistake).
      FileNotFoundError: no such file.
    """
    obj = fs.read_json(path, "a report is one JSON object, as --output writes it; JSON Lines such as a sheet or "
                             "labels file are not")
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a report (a report is one JSON object)")
    return obj


def _report_of(arg: str, args) -> dict[str, Any]:
    if fs.isdir(arg):
        if not args.card:
            raise ValueError(f"{arg} is a workdir: pass --card to evaluate it")
        return run_card(_restore(arg, None, args.mesh), load_card(args.card), workdir=arg,
                        use_seqio=not args.no_seqio)
    return read_report(arg)


def cmd_compare(args) -> int:
    base, new = _report_of(args.base, args), _report_of(args.new, args)
    result = regression.compare(base, new)
    _write_json(args.output, result)
    print(regression.format_comparison(result))
    return 0 if result["ok"] else 1


def cmd_agreement(args) -> int:
    out = review.agreement(review.read_sheet(args.sheet), args.sheet)
    print(json.dumps(out, indent=1))
    return 0


def cmd_safety_train(args) -> int:
    """Train the safety classifiers on a label set and print their held-out figures (:func:`safety.train_classifiers`)."""
    out = safety.train_classifiers(args.labels, args.output, threshold=args.threshold)
    for name in ("harm", "refusal"):
        f = out[name]
        print(f"{name:<8} {f['file']}  sha256 {f['sha256']}  trained on {f['train']}, C {f['c']}")
        for split in ("test", "cross_validated", "model_output"):
            if split not in f:
                continue
            m = f[split]
            print(f"  {split:<16} precision {m['precision']:.3f}  recall {m['recall']:.3f}  accuracy "
                  f"{m['accuracy']:.3f}  (n={m['n']}, {m['positives']} positive)")
    print(f"wrote {args.output}: record each file's sha256, its test precision and recall (and, where measured, "
          "its model_output ones as output_precision and output_recall) in the card's safety section, then "
          "card-stamp the card")
    return 0


def cmd_safety_review(args) -> int:
    """``safety-review`` (module docstring): write the labelling template, or apply the labels and write the
    reviewed report; returns 0, or 1 when the reviewed version does not advance."""
    report = read_report(args.report)
    entry = report.get("safety")
    if not entry:
        raise ValueError(f"{args.report}: the report has no safety section (its card has none)")
    sheet_path = args.sheet or entry.get("sheet")
    if not sheet_path:
        raise ValueError(f"{args.report}: the report records no generations sheet (evaluate with --output to write "
                         "one), and no --sheet was given")
    sheet = [row for _, row in jsonl.iter_objects(sheet_path)]  # a bad line is named, file:line
    if args.write_template:
        rates = [r.strip() for r in args.rates.split(",") if r.strip()] if args.rates else None
        rows = safety.review_template(entry, sheet, rates)
        _write_jsonl(args.write_template, rows)
        print(f"wrote {args.write_template}: {len(rows)} generations to label "
              f"({', '.join(sorted({r['set'] for r in rows}))}); fill each null with true or false by "
              "data/labels/safety-1/GUIDELINE.md, then run safety-review with --labels")
        return 0
    labels = safety.read_review_labels(args.labels)
    reviewed = safety.apply_review(entry, sheet, labels, labels_path=fs.absolute(args.labels),
                                   labels_sha256=file_sha256(args.labels))
    report["safety"] = reviewed
    out = args.output or (args.report[:-5] if args.report.endswith(".json") else args.report) + ".reviewed.json"
    _write_json(out, report)
    print("\n".join(safety.format_section(reviewed)))
    print(f"wrote {out}")
    return 0 if reviewed["advances"] else 1


def cmd_card_stamp(args) -> int:
    version, digest = stamp_card(args.card)
    load_card(args.card)
    print(f"{args.card}: now version {version} (content sha256 {digest})")
    return 0


def cmd_spot_check_build(args) -> int:
    rows = review.build_spot_check(heldout.load_documents(args.heldout, "heldout"), seed=args.seed)
    with fs.open(args.output, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(jsonl.dumps(r, ensure_ascii=False) + "\n")
    print(f"{args.output}: {len(rows)} prompts, sha256 {file_sha256(args.output)}")
    return 0


def cmd_export_probes(args) -> int:
    """Write each task's examples as JSON Lines (lm-eval data files; eval sets for corpus decontamination)."""
    card = load_card(args.card)
    tasks = build_probe_tasks(card, heldout.load_documents(args.heldout, "heldout"),
                              heldout.training_texts(args.train))
    fs.makedirs(args.output)
    for name, te in tasks.items():
        path = fs.join(args.output, fs.contained(args.output, f"{name}.jsonl"))  # a card's task name is data
        with fs.open(path, "w", encoding="utf-8") as f:
            for ex in te.examples:
                text = (ex["contexts"][ex["label"]] + ex["continuations"][ex["label"]] if te.spec.is_choice
                        else ex["prompt"] + ex["target"])
                f.write(jsonl.dumps({**ex, "text": text}, ensure_ascii=False) + "\n")
        print(f"{path}: {len(te.examples)} examples ({te.counts})")
    return 0


def cmd_lm_eval(args) -> int:
    harness = extra_module("jaxpt.eval.harness", "the lm-eval adapter")  # defers lm_eval
    results = harness.run_lm_eval(args.workdir, args.tasks.split(","), step=args.step, mesh=args.mesh,
                                  include_path=args.include_path, limit=args.limit, batch_size=args.batch_size)
    _write_json(args.output, results)
    print(json.dumps(results, indent=1))
    return 0


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: comma-separated integers, e.g. 512,1024") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: each length must be >= 2")
    return out


def _card_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True)
    p.add_argument("--step", type=int)
    p.add_argument("--card", required=True)
    p.add_argument("--output", help="report JSON")
    p.add_argument("--heldout", help="held-out source (file or corpus dir); default: card, then run config")
    p.add_argument("--train", help="training source for decontamination; default: card, then run config")
    p.add_argument("--mesh", help="mesh to restore onto, e.g. data=8 (default: the saved one)")
    p.add_argument("--no-seqio", action="store_true", help="score probe rows directly, without seqio")
    p.add_argument("--review-sheet", help="spot-check sheet (default: <output>.review.jsonl)")


def _heldout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True, help="run directory holding checkpoints/")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    p.add_argument("--heldout", help="held-out documents: a JSON Lines file, a glob or a prepared folder (default: "
                   "the run's; required for a converted model)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per device call (default 8)")
    p.add_argument("--mesh", help="mesh to restore onto, e.g. data=8 (default: the saved one)")
    p.add_argument("--output", help="report JSON (default: none, the table only)")
    p.add_argument("--routing", choices=("causal", "train"), default=None,
                   help="how a mixture of experts routes the scored windows: causal (default; each token by itself, "
                        "no score sees a later token) or train (capacity and balancing over whole rows, as in "
                        "training: later tokens move earlier scores; to measure by how much)")


def _extrapolation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True, help="run directory holding checkpoints/")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    p.add_argument("--lengths", type=_lengths, required=True, help="context lengths, e.g. 512,1024,2048")
    p.add_argument("--trained-length", type=int, help="the reference length (default: the checkpoint's seq_len)")
    p.add_argument("--tolerance", type=float, default=None, help="relative tolerance of the effective length "
                   "(default 0.05)")
    p.add_argument("--heldout", help="held-out source (file or directory); default: the run's")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens scored per length (default 16384)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per device call (default 1)")
    p.add_argument("--mesh", help="mesh to restore onto, e.g. data=8 (default: the saved one)")
    p.add_argument("--output", help="report JSON (the plot goes next to it, .png; default "
                   "<workdir>/extrapolation/step_<N>.json)")


def _compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--card", help="needed when BASE/NEW are workdirs")
    p.add_argument("--mesh")
    p.add_argument("--no-seqio", action="store_true")
    p.add_argument("--output", help="comparison JSON")


def _spot_check_build_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heldout", required=True)
    p.add_argument("--output", required=True, help="prompt set JSON Lines")
    p.add_argument("--seed", type=int, default=0)


def _export_probes_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--card", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--train", required=True)
    cli.add_flag(p, "--output", "--output-dir", required=True, help="directory for one <task>.jsonl per task")


def _safety_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--labels", default=os.path.join("data", "labels", "safety-1"),
                   help="label set folder (harm_final.jsonl, responses_final.jsonl)")
    cli.add_flag(p, "--output", required=True, help="folder for the classifiers and classifiers.json")
    p.add_argument("--threshold", type=float, default=0.5, help="probability at which a text counts (default 0.5)")


def _safety_review_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", help="a card report with a safety section, written with --output (so it has a sheet)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write-template", metavar="FILE", help="write the generations to label (JSON Lines)")
    what.add_argument("--labels", metavar="FILE", help="the filled labels: decide the rates they cover")
    p.add_argument("--rates", help="with --write-template: comma-separated rates (default: those that blocked the "
                                   "version; none blocked: every rate with a threshold)")
    p.add_argument("--sheet", help="the report's generations sheet (default: the path the report records)")
    cli.add_flag(p, "--output", help="the reviewed report (default: <report>.reviewed.json)")


def _lm_eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--step", type=int)
    p.add_argument("--mesh")
    p.add_argument("--include-path", default=os.path.join("configs", "eval", "lm_eval"))
    p.add_argument("--limit", type=float)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output", help="results JSON")


#: Each command's one-line description and its flags.
_SUBPARSERS = {
    None: ("evaluate a checkpoint on an eval card", _card_flags),
    "heldout": ("held-out perplexity alone, overall and per domain and language, on any documents", _heldout_flags),
    "extrapolation": ("held-out loss by position at several context lengths; the effective extrapolation length",
                      _extrapolation_flags),
    "compare": ("compare two reports (or workdirs with --card); exit 1 on a regression", _compare_flags),
    "agreement": ("Cohen's kappa of a review sheet", lambda p: p.add_argument("sheet")),
    "card-stamp": ("bump a changed card's version", lambda p: p.add_argument("card")),
    "spot-check-build": ("(re)build a spot-check prompt set", _spot_check_build_flags),
    "export-probes": ("write each task's examples as JSON Lines", _export_probes_flags),
    "lm-eval": ("run lm-evaluation-harness tasks on a checkpoint", _lm_eval_flags),
    "safety-train": ("train the safety classifiers on a label set; print their held-out precision and recall",
                     _safety_train_flags),
    "safety-review": ("decide a report's safety rates by a person's labels; exit 1 if the version does not advance",
                      _safety_review_flags),
}


def build_parser(sub: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.evaluate SUB`` (``sub`` one of :data:`SUBCOMMANDS`); without
    ``sub``, the eval-card command's, whose ``--help`` lists the subcommands too."""
    what, add_flags = _SUBPARSERS[sub]
    if sub is None:
        p = argparse.ArgumentParser(prog="python -m jaxpt.tools.evaluate", description=__doc__.splitlines()[0],
                                    epilog="commands:\n" + __doc__.split("\n\n")[1],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        p = argparse.ArgumentParser(prog=f"python -m jaxpt.tools.evaluate {sub}", description=what)
    add_flags(p)
    return p


_COMMANDS = {None: cmd_run, "heldout": cmd_heldout, "extrapolation": cmd_extrapolation, "compare": cmd_compare, "agreement": cmd_agreement,
             "card-stamp": cmd_card_stamp, "spot-check-build": cmd_spot_check_build, "export-probes": cmd_export_probes,
             "lm-eval": cmd_lm_eval, "safety-train": cmd_safety_train,
             "safety-review": cmd_safety_review}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    if sub is None and any(a == "--lengths" or a.startswith("--lengths=") for a in argv):  # `jaxpt.evaluate`'s form
        print("note: --lengths without a subcommand is deprecated; use `extrapolation --lengths`", file=sys.stderr)
        sub, argv = "extrapolation", ["extrapolation", *argv]
    args = build_parser(sub).parse_args(argv[1:] if sub else argv)
    progress_lib.quiet_startup()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", force=True)
    for noisy in ("absl", "orbax", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return _COMMANDS[sub](args)
    except (CardError, CheckpointError, IncompatibleReports, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
