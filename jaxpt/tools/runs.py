"""``python -m jaxpt.tools.runs list|show|compare|plot``: read the run registry (:mod:`jaxpt.run.record`).

    python -m jaxpt.tools.runs list [ROOT]                # a table over every run.json under ROOT (default: workdirs)
    python -m jaxpt.tools.runs show RUN [--goodput-plot goodput.png]   # RUN is a workdir or a run id under ROOT
    python -m jaxpt.tools.runs compare RUN RUN            # config and final-metric differences side by side
    python -m jaxpt.tools.runs plot RUN... --output loss.png   # loss, grad norm and learning rate curves
    python -m jaxpt.tools.runs diagnose WORKDIR --step N  # replay a skipped spike: bad batch or optimizer state?
    python -m jaxpt.tools.runs plot RUN --expert-shares --output shares.png   # MoE: tokens per expert, per layer
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from jaxpt import config as config_lib
from jaxpt.lab.registry import find_runs, load_run, table
from jaxpt.run import monitor
from jaxpt.run.resolve import resolve_vocab
from jaxpt.tools import diagnose
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError

# ------------------------------------------------------------------------------------------- reading


def read_curves(workdir: str) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` for loss, grad_norm and learning_rate from metrics.jsonl (empty lists
    when there is none), one value per step in step order: :func:`jaxpt.run.monitor.read_metrics` leaves out records a
    resume or rollback superseded, and of any step still logged twice (a log written before supersede markers)
    the last value is kept. Raises MetricsFormatError as :func:`jaxpt.run.monitor.read_metrics`."""
    curves: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}, "learning_rate": {}, "heldout_loss": {},
                                           "heldout_partial_loss": {}}
    if fs.exists(monitor.metrics_path(workdir)):
        for rec in monitor.read_metrics(workdir):
            for k in curves:
                if isinstance(rec.get(k), (int, float)) and ("event" not in rec or k.startswith("heldout")):
                    curves[k][rec["step"]] = float(rec[k])
    return {k: sorted(v.items()) for k, v in curves.items()}


def read_expert_shares(workdir: str, metric: str = "expert_share"
                       ) -> dict[int, dict[int, list[tuple[int, float]]]]:
    """``{moe_layer: {expert: [(step, share), ...]}}`` from the ``moe/{metric}/layer{j}/expert{i}`` series of
    metrics.jsonl (a mixture-of-experts run; empty otherwise), superseded records left out as in
    :func:`read_curves`. ``metric``: ``expert_share`` (the realized routing) or ``router_share`` (the plain top-k
    of the router alone; :mod:`jaxpt.model.moe`). Raises MetricsFormatError as :func:`jaxpt.run.monitor.read_metrics`."""
    pattern = re.compile(rf"^moe/{re.escape(metric)}/layer(\d+)/expert(\d+)$")
    out: dict[int, dict[int, dict[int, float]]] = {}
    if fs.exists(monitor.metrics_path(workdir)):
        for rec in monitor.read_metrics(workdir):
            if "event" in rec:
                continue
            for k, v in rec.items():
                m = pattern.match(k)
                if m and isinstance(v, (int, float)):
                    out.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[rec["step"]] = float(v)
    return {j: {e: sorted(pts.items()) for e, pts in sorted(experts.items())} for j, experts in sorted(out.items())}


