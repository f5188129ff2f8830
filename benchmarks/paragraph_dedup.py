"""Paragraph dedup (stage 6b, `ParagraphDedupConfig`), measured: what it removes from raw-v1, and the held-out loss of
the quickstart model trained on the bundled sample built with and without it.

    nice -n 5 python benchmarks/paragraph_dedup.py [--output workdirs/paragraph-dedup] [--steps 300] [--warmup-steps 30]
        [--raw-v1-root ../shared/corpus/raw-v1] [--skip-raw-v1] [--skip-training] [--gin BINDING ...]

Runs, as subprocesses, the commands a user would type (each printed before it runs; a step whose output already
exists is skipped, so an interrupted run picks up where it stopped):

1. ``python -m jaxpt.data.prepare --output artifacts/sample``: the quickstart's tokenizer, used by every build here
   (the tokenizer changes token counts only, not what paragraph dedup removes).
2. raw-v1 (``configs/data/raw_v1.gin``) built twice, without and with ``ParagraphDedupConfig.enabled = True`` (plus
   every ``--gin``); then, per source, units and bytes removed and documents dropped by the new reasons, read from
   the manifests, and a check that each build's counts add up (documents in = out + held out + every drop).
3. The bundled sample (``configs/data/sample_all.gin``: its four domains as one corpus version) built the same two
   ways, with the same figures.
4. The quickstart model (``configs/quickstart.gin``) trained ``--steps`` steps on each sample build (cosine over those
   steps after ``--warmup-steps``), and each model scored on both builds' held-out sets with the trainer's scorer (nats per token): the
   held-out texts differ between the builds (their boilerplate goes too), so the table crosses models and sets.

Figures only, never pass/fail; they belong on a dated results page. ``report.json`` in ``--output`` holds them all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import continued_pretraining as cpt  # noqa: E402  (the shared command runner, train command and held-out scorer)

TOKENIZER = "artifacts/sample/tokenizer.model"
ON = "ParagraphDedupConfig.enabled = True"


def build_cmd(py: str, config: str, out: str, extra: list[str]) -> list[str]:
    """The `data_pipelines.build` command line for ``config`` into ``out`` with the sample's tokenizer and ``extra``
    gin bindings.
    """
    cmd = [py, "-m", "data_pipelines.build", "--config", config, "--output", out,
           "--gin", f"OutputConfig.tokenizer_path = '{TOKENIZER}'"]
    for g in extra:
        cmd += ["--gin", g]
    return cmd


def build_pair(py: str, name: str, config: str, out: str, gin: list[str], extra: list[str]) -> dict[str, str]:
    """Builds `config` without and with paragraph dedup into ``out/corpus/<name>-{without,with}``; returns the dirs."""
    dirs = {}
    for side, bindings in (("without", extra), ("with", extra + [ON] + gin)):
        d = dirs[side] = f"{out}/corpus/{name}-{side}"
        cpt.run(build_cmd(py, config, d, bindings), done=os.path.join(ROOT, d, "manifest.json"))
    return dirs


def removal_figures(dirs: dict[str, str]) -> dict:
    """From the two manifests: per source, units and bytes removed and documents changed and dropped by stage 6b;
    documents and tokens out of each build; whether each build's counts add up."""
    m = {side: json.load(open(os.path.join(ROOT, d, "manifest.json"))) for side, d in dirs.items()}
    out = {"builds": {}}
    for side, man in m.items():
        drops = sum(n for reasons in man["documents_dropped"].values() for n in reasons.values())
        out["builds"][side] = {
            "documents_in": man["documents_in"], "documents_out": man["documents_out"],
            "documents_heldout": man["documents_heldout"], "documents_dropped": drops, "tokens_out": man["tokens_out"],
            "counts_add_up": man["documents_in"] == man["documents_out"] + man["documents_heldout"] + drops}
    out["paragraph_dedup"] = m["with"].get("paragraph_dedup", {})
    out["settings"] = m["with"]["stages"].get("paragraph_dedup", {})
    return out


def format_removal(name: str, fig: dict) -> str:
    """Markdown table of a build's paragraph-dedup removals (units, bytes, documents changed and dropped by reason), by
    source and in total.
    """
    pd = fig["paragraph_dedup"]
    lines = [f"### {name}", "", "| source | units removed | bytes removed | documents changed | all_removed | "
             "too_short_after_removal |", "|---|---:|---:|---:|---:|---:|"]
    for src, f in sorted(pd.get("by_source", {}).items()) + [("**total**", pd)]:
        d = f.get("documents_dropped", {})
        lines.append(f"| {src} | {f.get('units_removed', 0):,} | {f.get('bytes_removed', 0):,} | "
                     f"{f.get('documents_changed', 0):,} | {d.get('all_removed', 0):,} | "
                     f"{d.get('too_short_after_removal', 0):,} |")
    lines.append("")
    lines.append("by unit reason: " + ", ".join(f"{r} {v['units']:,} units / {v['bytes']:,} bytes"
                                                 for r, v in pd.get("by_reason", {}).items()))
    for side, b in fig["builds"].items():
        lines.append(f"{side}: in {b['documents_in']:,}, out {b['documents_out']:,}, held out "
                     f"{b['documents_heldout']:,}, dropped {b['documents_dropped']:,} (adds up: {b['counts_add_up']}), "
                     f"tokens out {b['tokens_out']:,}")
    return "\n".join(lines)


