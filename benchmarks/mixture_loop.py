"""The closed mixture loop at CPU scale (#36): proxies, fit, proposal, and its validation at a larger scale.

    python -m jaxpt.data.prepare --output artifacts/sample      # once
    python benchmarks/mixture_loop.py --experiment configs/mixtures/sample.gin

Runs ``python -m jaxpt.tools.mixtures run`` and ``validate`` on the experiment file (both resume: what the database
already holds is not trained again), then prints the figures the results page reports: the proxy and validation
models (parameters, train-state bytes, tokens, FLOPs, wall time per run), the fit (leave-one-out Spearman between
predicted and measured target, in-sample R^2, ridge penalty), the proposal against the natural and uniform mixtures
(predicted at proxy scale, measured at validation scale with the seed spread), and the verdict. Figures only, never
pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(REPO))


def _model_line(what: str, cfg, runs: list[dict]) -> str:
    from jaxpt.model.decoder import count_params
    from jaxpt.lab import plan
    m = plan.resolve_vocab(cfg).model
    n = count_params(m)["total"]
    state_bytes = n * 4 * 3  # fp32 params + AdamW's two moments
    toks = sum(r["tokens"] for r in runs) / max(len(runs), 1)
    flops = sum(r["flops"] for r in runs) / max(len(runs), 1)
    wall = sum(r["wall_s"] or 0 for r in runs) / max(len(runs), 1)
    return (f"{what}: {len(runs)} runs of {n / 1e6:.2f}M params (d_model {m.d_model}, {m.num_layers} layers; train "
            f"state {state_bytes / 2**20:.1f} MiB), {toks:,.0f} tokens, {flops:.3g} FLOPs, {wall:.0f} s wall each")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", default=str(REPO / "configs/mixtures/sample.gin"))
    p.add_argument("--skip-validation", action="store_true")
    args = p.parse_args(argv)
    from jaxpt import config as config_lib
    from jaxpt.tools import mixtures
    cmd = ["--experiment", args.experiment]
    if mixtures.main(["run", *cmd]) or (not args.skip_validation and mixtures.main(["validate", *cmd])):
        return 1
    exp, base = mixtures.load_experiment(args.experiment)
    db = mixtures.open_database(exp)
    fit = json.loads(pathlib.Path(exp.directory, "fit.json").read_text())
    proxies = db.runs(experiment_id=exp.name, role=mixtures.PROXY_ROLE)
    print("\n== mixture loop figures ==")
    print(_model_line("proxies", config_lib.parse([args.experiment], mixtures.run_bindings(
        exp, base, "/tmp/x", fit["domains"], [1.0] * len(fit["domains"]), exp.proxy_model, exp.proxy_tokens)),
        proxies))
    print(f"fit: leave-one-out Spearman {fit['loo_spearman']:.3f} over {fit['proxies']} proxies; in-sample R^2 "
          f"{fit['model']['r2']:.3f}; ridge alpha {fit['model']['alpha']:.3g}")
    print("proposal: " + ", ".join(f"{d} {w:.3f}" for d, w in fit["proposal"].items()))
    print("natural:  " + ", ".join(f"{d} {w:.3f}" for d, w in fit["natural"].items()))
    print("predicted target (proxy scale): " + ", ".join(f"{k} {v:.4f}" for k, v in fit["predicted"].items()))
    vfile = pathlib.Path(exp.directory, "validation.json")
    if vfile.exists():
        val = json.loads(vfile.read_text())
        vruns = [r for r in db.runs(experiment_id=exp.name) if r["role"].startswith(mixtures.VALIDATION_ROLE)]
        print(_model_line("validation", config_lib.parse([args.experiment], mixtures.run_bindings(
            exp, base, "/tmp/x", fit["domains"], [1.0] * len(fit["domains"]), exp.validation_model,
            exp.validation_tokens)), vruns))
        for label, f in val["figures"].items():
            print(f"  {label:9s} target {f['mean']:.4f} (seeds {', '.join(f'{t:.4f}' for t in f['targets'])}; "
                  f"spread {f['spread']:.4f})")
        print(f"proposal better than natural by {val['improvement_over']['natural']:+.4f}, than uniform by "
              f"{val['improvement_over']['uniform']:+.4f}; largest seed spread {val['largest_seed_spread']:.4f}; "
              f"{val['compute_ratio_to_proxy']:.1f}x a proxy's FLOPs: {val['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