def cmd_plot_expert_shares(recs: list[dict[str, Any]], output: str) -> str:
    """Draw each MoE layer's expert shares against step (one panel per layer, one colour per expert, one line
    style per run) into ``output`` (PNG), with the uniform share ``1/E`` dotted. The realized shares
    (``moe/expert_share``) are drawn solid; where the run also logged ``moe/router_share`` (the router's own
    top-k, which Sinkhorn-balanced selection hides) and it differs, it is drawn faint in the same colour.

    Raises:
      ValueError: no run has expert-share series (not a mixture-of-experts run).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shares = [read_expert_shares(rec["workdir"]) for rec in recs]
    router = [read_expert_shares(rec["workdir"], "router_share") for rec in recs]
    layers = sorted({j for sh in shares for j in sh})
    if not layers:
        raise ValueError("no moe/expert_share series in " + ", ".join(r["workdir"] for r in recs))
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 2.2 * len(layers) + 0.8), sharex=True, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for r, (rec, sh, rsh) in enumerate(zip(recs, shares, router)):
        run = f" ({rec.get('run_id', rec['workdir'])})" if len(recs) > 1 else ""
        for ax, j in zip(axes[:, 0], layers):
            experts = sh.get(j, {})
            for e, pts in experts.items():
                xs, ys = zip(*pts)
                ax.plot(xs, ys, styles[r % len(styles)], color=f"C{e}", lw=1, label=f"expert {e}{run}")
                rpts = rsh.get(j, {}).get(e)
                if rpts and rpts != pts:
                    rx, ry = zip(*rpts)
                    ax.plot(rx, ry, styles[r % len(styles)], color=f"C{e}", lw=2.5, alpha=0.3,
                            label=f"expert {e}, router's own top-k{run}")
            if experts:
                ax.axhline(1 / len(experts), color="gray", ls=":", lw=0.8)
    for ax, j in zip(axes[:, 0], layers):
        ax.set_ylabel(f"MoE layer {j}\nshare")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fs.write_figure(fig, output, dpi=100)
    plt.close(fig)
    return output


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
    """run.json as JSON, then the goodput table (:func:`goodput_table`) when the sessions recorded one."""
    text = json.dumps(rec, indent=2, default=str)
    gp = goodput_table(rec)
    return text + ("\n\ngoodput (seconds of wall time per session):\n" + gp if gp else "")


def goodput_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per session with a recorded ``goodput`` (:class:`jaxpt.run.monitor.Goodput`), plus a ``total`` row:
    ``{"session", "steps", <category seconds>..., "wall_s", "goodput"}``."""
    rows = []
    for i, s in enumerate(rec.get("sessions", [])):
        g = s.get("goodput")
        if not g:
            continue
        rows.append({"session": str(i), "steps": f"{s.get('start_step', 0)}-{s.get('last_step', '?')}",
                     **{k: g.get(k, 0.0) for k in monitor.GOODPUT_CATEGORIES}, "wall_s": g.get("wall_s", 0.0)})
    if rows:
        total = {k: sum(r[k] for r in rows) for k in (*monitor.GOODPUT_CATEGORIES, "wall_s")}
        rows.append({"session": "total", "steps": "", **total})
    for r in rows:
        r["goodput"] = r["productive_s"] / r["wall_s"] if r["wall_s"] else 0.0
    return rows


def goodput_table(rec: dict[str, Any]) -> str:
    """The goodput rows as a plain-text table ('' when no session recorded one)."""
    rows = goodput_rows(rec)
    if not rows:
        return ""
    keys = ["session", "steps", *monitor.GOODPUT_CATEGORIES, "wall_s", "goodput"]
    return table([[r[k] for k in keys] for r in rows], keys)


def plot_goodput(rec: dict[str, Any], output: str) -> str:
    """A stacked bar per session (and the total) of where the wall time went, into ``output`` (PNG).

    Raises:
      ValueError: the run recorded no goodput.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = goodput_rows(rec)
    if not rows:
        raise ValueError(f"run {rec.get('run_id')} recorded no goodput (sessions without 'goodput')")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [r["session"] if r["session"] == "total" else f"session {r['session']}\nsteps {r['steps']}"
              for r in rows]
    bottom = [0.0] * len(rows)
    for k in monitor.GOODPUT_CATEGORIES:
        vals = [r[k] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=k.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in enumerate(rows):
        ax.text(x, r["wall_s"], f"{r['goodput']:.0%}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.1 * max(r["wall_s"] for r in rows))
    ax.set_ylabel("seconds of wall time")
    ax.set_title(f"goodput of {rec.get('run_id', '')} (label: productive share)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fs.write_figure(fig, output, dpi=100)
    plt.close(fig)
    return output


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


#: Event lines of the plot: ``{event: (colour, line style, legend label)}``.
EVENT_STYLES = {"rollback": ("red", "-", "rollback"), "spike_skip": ("orange", "--", "spike skipped"),
                "nonfinite_skip": ("purple", ":", "non-finite step skipped")}


def make_figure(recs: list[dict[str, Any]]):
    """The plot of :func:`cmd_plot` (a matplotlib figure): per run, the training loss with its held-out losses
    (``heldout_partial_loss`` of the in-loop evaluations, ``heldout_loss`` of full ones) as markers in the run's
    colour, the grad norm and the learning rate against step; skip and rollback events as vertical lines, one legend
    entry per kind. A loss axis spanning less than a factor of 4 stays linear, and every axis labels its ticks as
    plain numbers (``3.2``, not ``3.2 x 10^0``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    seen_events, losses = set(), []
    for i, rec in enumerate(recs):
        curves, colour, name = read_curves(rec["workdir"]), f"C{i}", rec.get("run_id", rec["workdir"])
        for ax, key in zip(axes, ("loss", "grad_norm", "learning_rate")):
            if curves[key]:
                ax.plot(*zip(*curves[key]), color=colour, label=f"{name} train" if key == "loss" else name)
        for key, marker, what in (("heldout_partial_loss", "o", "held-out (partial)"), ("heldout_loss", "s",
                                                                                        "held-out")):
            if curves[key]:
                axes[0].plot(*zip(*curves[key]), color=colour, marker=marker, ls=":", ms=5, label=f"{name} {what}")
        losses += [v for key in ("loss", "heldout_loss", "heldout_partial_loss") for _, v in curves[key]]
        for ev in rec.get("events", []):
            style = EVENT_STYLES.get(ev.get("event"))
            if style is None or "superseded_at" in ev:
                continue
            for ax in axes:
                ax.axvline(ev["step"], color=style[0], ls=style[1], alpha=0.5, lw=0.8,
                           label=style[2] if ax is axes[0] and style[2] not in seen_events else None)
            seen_events.add(style[2])
    for ax, name in zip(axes, ["loss (nats)", "grad norm", "learning rate"]):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if losses and min(losses) > 0 and max(losses) / min(losses) > 4:
        axes[0].set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:.3g}")
    for ax in axes:
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if ax.get_yscale() == "log" else ax.yaxis.get_minor_formatter())
    axes[-1].set_xlabel("step")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def cmd_plot(recs: list[dict[str, Any]], output: str) -> str:
    """Draw :func:`make_figure` of the runs into ``output`` (PNG, local or ``gs://``)."""
    import matplotlib.pyplot as plt
    fig = make_figure(recs)
    fs.write_figure(fig, output, dpi=100)
    plt.close(fig)
    return output


