"""``python -m jaxpt.tools.scaling``: train a grid of model sizes x token budgets, then fit a scaling law.

    python -m jaxpt.tools.scaling run --grid configs/scaling/grid.gin            # -> runs/scaling/runs.jsonl
    python -m jaxpt.tools.scaling fit runs/scaling --predict-params 1e7 --predict-tokens 2e8
    python -m jaxpt.tools.scaling rules runs/rules --output runs/rules/rules.json   # lr x batch x compute grid

The grid, the fit and the rules: :mod:`jaxpt.lab.scaling` and :mod:`jaxpt.lab.rules`. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from jaxpt import config as config_lib
from jaxpt.config import ConfigError
from jaxpt.lab import rules as rules_lib
from jaxpt.lab.scaling import N_KINDS, fit_runs, param_counts, read_grid_runs, run_grid
from jaxpt.util import cli, fs, jsonl


def _predict_target(args) -> tuple[float, float] | None:
    if args.predict_config:
        cfg = config_lib.parse(args.predict_config, args.gin)
        n = param_counts(cfg)[args.n_kind]
        d = args.predict_tokens or cfg.steps * cfg.global_batch_size * cfg.seq_len
        return float(n), float(d)
    if args.predict_params:
        if not args.predict_tokens:
            raise ValueError("--predict-params needs --predict-tokens")
        return args.predict_params, args.predict_tokens
    return None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.scaling`` (subcommands ``run`` and ``fit``)."""
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.scaling", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the grid")
    r.add_argument("--grid", required=True, help="gin file with the base config and ScalingGrid bindings")
    r.add_argument("--gin", action="append", default=[], help="extra binding for every run; may repeat")
    r.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compile cache")
    r.add_argument("--output", help="directory of the grid's runs and runs.jsonl (ScalingGrid.output)")
    f = sub.add_parser("fit", help="fit L(N, D) to finished runs")
    f.add_argument("runs", nargs="+", help="run directories (holding runs.jsonl) or runs.jsonl files")
    f.add_argument("--n-kind", default="non_embedding", choices=N_KINDS, help="which parameter count is N")
    f.add_argument("--loss", default="linear", choices=("linear", "huber"))
    f.add_argument("--f-scale", type=float, default=0.01, help="Huber delta in nats (with --loss huber)")
    f.add_argument("--predict-params", type=float, help="N of a larger model to predict")
    f.add_argument("--predict-tokens", type=float, help="D for the prediction")
    f.add_argument("--predict-config", action="append", default=[], help="gin file of a model to predict")
    f.add_argument("--gin", action="append", default=[], help="bindings for --predict-config")
    cli.add_flag(f, "--output", "--out", help="directory for fit.json and scaling_fit.png (default: the first RUNS "
                 "directory)")
    ru = sub.add_parser("rules", help="fit learning-rate and batch-size rules to an lr x batch x compute grid")
    ru.add_argument("runs", nargs="+", help="run directories (holding runs.jsonl) or runs.jsonl files")
    ru.add_argument("--tolerance", type=float, default=rules_lib.DEFAULT_TOLERANCE,
                    help="near-optimal: held-out loss within this relative margin of the budget's best (default "
                         "0.0025, DeepSeek's 0.25%%)")
    ru.add_argument("--output", help="rules JSON file (default: rules.json beside the first RUNS)")
    return p


def rules_cmd(args) -> dict[str, Any]:
    """``rules``: fit the lr/batch rules to the runs and write the rules file. Returns the result plus its path."""
    result = rules_lib.fit_rules(read_grid_runs(args.runs), args.tolerance)
    first = args.runs[0]
    out = args.output or fs.join(first if fs.isdir(first) else (fs.dirname(first) or "."), "rules.json")
    fs.write_text_atomic(out, jsonl.dumps(result, indent=1))
    return {**result, "path": out}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status (2: bad input)."""
    args = build_parser().parse_args(argv)
    # force: an imported library (grain/absl) already put a handler on the root logger, which would
    # make basicConfig a no-op and leave INFO unprinted.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", force=True)
    try:
        if args.cmd == "rules":
            result = rules_cmd(args)
            print(rules_lib.format_rules(result) + f"\nwrote {result['path']}")
            return 0
        if args.cmd == "run":
            bindings = [*args.gin, *([f"ScalingGrid.output = {args.output!r}"] if args.output else [])]
            records = run_grid(args.grid, bindings, compile_cache=not args.no_compile_cache)
            print(f"{len(records)} runs in the grid:")
            for rec in records:
                print(f"  {rec['name']}: N={rec['params']['non_embedding']:,} (non-embedding), "
                      f"D={rec['tokens']:,}, held-out loss {rec['heldout_loss']:.4f}")
            return 0
        result = fit_runs(args.runs, n_kind=args.n_kind, loss=args.loss, f_scale=args.f_scale,
                          predict=_predict_target(args), out_dir=args.output)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result["text"])
    if "prediction" in result:
        pr = result["prediction"]
        print(f"predicted held-out loss at N={pr['params']:.4g}, D={pr['tokens']:.4g}: "
              f"{pr['loss']:.4f} +- {pr['stderr']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
