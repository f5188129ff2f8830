"""``python -m jaxpt.tools.runs list|show|compare|plot``: read the run registry (:mod:`jaxpt.registry`).

    python -m jaxpt.tools.runs list [ROOT]                # a table over every run.json under ROOT (default: workdirs)
    python -m jaxpt.tools.runs show RUN                   # RUN is a workdir or a run id under ROOT
    python -m jaxpt.tools.runs compare RUN RUN            # config and final-metric differences side by side
    python -m jaxpt.tools.runs plot RUN... --output loss.png   # loss, grad norm and learning rate curves
    python -m jaxpt.tools.runs plot RUN --expert-shares --output shares.png   # MoE: tokens per expert, per layer
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from jaxpt import monitor
from jaxpt.errors import ConfigError
from jaxpt.registry import RUN_FILE


# ------------------------------------------------------------------------------------------- reading


def load_run(path_or_id: str, root: str = "workdirs") -> dict[str, Any]:
    """A run's record from its workdir, its run.json, or its run id under ``root``.

    Raises:
      FileNotFoundError: naming what was looked for.
    """
    candidates = [path_or_id, os.path.join(path_or_id, RUN_FILE)]
    for c in candidates:
        if os.path.isfile(c):
            with open(c) as f:
                rec = json.load(f)
            rec.setdefault("workdir", os.path.dirname(os.path.abspath(c)))
            return rec
    for rec in find_runs(root):
        if rec.get("run_id") == path_or_id:
            return rec
    raise FileNotFoundError(f"no run {path_or_id!r}: not a workdir with {RUN_FILE}, nor a run id under {root!r}")


def find_runs(root: str) -> list[dict[str, Any]]:
    """Every run.json under ``root`` (recursively), sorted by start time."""
    out = []
    for dirpath, _, files in os.walk(root):
        if RUN_FILE in files:
            try:
                with open(os.path.join(dirpath, RUN_FILE)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            rec.setdefault("workdir", dirpath)
            out.append(rec)
    return sorted(out, key=lambda r: r.get("started_at", ""))


def read_curves(workdir: str) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` for loss, grad_norm and learning_rate from metrics.jsonl (empty lists
    when there is none), one value per step in step order: :func:`jaxpt.monitor.read_metrics` leaves out records a
    resume or rollback superseded, and of any step still logged twice (a log written before supersede markers)
    the last value is kept. Raises MetricsFormatError as :func:`jaxpt.monitor.read_metrics`."""
    curves: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}, "learning_rate": {}}
    if os.path.exists(monitor.metrics_path(workdir)):
        for rec in monitor.read_metrics(workdir):
            for k in curves:
                if isinstance(rec.get(k), (int, float)) and "event" not in rec:
                    curves[k][rec["step"]] = float(rec[k])
    return {k: sorted(v.items()) for k, v in curves.items()}


_SHARE = re.compile(r"^moe/expert_share/layer(\d+)/expert(\d+)$")


def read_expert_shares(workdir: str) -> dict[int, dict[int, list[tuple[int, float]]]]:
    """``{moe_layer: {expert: [(step, share), ...]}}`` from the ``moe/expert_share/layer{j}/expert{i}`` series
    of metrics.jsonl (a mixture-of-experts run; empty otherwise), superseded records left out as in
    :func:`read_curves`. Raises MetricsFormatError as :func:`jaxpt.monitor.read_metrics`."""
    out: dict[int, dict[int, dict[int, float]]] = {}
    if os.path.exists(monitor.metrics_path(workdir)):
        for rec in monitor.read_metrics(workdir):
            if "event" in rec:
                continue
            for k, v in rec.items():
                m = _SHARE.match(k)
                if m and isinstance(v, (int, float)):
                    out.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[rec["step"]] = float(v)
    return {j: {e: sorted(pts.items()) for e, pts in sorted(experts.items())} for j, experts in sorted(out.items())}


