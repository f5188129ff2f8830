"""``python -m jaxpt.tools.mixtures``: a mixture experiment by proxy runs, from a corpus to a proposed mixture.

    python -m jaxpt.tools.mixtures run --experiment configs/mixtures/sample.gin       # proxies, fit, proposal
    python -m jaxpt.tools.mixtures fit --experiment configs/mixtures/sample.gin       # refit from the database
    python -m jaxpt.tools.mixtures validate --experiment configs/mixtures/sample.gin  # at a larger scale
    python -m jaxpt.train --config configs/quickstart.gin --config runs/mixtures/sample-balanced/proposal.gin

The experiment, its files and what each command does: :mod:`jaxpt.lab.mixtures`. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import numpy as np

from jaxpt.config import ConfigError
from jaxpt.lab import mixture_search as search
from jaxpt.lab.mixtures import TRUSTED_SPEARMAN, fit_and_propose, outside_proxies, run_proxies, validate
from jaxpt.util import progress as progress_lib


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.mixtures`` (``run``, ``fit``, ``validate``)."""
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.mixtures", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in (("run", "train the proxies not yet done, fit, propose"),
                       ("fit", "fit and propose from the proxies in the database (no training)"),
                       ("validate", "train the proposal, natural and uniform mixtures at the validation scale")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--experiment", required=True, help="gin file with the base config and MixtureExperiment")
        s.add_argument("--gin", action="append", default=[], help="extra binding (every run); may repeat")
        s.add_argument("--output", help="root of the experiment directories (MixtureExperiment.output)")
        if name == "run":
            s.add_argument("--proxy", type=int, action="append", default=[],
                           help="train only this proxy (0-based; may repeat): one job per proxy on a scheduler")
    return p


def _print_fit(summary: dict[str, Any]) -> None:
    rho = summary["loo_spearman"]
    print(f"{summary['proxies']} proxy runs; leave-one-out Spearman {rho:.3f}; "
          f"in-sample R^2 {summary['model']['r2']:.3f}")
    if not rho >= TRUSTED_SPEARMAN:
        print(f"warning: leave-one-out Spearman {rho:.3f} < {TRUSTED_SPEARMAN}: the fit does not rank mixtures it "
              "did not see, so the proposal is a weak guess; train the proxies longer (past the unigram plateau) "
              "or add proxies, and validate before using it")
    for d, (share, lo, hi) in outside_proxies(summary).items():
        print(f"warning: the proposal gives {d} {share:.3f}, outside the proxies' shares ({lo:.3f} to {hi:.3f}): "
              "the fit extrapolates there; raise its floor into that range, or train proxies that sample it")
    print("proposed: " + search.describe(np.array(list(summary["proposal"].values())), summary["domains"]))
    pred = summary["predicted"]
    print(f"predicted target: proposed {pred['proposal']:.4f}, natural {pred['natural']:.4f}, "
          f"uniform {pred['uniform']:.4f}; conclusion {summary['conclusion']}")


def _print_validation(report: dict[str, Any]) -> None:
    for label, f in report["figures"].items():
        print(f"{label:9s} target {f['mean']:.4f} (seed spread {f['spread']:.4f}, {len(f['runs'])} runs)")
    print(f"conclusion {report['conclusion']}: proposal better than natural by "
          f"{report['improvement_over']['natural']:.4f}, than uniform by "
          f"{report['improvement_over']['uniform']:.4f}; largest seed spread {report['largest_seed_spread']:.4f}; "
          f"{report['compute_ratio_to_proxy']:.1f}x a proxy's FLOPs: {report['status']}")
    print("paired by seed (other - proposed): " + "; ".join(
        f"{k} " + ", ".join(f"seed {s} {d:+.4f}" for s, d in by_seed.items())
        for k, by_seed in report.get("improvement_by_seed", {}).items()))
    short = [k for k, d in report["improvement_over"].items() if not d > report["largest_seed_spread"]]
    if short:
        print("not by more than the largest seed spread over: " + ", ".join(
            f"{k} ({report['improvement_over'][k]:.4f} <= {report['largest_seed_spread']:.4f})" for k in short))


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status (2: bad input)."""
    args = build_parser().parse_args(argv)
    if args.output:
        args.gin.append(f"MixtureExperiment.output = {args.output!r}")
    progress_lib.quiet_startup()
    # jaxpt's INFO lines (a line per proxy, the runs' own); the libraries' (Orbax's) only from WARNING up
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", force=True)
    logging.getLogger("jaxpt").setLevel(logging.INFO)
    try:
        if args.cmd == "validate":
            _print_validation(validate(args.experiment, args.gin))
        elif args.cmd == "fit":
            _print_fit(fit_and_propose(args.experiment, args.gin))
        else:
            summary = run_proxies(args.experiment, args.gin, args.proxy)
            if summary is not None:
                _print_fit(summary)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