def cmd_diagnose(args) -> str:
    """Run :func:`jaxpt.tools.diagnose.diagnose` for ``args.workdir`` at ``args.step``; its text."""
    injector = None
    if args.inject_random_tokens is not None:
        cfg = resolve_vocab(config_lib.parse([fs.join(args.workdir, "config.gin")]))
        injector = diagnose.RandomTokens(args.inject_random_tokens, cfg.model.vocab_size, args.inject_seed)
    return diagnose.diagnose(args.workdir, args.step, args.refs, injector).text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpt.tools.runs", description="Inspect runs (run.json).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list")
    p.add_argument("root", nargs="?", default="workdirs")
    p = sub.add_parser("show")
    p.add_argument("run")
    p.add_argument("--root", default="workdirs")
    p.add_argument("--goodput-plot", metavar="PNG", help="also draw the goodput stacked bars into this file")
    p = sub.add_parser("compare")
    p.add_argument("runs", nargs=2)
    p.add_argument("--root", default="workdirs")
    p = sub.add_parser("plot")
    p.add_argument("runs", nargs="+")
    p.add_argument("--root", default="workdirs")
    p.add_argument("--output", help="PNG to write (default: loss.png, or expert_shares.png with --expert-shares)")
    p.add_argument("--expert-shares", action="store_true",
                   help="draw each MoE layer's share of tokens per expert (realized, and the router's own top-k "
                        "where it differs) instead of the loss curves")
    p = sub.add_parser("diagnose", help="replay step N from the checkpoint before it (jaxpt.tools.diagnose)")
    p.add_argument("workdir")
    p.add_argument("--step", type=int, required=True, help="the step whose spike to diagnose")
    p.add_argument("--refs", type=int, default=4, help="reference batches after the step for the control")
    p.add_argument("--inject-random-tokens", type=int, metavar="STEP",
                   help="the run was trained with jaxpt.tools.diagnose.RandomTokens at STEP (a drill): replay it")
    p.add_argument("--inject-seed", type=int, default=0, help="RandomTokens seed of that drill")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            print(cmd_list(args.root))
        elif args.cmd == "show":
            rec = load_run(args.run, args.root)
            print(cmd_show(rec))
            if args.goodput_plot:
                print(plot_goodput(rec, args.goodput_plot))
        elif args.cmd == "compare":
            print(cmd_compare(*(load_run(r, args.root) for r in args.runs)))
        elif args.cmd == "diagnose":
            print(cmd_diagnose(args))
        elif args.expert_shares:
            print(cmd_plot_expert_shares([load_run(r, args.root) for r in args.runs],
                                         args.output or "expert_shares.png"))
        else:
            print(cmd_plot([load_run(r, args.root) for r in args.runs], args.output or "loss.png"))
    except ConfigError as e:  # a malformed metrics.jsonl (file and line named)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # ValueError: no expert shares to draw
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