def format_losses(scores: dict, steps: int) -> str:
    """Markdown table of held-out loss (nats per token) for each trained/evaluated pair of with/without builds, then
    tokens and per-domain loss.
    """
    fmt = lambda sc, v: f"{sc[v]['loss']:.4f}" if v in sc else "-"  # noqa: E731
    lines = [f"### held-out loss (nats per token), quickstart model, {steps} steps on the sample", "",
             "| trained on | held-out set without | held-out set with |", "|---|---:|---:|"]
    for name in ("without", "with"):
        lines.append(f"| sample built {name} paragraph dedup | {fmt(scores[name], 'without')} | "
                     f"{fmt(scores[name], 'with')} |")
    lines.append("")
    for name in ("without", "with"):
        for v in ("without", "with"):
            if v in scores[name]:
                by = ", ".join(f"{d} {x:.3f}" for d, x in sorted(scores[name][v]["by_domain"].items()))
                lines.append(f"trained {name}, set {v}: {scores[name][v]['tokens']:,} tokens; {by}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build the sample with and without paragraph dedup, train the quickstart on each, score both held-out sets;
    prints the tables and writes report.json. Returns the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="workdirs/paragraph-dedup", help="folder for the builds, runs and report.json")
    p.add_argument("--steps", type=int, default=300, help="training steps of each quickstart run")
    p.add_argument("--warmup-steps", type=int, default=30, help="the quickstart's; below --steps")
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    p.add_argument("--raw-v1-root", default="../shared/corpus/raw-v1", help="raw-v1, relative to the repository")
    p.add_argument("--skip-raw-v1", action="store_true", help="build only the bundled sample")
    p.add_argument("--skip-training", action="store_true", help="build and count only")
    p.add_argument("--gin", action="append", default=[],
                   help="more ParagraphDedupConfig bindings for the 'with' builds")
    args = p.parse_args(argv)
    py, out = sys.executable, args.output.rstrip("/")
    times: dict[str, float] = {}
    t_all = time.perf_counter()
    report: dict = {"steps": args.steps, "gin": args.gin}

    times["prepare"] = cpt.run([py, "-m", "jaxpt.data.prepare", "--output", "artifacts/sample"])
    sections = []
    if not args.skip_raw_v1:
        t0 = time.perf_counter()
        raw = build_pair(py, "raw-v1", "configs/data/raw_v1.gin", out, args.gin,
                         [f"BuildConfig.source_root = '{args.raw_v1_root}'"])
        times["raw-v1 builds"] = time.perf_counter() - t0
        report["raw-v1"] = removal_figures(raw)
        sections.append(format_removal("raw-v1", report["raw-v1"]))
    t0 = time.perf_counter()
    sample = build_pair(py, "sample", "configs/data/sample_all.gin", out, args.gin, [])
    times["sample builds"] = time.perf_counter() - t0
    report["sample"] = removal_figures(sample)
    sections.append(format_removal("bundled sample", report["sample"]))

    if not args.skip_training:
        runs = {side: f"{out}/train-{side}" for side in sample}
        for side, wd in runs.items():
            cmd = cpt.train_cmd(py, wd, args.steps, sample[side], args.mesh,
                                [f"OptimizerConfig.decay_steps = {args.steps}",
                                 f"OptimizerConfig.warmup_steps = {args.warmup_steps}"])
            times[f"train {side}"] = cpt.run(cmd, done=os.path.join(ROOT, wd, "checkpoints", str(args.steps)))
        os.environ.update({k: v for k, v in cpt._env().items() if k in ("JAX_PLATFORMS", "XLA_FLAGS")})
        t0 = time.perf_counter()
        other = {"without": "with", "with": "without"}
        scores = {side: {side: cpt.trainer_heldout(wd)} for side, wd in runs.items()}
        for side, wd in runs.items():
            scores[side].update(cpt.heldout_losses(wd, {other[side]: sample[other[side]]}))
        times["held-out scoring"] = time.perf_counter() - t0
        report["heldout"] = scores
        sections.append(format_losses(scores, args.steps))

    report["wall_s"] = times
    report["total_wall_s"] = time.perf_counter() - t_all
    os.makedirs(os.path.join(ROOT, out), exist_ok=True)
    with open(os.path.join(ROOT, out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n\n".join(sections))
    print("wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()) + f"; total {report['total_wall_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