def cmd_plot_expert_shares(recs: list[dict[str, Any]], output: str) -> str:
    """Draw each MoE layer's expert shares against step (one panel per layer, one line per expert, one line
    style per run) into ``output`` (PNG), with the uniform share ``1/E`` dotted.

    Raises:
      ValueError: no run has expert-share series (not a mixture-of-experts run).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shares = [read_expert_shares(rec["workdir"]) for rec in recs]
    layers = sorted({j for sh in shares for j in sh})
    if not layers:
        raise ValueError("no moe/expert_share series in " + ", ".join(r["workdir"] for r in recs))
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 2.2 * len(layers) + 0.8), sharex=True, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for r, (rec, sh) in enumerate(zip(recs, shares)):
        for ax, j in zip(axes[:, 0], layers):
            experts = sh.get(j, {})
            for e, pts in experts.items():
                xs, ys = zip(*pts)
                ax.plot(xs, ys, styles[r % len(styles)], color=f"C{e}", lw=1,
                        label=f"expert {e}" + (f" ({rec.get('run_id', rec['workdir'])})" if len(recs) > 1 else ""))
            if experts:
                ax.axhline(1 / len(experts), color="gray", ls=":", lw=0.8)
    for ax, j in zip(axes[:, 0], layers):
        ax.set_ylabel(f"MoE layer {j}\nshare")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain-text table."""
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_list(root: str) -> str:
    rows = []
    for r in find_runs(root):
        fin = r.get("final", {})
        rows.append([r.get("run_id"), r.get("status"), fin.get("step"), fin.get("train_loss"),
                     fin.get("heldout_loss"), r.get("mesh"), r.get("num_params"), len(r.get("events", [])),
                     r.get("started_at"), r.get("workdir")])
    return table(rows, ["run_id", "status", "step", "train_loss", "heldout_loss", "mesh", "params", "events",
                        "started_at", "workdir"])


def cmd_show(rec: dict[str, Any]) -> str:
    return json.dumps(rec, indent=2, default=str)


def cmd_compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = ["run_id", "status", "config_hash", "data_version", "mesh", "num_params", "target_steps"]
    rows = [[k, a.get(k), b.get(k), "" if a.get(k) == b.get(k) else "*"] for k in keys]
    rows.append(["tokenizer.sha256", a.get("tokenizer", {}).get("sha256"), b.get("tokenizer", {}).get("sha256"),
                 "" if a.get("tokenizer") == b.get("tokenizer") else "*"])
    rows.append(["git.commit", a.get("git", {}).get("commit"), b.get("git", {}).get("commit"),
                 "" if a.get("git") == b.get("git") else "*"])
    fa, fb = a.get("final", {}), b.get("final", {})
    for k in sorted(set(fa) | set(fb)):
        if k == "event":
            continue
        va, vb = fa.get(k), fb.get(k)
        delta = f"{vb - va:+.4g}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else ""
        rows.append([f"final.{k}", va, vb, delta])
    rows.append(["events", len(a.get("events", [])), len(b.get("events", [])), ""])
    return table(rows, ["field", "A", "B", "diff"])


def cmd_plot(recs: list[dict[str, Any]], output: str) -> str:
    """Draw loss, grad norm and learning rate against step for each run into ``output`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for rec in recs:
        curves = read_curves(rec["workdir"])
        for ax, (name, pts) in zip(axes, curves.items()):
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=rec.get("run_id", rec["workdir"]))
        for ev in rec.get("events", []):
            if ev.get("event") in ("rollback", "spike_skip", "nonfinite_skip") and "superseded_at" not in ev:
                for ax in axes:
                    ax.axvline(ev["step"], color="red", alpha=0.3, lw=0.8)
    for ax, name in zip(axes, ["loss", "grad norm", "learning rate"]):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpt.tools.runs", description="Inspect runs (run.json).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list")
    p.add_argument("root", nargs="?", default="workdirs")
    p = sub.add_parser("show")
    p.add_argument("run")
    p.add_argument("--root", default="workdirs")
    p = sub.add_parser("compare")
    p.add_argument("runs", nargs=2)
    p.add_argument("--root", default="workdirs")
    p = sub.add_parser("plot")
    p.add_argument("runs", nargs="+")
    p.add_argument("--root", default="workdirs")
    p.add_argument("--output", default="loss.png")
    p.add_argument("--expert-shares", action="store_true",
                   help="draw each MoE layer's share of tokens per expert instead of the loss curves")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            print(cmd_list(args.root))
        elif args.cmd == "show":
            print(cmd_show(load_run(args.run, args.root)))
        elif args.cmd == "compare":
            print(cmd_compare(*(load_run(r, args.root) for r in args.runs)))
        elif args.expert_shares:
            print(cmd_plot_expert_shares([load_run(r, args.root) for r in args.runs], args.output))
        else:
            print(cmd_plot([load_run(r, args.root) for r in args.runs], args.output))
    except ConfigError as e:  # a malformed metrics.jsonl (file and line named)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # ValueError: no expert shares to draw
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
