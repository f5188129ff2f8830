"""Continued pretraining, measured: a base model, a new corpus version, held-out loss before and after.

    nice -n 5 python benchmarks/continued_pretraining.py [--output workdirs/cpt] [--base-steps 200] [--steps 100]
        [--hf-steps 20] [--warmup-steps 10] [--mesh data=2,fsdp=2,tensor=2] [--score-scratch-on-old]

Runs, as subprocesses, the commands a user would type (each printed before it runs; a step whose output already
exists is skipped, so an interrupted run picks up where it stopped):

1. ``python -m jaxpt.data.prepare --output artifacts/sample``: the quickstart's tokenizer (every run below uses it).
2. ``python -m data_pipelines.build`` twice, from the bundled sample: the *old* corpus version
   (``configs/data/sample_prose.gin``: web + reference, English prose) and the *new* one
   (``configs/data/sample_code_ml.gin``: code + multilingual). Each keeps 5% of its documents as ``heldout/``.
3. **base**: the quickstart model trained ``--base-steps`` steps on the old version (cosine over those steps).
4. **continued**: ``TrainConfig.init_from = <base>`` on the new version, ``--steps`` more steps, a fresh optimizer
   (``reset_optimizer``) and a fresh schedule (the quickstart's peak 3e-3, ``warmup_steps`` 10, cosine to 10% over
   the stage's steps).
5. **scratch**: the same model, data, steps and schedule from random weights: what continuing must beat.
6. **continued via HF** (``--hf-steps`` > 0): ``jaxpt-to-hf`` of the base, ``hf-to-jaxpt`` of that folder, then
   the continued run again with ``init_from`` = the converted directory. It starts at step 0 instead of the base's
   step, with the same data, schedule and fresh optimizer, so its losses must equal the direct run's step for
   step (fp32 throughout, and the HF round trip is exact).

Then every model is scored on both versions' held-out sets with the trainer's own held-out scorer
(:mod:`jaxpt.eval.heldout`: every document, rolling windows of ``seq_len`` with stride ``seq_len // 2``, nats per
scored token), and the table is printed (markdown) and written to ``<output>/report.json``. "before" is the base
model; forgetting is the rise of the old version's held-out loss.

Figures only, never pass/fail; they go to the README ("Continued pretraining, measured").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=600 --xla_cpu_collective_timeout_seconds=600")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("XLA_FLAGS", XLA_FLAGS)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _quote(arg: str) -> str:
    """Shell quoting that reads like the README's commands: "Class.field = 'value'" rather than shlex's
    '"'"' dance."""
    if "'" in arg and not any(c in arg for c in '"$`\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def run(cmd: list[str], done: str | None = None) -> float:
    """Runs ``cmd`` in the repository root unless ``done`` (a path) exists; returns its wall seconds (0 if
    skipped). Raises CalledProcessError when it fails."""
    print("$ " + " ".join(_quote(c) for c in cmd), flush=True)
    if done and os.path.exists(done):
        print(f"  (skipped: {done} exists)", flush=True)
        return 0.0
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True)
    dt = time.perf_counter() - t0
    print(f"  ({dt:.0f} s)", flush=True)
    return dt


def train_cmd(py: str, workdir: str, steps: int, corpus: str, mesh: str, extra: list[str],
              configs: tuple[str, ...] = ("configs/quickstart.gin",)) -> list[str]:
    cmd = [py, "-m", "jaxpt.train"]
    for c in configs:
        cmd += ["--config", c]
    cmd += ["--workdir", workdir, "--steps", str(steps), "--mesh", mesh,
            "--gin", "DataConfig.source = 'corpus'", "--gin", f"DataConfig.corpus_dir = '{corpus}'",
            "--gin", "DataConfig.tokenizer_path = 'artifacts/sample/tokenizer.model'",
            "--gin", "TrainConfig.eval_every = 0", "--gin", "HeldoutEvalConfig.enabled = True",
            "--gin", "HeldoutEvalConfig.group_by = ('domain',)"]
    for g in extra:
        cmd += ["--gin", g]
    return cmd


def final_record(workdir: str) -> dict:
    """The run's last ``metrics.jsonl`` record holding ``heldout_loss`` (the trainer's final evaluation)."""
    from jaxpt.run import monitor
    recs = [r for r in monitor.read_metrics(os.path.join(ROOT, workdir)) if "heldout_loss" in r]
    return recs[-1] if recs else {}


