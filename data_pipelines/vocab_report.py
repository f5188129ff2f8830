"""`python -m data_pipelines.vocab_report`: the report that sizes the tokenizer's vocabulary.

    python -m data_pipelines.vocab_report --corpus DIR --sizes 4096,8192,16384,32768 \\
        --model-config configs/quickstart.gin [--config configs/data/tokenizer.gin] [--output REPORTDIR]

(``python -m data_pipelines.tokenizer report ...`` runs the same.) `--corpus` is read as the tokenizer reads it
(`data_pipelines.tokenizer.read_corpus`: a corpus version or a prepared sample), and the training sample is the
tokenizer's (`data_pipelines.tokenizer.balanced_sample`), so the report measures what training would get.

The report trains one tokenizer per size on that sample (kept in ``REPORTDIR/tokenizers/``), measures each on
held-out text the tokenizers never saw (`data_pipelines.tokenizer.measure`), and writes ``vocab_report.md``,
``vocab_report.csv`` (one row per size), ``bytes_per_token.csv`` (one row per size and slice of held-out
text), ``vocab_report.png`` and ``vocab_report.json``. `recommend` gives the rule behind the recommendation
(lowest training FLOPs per byte of text, `model_costs`). Same corpus, config and seed give the same numbers and
the same files (timings are only printed).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import io
import os
import pathlib
import sys
import time
from typing import Any, Iterable, Sequence

from jaxpt.data import tokenizer as tokenizer_lib
from jaxpt.util.errors import ConfigError

from data_pipelines.tokenizer_training import (DEFAULT_CONFIG, FORMAT_VERSION, TokenizerConfig, balanced_sample,
                                               common_flags, load_config, measure, read_corpus, write_json)


def model_costs(train_cfg: Any, vocab_size: int, bytes_per_token: float) -> dict[str, float]:
    """Vocabulary-dependent costs of `train_cfg`'s model (a `jaxpt.config.TrainConfig`) at `vocab_size`.

    Params from `jaxpt.model.decoder.count_params` with ``vocab_size`` replaced: ``embedding_params``
    (input table, V x d_model), ``output_params`` (d_model x V unless tied), their sum
    ``vocab_params``, its bytes in fp32 and bf16, and its share of all params. Training FLOPs per
    token from `jaxpt.training.flops.flops_per_token` (6 N_matmul + attention at ``TrainConfig.seq_len``;
    Kaplan et al. 2020, PaLM app. B), and per byte of text: FLOPs per token / `bytes_per_token`.
    """
    from jaxpt.training.flops import flops_per_token  # pylint: disable=g-import-not-at-top  (imports jax)
    from jaxpt.model.decoder import count_params  # pylint: disable=g-import-not-at-top

    model = dataclasses.replace(train_cfg.model, vocab_size=vocab_size)
    params = count_params(model)
    vocab_params = params["embedding"] + params["output"]
    flops = flops_per_token(model, train_cfg.seq_len)
    return {
        "total_params": params["total"], "embedding_params": params["embedding"],
        "output_params": params["output"], "vocab_params": vocab_params,
        "vocab_bytes_fp32": 4 * vocab_params, "vocab_bytes_bf16": 2 * vocab_params,
        "vocab_share": vocab_params / params["total"],
        "flops_per_token": flops, "flops_per_byte": flops / bytes_per_token,
    }


def parse_model_config(path: str | os.PathLike) -> Any:
    """The `jaxpt.config.TrainConfig` of a training gin file. Raises ConfigError naming the file.

    Clears gin's bindings (jaxpt.config.parse does); parse it after `load_config`.
    """
    from jaxpt import config as config_lib  # pylint: disable=g-import-not-at-top

    if not os.path.exists(path):
        raise ConfigError(f"--model-config {path}: no such file")
    try:
        return config_lib.parse([str(path)])
    except config_lib.ConfigError as e:
        raise ConfigError(f"--model-config {path}: {e}") from None


SUMMARY_SLICES = ("all", "english prose", "code", "other-language prose")


NEAR_TIE = 0.05  # FLOPs per byte within this share of the pick are named in the reasons as near ties


def recommend(rows: list[dict[str, Any]], flops_tolerance: float = 0.0) -> tuple[int, list[str]]:
    """The recommended vocabulary size among `rows` (one per size, as in ``vocab_report.csv``) and why.

    Rule: the size with the lowest training FLOPs per byte of held-out text wins: for a fixed amount
    of text it is the cheapest to train on (a larger vocabulary costs d_model FLOPs-parameters per
    piece in the output projection and pays back in fewer tokens per byte). With `flops_tolerance`
    > 0, every size within that share of the lowest counts as tied and the one packing the most
    bytes into a token wins. The rule weighs cost only; how loss per byte changes with the vocabulary
    at a fixed budget needs training runs (`jaxpt.tools.scaling`). The reasons give each group's
    compression against the smallest size, the next size's trade, near ties, and warnings when the
    vocabulary holds most of the parameters or many pieces go unused on held-out text.
    """
    rows = sorted(rows, key=lambda r: r["vocab_size"])
    best = min(r["flops_per_byte"] for r in rows)
    candidates = [r for r in rows if r["flops_per_byte"] <= best * (1 + flops_tolerance)]
    pick = max(candidates, key=lambda r: (r["bpt_all"], -r["vocab_size"]))
    reasons = ["Training FLOPs per byte of text (lower is cheaper): "
               + ", ".join(f"{r['vocab_size']}: {r['flops_per_byte']:.3g}" for r in rows)
               + f". {pick['vocab_size']} is the lowest" + (f" within {flops_tolerance:.0%}, with the most bytes "
                                                            "per token" if len(candidates) > 1 else "") + "."]
    near = [r for r in rows if r is not pick and r["flops_per_byte"] <= pick["flops_per_byte"] * (1 + NEAR_TIE)]
    if near:
        reasons.append("Near ties (FLOPs per byte within 5%): " + ", ".join(
            f"{r['vocab_size']} ({100 * (r['flops_per_byte'] / pick['flops_per_byte'] - 1):+.1f}% FLOPs/byte, "
            f"{100 * (r['bpt_all'] / pick['bpt_all'] - 1):+.1f}% bytes/token)" for r in near) + ".")
    small = rows[0]
    if pick is not small:
        gains = ", ".join(f"{name} {100 * (pick[key] / small[key] - 1):+.1f}%"
                          for name, key in (("English prose", "bpt_english_prose"), ("code", "bpt_code"),
                                            ("other-language prose", "bpt_other_language_prose"))
                          if pick.get(key) and small.get(key))
        reasons.append(f"Bytes per token against {small['vocab_size']}: {gains}.")
    bigger = [r for r in rows if r["vocab_size"] > pick["vocab_size"]]
    if bigger:
        nxt = bigger[0]
        gains = ", ".join(f"{name} {100 * (nxt[key] / pick[key] - 1):+.1f}%"
                          for name, key in (("all", "bpt_all"), ("English prose", "bpt_english_prose"),
                                            ("code", "bpt_code"), ("other-language prose", "bpt_other_language_prose"))
                          if nxt.get(key) and pick.get(key))
        reasons.append(
            f"The next size, {nxt['vocab_size']}, would gain bytes/token ({gains}) for "
            f"{100 * (nxt['flops_per_byte'] / pick['flops_per_byte'] - 1):+.1f}% FLOPs per byte and "
            f"{nxt['vocab_params'] - pick['vocab_params']:,} more vocabulary parameters.")
    reasons.append(f"Vocabulary parameters (embedding + output): {pick['vocab_params']:,} = "
                   f"{pick['vocab_share']:.0%} of the model; {pick['vocab_bytes_bf16'] / 2**20:.1f} MiB in bf16.")
    if pick["vocab_share"] > 0.5:
        reasons.append("Warning: the vocabulary holds most of this model's parameters, so the choice is driven by "
                       "model size; rerun the report with the target model config before a large run.")
    if pick["unused_piece_share"] > 0.1:
        reasons.append(f"Warning: {pick['unused_piece_share']:.0%} of the learned pieces never occur in held-out "
                       "text; the sample (or the held-out set) may be too small for this vocabulary.")
    reasons.append("This weighs cost only; the loss per byte at each size needs training runs (jaxpt.tools.scaling).")
    return int(pick["vocab_size"]), reasons


def _slice_key(name: str) -> str:
    return "bpt_" + name.replace(" ", "_").replace("-", "_")


def vocab_report(cfg: TokenizerConfig, corpus_dir: str | os.PathLike, sizes: Sequence[int],
                 model_config: str | os.PathLike, output: str | os.PathLike, *,
                 flops_tolerance: float = 0.0) -> dict[str, Any]:
    """Trains one tokenizer per size on the sample, measures held-out text, writes the report files.

    Returns the ``vocab_report.json`` record: ``rows`` (one per size: bytes per token of the
    `SUMMARY_SLICES`, tokens per document, `model_costs`, unused piece share, model sha256),
    ``slices`` (one per size and `slice_names` slice, from `measure`), ``recommendation`` and
    ``reasons`` (`recommend`), and the corpus, sample and model-config records.

    Raises:
      ConfigError: no sizes, a size SentencePiece cannot fill from the sample, or as `read_corpus`,
        `balanced_sample`, `parse_model_config`.
    """
    sizes = sorted(set(int(v) for v in sizes))
    if not sizes:
        raise ConfigError("--sizes: give at least one vocabulary size")
    cfg.validate()
    output = pathlib.Path(output)
    corpus = read_corpus(corpus_dir, cfg.heldout_fraction)
    if not corpus.heldout:
        raise ConfigError(f"--corpus {corpus_dir}: no held-out documents to measure")
    texts, composition = balanced_sample(corpus.train, cfg)
    train_cfg = parse_model_config(model_config)
    rows, slices = [], []
    for vocab_size in sizes:
        try:
            model_path = tokenizer_lib.train(texts, output / "tokenizers" / f"sp{vocab_size}.model",
                                             cfg.trainer_settings(vocab_size))
        except ValueError as e:
            raise ConfigError(f"--sizes {vocab_size}: {e}") from None
        tok = tokenizer_lib.Tokenizer.load(model_path)
        figures = measure(tok, corpus.heldout)
        slices += [{"vocab_size": vocab_size, "slice": name, **f} for name, f in figures.items() if name != "pieces"]
        row = {"vocab_size": vocab_size}
        row.update({_slice_key(name): figures[name]["bytes_per_token"] if name in figures else None
                    for name in SUMMARY_SLICES})
        row["tokens_per_document"] = figures["all"]["tokens_per_document"]
        row["unused_piece_share"] = figures["pieces"]["unused_share"]
        row.update(model_costs(train_cfg, vocab_size, figures["all"]["bytes_per_token"]))
        row["sha256"] = tok.sha256
        rows.append(row)
    pick, reasons = recommend(rows, flops_tolerance)
    record = {
        "format_version": FORMAT_VERSION,
        "config": dataclasses.asdict(cfg),
        "corpus": corpus.info,
        "sample": composition,
        "model_config": {"path": str(model_config), "seq_len": train_cfg.seq_len,
                         **dataclasses.asdict(train_cfg.model)},
        "flops_tolerance": flops_tolerance,
        "rows": rows,
        "slices": slices,
        "recommendation": pick,
        "reasons": reasons,
    }
    _write_report(record, output)
    return record


ROW_COLUMNS = ("vocab_size", "bpt_all", "bpt_english_prose", "bpt_code", "bpt_other_language_prose",
               "tokens_per_document", "embedding_params", "output_params", "vocab_params", "vocab_bytes_fp32",
               "vocab_bytes_bf16", "vocab_share", "total_params", "flops_per_token", "flops_per_byte",
               "unused_piece_share", "sha256")
SLICE_COLUMNS = ("vocab_size", "slice", "documents", "bytes", "tokens", "bytes_per_token", "tokens_per_document")


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _write_csv(path: pathlib.Path, columns: Sequence[str], rows: Iterable[dict]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_fmt(r.get(c)) for c in columns])
    path.write_text(buf.getvalue())


def _slice_order(name: str) -> tuple[int, str]:
    rank = {n: i for i, n in enumerate(SUMMARY_SLICES)}
    if name in rank:
        return (rank[name], "")
    return (len(rank) + (name.startswith("lang=")), name)


def _markdown(record: dict[str, Any]) -> str:
    rows, sizes = record["rows"], [r["vocab_size"] for r in record["rows"]]
    c, m, s = record["corpus"], record["model_config"], record["sample"]
    lines = [
        "# Vocabulary-size report", "",
        f"Corpus `{c['path']}` ({c['kind']}, data version {c['data_version'] or '-'}, content id "
        f"{(c['content_id'] or '-')[:16]}): {c['documents_train']} training and {c['documents_heldout']} held-out "
        f"documents (held out by {c['heldout_rule']}). Tokenizers: {record['config']['model_type']}, trained on a "
        f"{s['chars']:,}-character domain-balanced sample (seed {record['config']['seed']}); all figures are on "
        "held-out text the tokenizers never saw.",
        f"Model config `{m['path']}`: d_model {m['d_model']}, {m['num_layers']} layers, "
        f"{'tied' if m['tie_embeddings'] else 'untied'} embeddings, seq_len {m['seq_len']}.", "",
        f"## Recommendation: {record['recommendation']}", "",
        *[f"- {r}" for r in record["reasons"]], "",
        "## Cost and compression per size", "",
        "| vocab | bytes/token all | English prose | code | other-language prose | tokens/doc | embedding params "
        "| output params | vocab MiB fp32 | vocab MiB bf16 | vocab share | FLOPs/token | FLOPs/byte | unused pieces |",
        "|" + "---:|" * 14,
    ]
    for r in rows:
        bpt = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ROW_COLUMNS[1:5]]
        lines.append(
            f"| {r['vocab_size']} | {' | '.join(bpt)} | {r['tokens_per_document']:.1f} | {r['embedding_params']:,} "
            f"| {r['output_params']:,} | {r['vocab_bytes_fp32'] / 2**20:.1f} | {r['vocab_bytes_bf16'] / 2**20:.1f} "
            f"| {r['vocab_share']:.1%} | {r['flops_per_token']:.4g} | {r['flops_per_byte']:.4g} "
            f"| {r['unused_piece_share']:.1%} |")
    by_slice = collections.defaultdict(dict)
    for x in record["slices"]:
        by_slice[x["slice"]][x["vocab_size"]] = x
    for title, key, fmt in (("Bytes per token", "bytes_per_token", "{:.3f}"),
                            ("Mean tokens per document", "tokens_per_document", "{:.1f}")):
        lines += ["", f"## {title}, held-out text, by slice", "",
                  "| slice | documents | " + " | ".join(str(v) for v in sizes) + " |",
                  "|---|---:|" + "---:|" * len(sizes)]
        for name in sorted(by_slice, key=_slice_order):
            cells = [fmt.format(by_slice[name][v][key]) if v in by_slice[name] else "-" for v in sizes]
            lines.append(f"| {name} | {by_slice[name][sizes[0]]['documents']} | " + " | ".join(cells) + " |")
    lines += ["", "## Training sample", "",
              "| domain | weight | documents available | characters available | documents sampled | cut "
              "| characters sampled | share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, d in s["domains"].items():
        lines.append(f"| {name} | {d['weight']:g} | {d['documents_available']:,} | {d['chars_available']:,} "
                     f"| {d['documents_sampled']:,} | {d['documents_cut']:,} | {d['chars_sampled']:,} "
                     f"| {d['share']:.1%} |")
    lines += ["", "Slices: `english prose` = non-code documents labelled en; `other-language prose` = non-code "
              "documents in any other identified language; `code` = the code domain; `lang=und` = no language "
              "label. Bytes are UTF-8 bytes; ratios are of slice totals. Vocabulary params = input embedding + "
              "output projection (untied). FLOPs per byte = training FLOPs per token (6N + attention) / overall "
              "bytes per token. Unused pieces: learned pieces that no held-out document uses.",
              "", "Tokenizers: " + ", ".join(f"`tokenizers/sp{r['vocab_size']}.model` ({r['sha256'][:12]})"
                                              for r in rows), ""]
    return "\n".join(lines)


def _plot(record: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib  # pylint: disable=g-import-not-at-top
    import matplotlib.ticker  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    rows = record["rows"]
    sizes = [r["vocab_size"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SUMMARY_SLICES:
        ys = [r[_slice_key(name)] for r in rows]
        if all(y is not None for y in ys):
            ax1.plot(sizes, ys, marker="o", label=name)
    ax1.set(ylabel="bytes per token (held-out text)", title="Compression")
    ax1.legend(fontsize="small")
    flops = ax2.plot(sizes, [r["flops_per_byte"] for r in rows], marker="o", color="k", label="FLOPs per byte")
    ax2.set(ylabel="training FLOPs per byte of text",
            title=f"Cost for {pathlib.Path(record['model_config']['path']).name}")
    share_ax = ax2.twinx()
    share = share_ax.plot(sizes, [100 * r["vocab_share"] for r in rows], marker="s", color="C7",
                          label="vocabulary share of params")
    share_ax.set_ylabel("vocabulary params, % of model")
    ax2.axvline(record["recommendation"], color="k", linestyle=":", linewidth=1)
    ax2.legend(handles=flops + share, fontsize="small", loc="upper center")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(v) for v in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("vocabulary size")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _write_report(record: dict[str, Any], output: pathlib.Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    _write_csv(output / "vocab_report.csv", ROW_COLUMNS, record["rows"])
    _write_csv(output / "bytes_per_token.csv", SLICE_COLUMNS,
               sorted(record["slices"], key=lambda x: (x["vocab_size"], _slice_order(x["slice"]))))
    (output / "vocab_report.md").write_text(_markdown(record))
    _plot(record, output / "vocab_report.png")
    write_json(output / "vocab_report.json", record)


# --------------------------------------------------------------------------------------------- CLI


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: expected comma-separated integers") from None
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes: give at least one vocabulary size")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (module docstring). Returns the exit status: 0, or 2 with the error on stderr."""
    parser = argparse.ArgumentParser(
        prog="python -m data_pipelines.vocab_report",
        description="Train one tokenizer per vocabulary size and report compression and cost.")
    common_flags(parser, config_required=False)
    parser.add_argument("--sizes", required=True, type=_parse_sizes, help="e.g. 4096,8192,16384,32768")
    parser.add_argument("--model-config", required=True, help="training gin file, e.g. configs/quickstart.gin")
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("artifacts/vocab_report"),
                        help="report folder (default artifacts/vocab_report)")
    parser.add_argument("--flops-tolerance", type=float, default=0.0,
                        help="sizes within this share of the lowest FLOPs/byte tie; the most bytes/token "
                             "among them wins (default 0: the lowest FLOPs/byte)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.gin)
        record = vocab_report(cfg, args.corpus, args.sizes, args.model_config, args.output,
                              flops_tolerance=args.flops_tolerance)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}/vocab_report.md: recommendation {record['recommendation']} "
          f"({len(record['rows'])} sizes in {time.perf_counter() - start:.0f} s)")
    for reason in record["reasons"]:
        print(f"  - {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
