"""The eval card's safety section on three checkpoints: the quickstart's; a base model converted from a Hugging
Face folder (the quickstart exported with ``jaxpt-to-hf`` and read back with ``hf-to-jaxpt``, since no base model can
be downloaded here); and a version that should not advance: the quickstart continued ``--harmful-steps`` steps on
the harmful texts of the label set's train split (``data/labels/safety-1``), the stand-in for a data mistake.
Figures only, never pass/fail; they go to docs/results/safety.md.

    nice -n 5 python benchmarks/safety_eval.py [--workdir workdirs/quickstart] [--output workdirs/safety-eval]
        [--card configs/eval/card_v1.yaml] [--sample artifacts/sample] [--harmful-steps 100]

Runs, as subprocesses, the commands a user would type (each printed before it runs): the card evaluation of the run
(``--no-seqio``), the export, the conversion, the card evaluation of the converted model (on the sample's held-out and
training files, which a converted model needs to be given). Prints per model and rate: the value, the count, the 95%
interval, the card's threshold and the verdict, the exit status of each evaluation, the counted outputs by prompt
category, and a few counted outputs, so a reader sees what the classifier counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from continued_pretraining import ROOT, _env, _quote

from jaxpt.eval import safety


def evaluate(py: str, card: str, workdir: str, output: str, extra: list[str]) -> tuple[int, float]:
    cmd = [py, "-m", "jaxpt.tools.evaluate", "--workdir", workdir, "--card", card, "--output", output,
           "--no-seqio", *extra]
    print("$ " + " ".join(_quote(c) for c in cmd), flush=True)
    if os.path.exists(output):  # an interrupted run picks up where it stopped
        print(f"  (skipped: {output} exists)", flush=True)
        rep = json.load(open(output))
        return (0 if rep["safety"]["advances"] else 1), rep["timing_s"]["total"]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=_env()).returncode
    dt = time.perf_counter() - t0
    print(f"  (exit {rc}, {dt:.0f} s)", flush=True)
    if rc not in (0, 1):
        raise SystemExit(f"evaluation failed with exit status {rc}")
    return rc, dt


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(_quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True)


def summarize(name: str, report_path: str, rc: int, seconds: float) -> list[str]:
    rep = json.load(open(report_path))
    s = rep["safety"]
    lines = [f"| {name} | step {rep['checkpoint']['step']} | exit {rc} | "
             f"{'advances' if s['advances'] else 'does not advance: ' + '; '.join(s['blocked_by'])} | "
             f"{rep['timing_s']['safety']:.0f} s of {seconds:.0f} s |"]
    lines.append("")
    lines.append("| rate | value | count / n | 95% interval | threshold | passes |")
    lines.append("|---|---:|---:|---|---|---|")
    for rate, r in s["rates"].items():
        thr = "none" if r["threshold"] is None else f"{r['side']} {r['threshold']:.2f}"
        lines.append(f"| {rate} | {r['value']:.3f} | {r['count']} / {r['n']} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} "
                     f"| {thr} | {r['passes']} |")
    sheet = [json.loads(x) for x in open(s["sheet"])]
    counted = collections.Counter((r["set"], r.get("category")) for r in sheet if r["counted"])
    lines.append("")
    lines.append("counted by set and category: " + (", ".join(f"{k[0]}/{k[1]} {v}" for k, v in sorted(counted.items()))
                                                    or "none"))
    for r in [r for r in sheet if r["counted"]][:4]:
        lines.append(f"  e.g. {r['set']} {r['id']} p={r['probability']:.2f}: {r['prompt'][:60]!r} -> "
                     f"{r['output'][:80]!r}")
    return lines


def parent_step(workdir: str) -> int:
    """The newest checkpoint step of ``workdir`` (a stage's ``--steps`` counts on from it)."""
    return max(int(d) for d in os.listdir(os.path.join(ROOT, workdir, "checkpoints")) if d.isdigit())


def harmful_version(py: str, args, out: str) -> tuple[int, float]:
    """The quickstart continued on the label set's harmful train-split texts (prepared with its tokenizer), evaluated
    on the card with the quickstart's held-out and training files; returns (exit status, seconds)."""
    docs = f"{out}/harmful-docs.jsonl"
    rows = safety.read_labels(os.path.join(ROOT, "data/labels/safety-1/harm_final.jsonl"), "text", "harmful")
    with open(docs, "w") as f:
        for r in rows:
            if r["harmful"] and safety.split_of(r["id"]) == "train":
                f.write(json.dumps({"id": r["id"], "text": r["text"]}) + "\n")
    data, run_dir = f"{out}/harmful-data", f"{out}/harmful-run"
    if not os.path.exists(f"{data}/data.gin"):
        run([py, "-m", "jaxpt.data.prepare", "--source", docs, "--output", data,
             "--tokenizer", f"{args.sample}/tokenizer.model"])
    if not os.path.isdir(f"{run_dir}/checkpoints"):
        run([py, "-m", "jaxpt.train", "--config", "configs/quickstart.gin", "--config", f"{data}/data.gin",
             "--workdir", run_dir, "--steps", str(parent_step(args.workdir) + args.harmful_steps),
             "--gin", f"TrainConfig.init_from = '{args.workdir}'", "--gin", "TrainConfig.stage_name = 'harmful'",
             "--gin", "OptimizerConfig.warmup_steps = 10", "--gin", f"OptimizerConfig.decay_steps = {args.harmful_steps}",
             "--gin", "TrainConfig.eval_every = 0"])
    return evaluate(py, args.card, run_dir, f"{out}/harmful.json",
                    ["--heldout", f"{args.sample}/heldout.jsonl.gz", "--train", f"{args.sample}/train.jsonl.gz"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="workdirs/quickstart")
    p.add_argument("--output", default="workdirs/safety-eval")
    p.add_argument("--card", default="configs/eval/card_v1.yaml")
    p.add_argument("--sample", default="artifacts/sample", help="the prepared sample (held-out and training files)")
    p.add_argument("--harmful-steps", type=int, default=100, help="steps of the continued run on harmful texts")
    args = p.parse_args()
    py = sys.executable
    out = os.path.abspath(args.output)
    os.makedirs(out, exist_ok=True)
    rc_q, dt_q = evaluate(py, args.card, args.workdir, f"{out}/quickstart.json", [])
    hf, converted = f"{out}/hf", f"{out}/converted"
    if not os.path.exists(f"{hf}/config.json"):
        run([py, "-m", "jaxpt.tools.convert", "jaxpt-to-hf", "--workdir", args.workdir, "--output", hf])
    if not os.path.exists(f"{converted}/model.gin"):
        run([py, "-m", "jaxpt.tools.convert", "hf-to-jaxpt", "--model", hf, "--output", converted])
    rc_c, dt_c = evaluate(py, args.card, converted, f"{out}/converted.json",
                          ["--heldout", f"{args.sample}/heldout.jsonl.gz", "--train", f"{args.sample}/train.jsonl.gz"])
    rc_h, dt_h = harmful_version(py, args, out)
    head = ["", "| model | checkpoint | evaluate | verdict | safety time |", "|---|---|---|---|---|"]
    lines = head + summarize("quickstart", f"{out}/quickstart.json", rc_q, dt_q)
    lines += head + summarize("converted (quickstart via a Hugging Face Llama folder)", f"{out}/converted.json",
                              rc_c, dt_c)
    lines += head + summarize(f"quickstart continued {args.harmful_steps} steps on harmful texts",
                              f"{out}/harmful.json", rc_h, dt_h)
    rc_cmp = subprocess.run([py, "-m", "jaxpt.tools.evaluate", "compare", f"{out}/quickstart.json",
                             f"{out}/harmful.json", "--output", f"{out}/compare.json"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True)
    lines += ["", f"compare quickstart -> harmful: exit {rc_cmp.returncode}", rc_cmp.stdout.splitlines()[0]]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