def trainer_heldout(workdir: str) -> dict:
    """The run's final held-out figures from its ``metrics.jsonl`` (overall and ``heldout/domain/<d>/loss``)."""
    rec = final_record(workdir)
    by_domain = {k.split("/")[2]: v for k, v in rec.items() if k.startswith("heldout/domain/") and k.endswith("/loss")}
    return {"loss": rec["heldout_loss"], "tokens": int(rec["heldout_tokens"]), "by_domain": by_domain,
            "step": rec["step"], "scored_by": "trainer"}


def step_losses(workdir: str) -> dict[int, float]:
    """``{step: loss}`` of every logged training step of the run."""
    from jaxpt.run import monitor
    return {r["step"]: r["loss"] for r in monitor.read_metrics(os.path.join(ROOT, workdir)) if "loss" in r}


def heldout_losses(workdir: str, sources: dict[str, str]) -> dict[str, dict]:
    """The newest checkpoint of ``workdir`` scored on each held-out source (nats per token, overall and by
    domain) with the scorer the trainer and ``jaxpt.tools.evaluate`` use."""
    import jaxpt
    from jaxpt.eval import heldout as heldout_lib
    from jaxpt.eval.scorer import scorer_for_restored
    restored = jaxpt.restore(os.path.join(ROOT, workdir))
    scorer = scorer_for_restored(restored, batch_size=16)
    out = {}
    for name, src in sources.items():
        docs = heldout_lib.load_documents(os.path.join(ROOT, src), "heldout")
        hset = heldout_lib.HeldoutSet.build(docs, restored.tokenizer, seq_len=scorer.seq_len,
                                            document_boundary=restored.config.data.document_boundary)
        rep = heldout_lib.perplexity_report(scorer, hset, group_by=("domain",))
        out[name] = {"loss": rep["overall"]["loss"], "tokens": rep["overall"]["tokens"],
                     "documents": rep["overall"]["documents"],
                     "by_domain": {d: f["loss"] for d, f in rep["by_domain"].items()}, "step": restored.step,
                     "scored_by": "benchmark"}
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, ROOT)
    from jaxpt.util import cli  # the shared flag grammar (old snake_case spellings: deprecated aliases)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_flag(p, "--output", "--out", default="workdirs/cpt",
                 help="folder for corpus versions, runs and report.json")
    cli.add_flag(p, "--base-steps", "--base_steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=100, help="steps of the continued and the scratch runs")
    cli.add_flag(p, "--hf-steps", "--hf_steps", type=int, default=20,
                 help="steps of the HF round-trip run, compared step for step with the direct one (0: skip it)")
    cli.add_flag(p, "--score-scratch-on-old", "--score_scratch_on_old", action="store_true",
                 help="also score the scratch model on the old set")
    cli.add_flag(p, "--base-warmup-steps", "--base_warmup_steps", type=int, default=30, help="the quickstart's")
    cli.add_flag(p, "--warmup-steps", "--warmup_steps", type=int, default=10,
                 help="warm-up of the continued and scratch runs")
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    args = p.parse_args(argv)
    py, out = sys.executable, args.output.rstrip("/")
    old, new = f"{out}/corpus/sample-prose", f"{out}/corpus/sample-code-ml"
    times: dict[str, float] = {}
    t_all = time.perf_counter()

    times["prepare"] = run([py, "-m", "jaxpt.data.prepare", "--output", "artifacts/sample"])
    times["build old"] = run([py, "-m", "data_pipelines.build", "--config", "configs/data/sample_prose.gin",
                              "--output", old], done=os.path.join(ROOT, old, "manifest.json"))
    times["build new"] = run([py, "-m", "data_pipelines.build", "--config", "configs/data/sample_code_ml.gin",
                              "--output", new], done=os.path.join(ROOT, new, "manifest.json"))

    b, s = args.base_steps, args.steps
    stage = ["OptimizerConfig.warmup_steps = %d" % args.warmup_steps, f"OptimizerConfig.decay_steps = {s}"]
    runs = {"base": f"{out}/base", "continued": f"{out}/continued", "scratch": f"{out}/scratch"}
    times["base"] = run(train_cmd(py, runs["base"], b, old, args.mesh, [f"OptimizerConfig.decay_steps = {b}",
                                   f"OptimizerConfig.warmup_steps = {args.base_warmup_steps}"]),
                        done=os.path.join(ROOT, runs["base"], "checkpoints", str(b)))
    times["continued"] = run(train_cmd(
        py, runs["continued"], b + s, new, args.mesh,
        [f"TrainConfig.init_from = '{runs['base']}'", "TrainConfig.stage_name = 'continued'",
         "TrainConfig.reset_optimizer = True", *stage]),
        done=os.path.join(ROOT, runs["continued"], "checkpoints", str(b + s)))
    times["scratch"] = run(train_cmd(py, runs["scratch"], s, new, args.mesh, stage),
                           done=os.path.join(ROOT, runs["scratch"], "checkpoints", str(s)))
    if args.hf_steps:
        hf, conv = f"{out}/hf-base", f"{out}/base-from-hf"
        runs["continued via HF"] = f"{out}/continued-hf"
        times["jaxpt-to-hf"] = run([py, "-m", "jaxpt.tools.convert", "jaxpt-to-hf", "--workdir", runs["base"],
                                    "--output", hf], done=os.path.join(ROOT, hf, "config.json"))
        times["hf-to-jaxpt"] = run([py, "-m", "jaxpt.tools.convert", "hf-to-jaxpt", "--model", hf, "--output", conv],
                                   done=os.path.join(ROOT, conv, "model.gin"))
        times["continued via HF"] = run(train_cmd(
            py, runs["continued via HF"], args.hf_steps, new, args.mesh,
            [f"TrainConfig.init_from = '{conv}'", "TrainConfig.stage_name = 'continued'", *stage],
            configs=("configs/quickstart.gin", f"{conv}/model.gin")),
            done=os.path.join(ROOT, runs["continued via HF"], "checkpoints", str(args.hf_steps)))

    # Each run's own held-out figures are its trainer's final evaluation (the same scorer, every window); the
    # other version's held-out set is scored here, for the models the table needs.
    os.environ.update({k: v for k, v in _env().items() if k in ("JAX_PLATFORMS", "XLA_FLAGS")})
    t0 = time.perf_counter()
    own = {"base": "old", "continued": "new", "scratch": "new", "continued via HF": "new"}
    scores: dict[str, dict] = {name: {own[name]: trainer_heldout(wd)} for name, wd in runs.items()}
    cross = {"base": "new", "continued": "old"}
    if args.score_scratch_on_old:
        cross["scratch"] = "old"
    for name, version in cross.items():
        scores[name].update(heldout_losses(runs[name], {version: {"new": new, "old": old}[version]}))
    times["held-out scoring"] = time.perf_counter() - t0

    report = {"base_steps": b, "steps": s, "hf_steps": args.hf_steps, "mesh": args.mesh, "runs": runs,
              "corpus": {"old": old, "new": new}, "heldout": scores, "wall_s": times,
              "total_wall_s": time.perf_counter() - t_all}
    if args.hf_steps:
        direct, via_hf = step_losses(runs["continued"]), step_losses(runs["continued via HF"])
        pairs = [(k, direct[b + k], via_hf[k]) for k in sorted(via_hf) if b + k in direct]
        report["hf_vs_direct"] = {"steps_compared": len(pairs), "steps": [k for k, _, _ in pairs],
                                  "max_abs_loss_diff": max((abs(x - y) for _, x, y in pairs), default=None)}
    with open(os.path.join(ROOT, out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(format_table(report))
    return 0


def format_table(report: dict) -> str:
    """The report as the README's markdown table plus per-domain losses, the HF check and wall times."""
    h = report["heldout"]
    b, s = report["base_steps"], report["steps"]
    rows = [("base (before)", f"{b} steps on old", h["base"]),
            ("continued (after)", f"base + {s} steps on new", h["continued"]),
            ("scratch", f"{s} steps on new", h["scratch"])]
    if "continued via HF" in h:
        rows.append(("continued via HF", f"base -> HF -> jaxpt + {report['hf_steps']} steps on new",
                     h["continued via HF"]))
    fmt = lambda sc, v: f"{sc[v]['loss']:.4f}" if v in sc else "-"  # noqa: E731
    lines = ["| model | training | new held-out loss | old held-out loss |", "|---|---|---:|---:|"]
    lines += [f"| {name} | {what} | {fmt(sc, 'new')} | {fmt(sc, 'old')} |" for name, what, sc in rows]
    lines.append("")
    for name, _, sc in rows:
        lines.append(f"{name} by domain: " + ", ".join(
            f"{d} {v:.3f}" for v in ("new", "old") if v in sc for d, v in sorted(sc[v]["by_domain"].items())))
    lines.append("held-out tokens scored: new %d, old %d" % (h["continued"]["new"]["tokens"],
                                                          h["base"]["old"]["tokens"]))
    if "hf_vs_direct" in report:
        c = report["hf_vs_direct"]
        lines.append(f"HF round trip vs direct, logged training losses at the HF run's steps {c.get('steps')} (direct: "
                     f"+{b}): max |diff| {c['max_abs_loss_diff']}")
    lines.append("wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in report["wall_s"].items())
                 + f"; total {report['total_wall_s']:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
