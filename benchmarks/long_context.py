"""Long-context extension on CPU (issue 14): 200 steps at 128 tokens, then 100 at 512 with a new RoPE base,
continued from the step-200 checkpoint; then the length-extrapolation report of both checkpoints.

Runs the same commands the README's "Long context" section lists (``python -m jaxpt.train`` twice,
``python -m jaxpt.tools.evaluate extrapolation`` twice) on one CPU device, then prints each stage's figures, the
``run.json`` stages of the extension, and each checkpoint's loss per length and effective extrapolation length.

    python benchmarks/long_context.py [--workdir workdirs/longctx] [--lengths 128,256,512,1024,2048,4096]

Needs the prepared sample (``make prepare``). Figures only, never pass/fail; a few minutes on an idle 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = ["--config", "configs/quickstart.gin", "--config", "configs/longctx/base_128.gin"]


def _run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return time.perf_counter() - t0


def _final(workdir: str) -> dict:
    with open(os.path.join(workdir, "run.json")) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="workdirs/longctx", help="parent of the two run directories")
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--max-tokens", default="8192", help="held-out tokens scored per length")
    args = p.parse_args()
    base, ext = os.path.join(args.workdir, "base_128"), os.path.join(args.workdir, "extend_512")
    py = sys.executable
    times = {
        "stage 1": _run([py, "-m", "jaxpt.train", *CONFIGS, "--mesh", "data=1", "--workdir", base]),
        "stage 2": _run([py, "-m", "jaxpt.train", *CONFIGS, "--config", "configs/longctx/extend_512.gin",
                         "--gin", f"TrainConfig.init_from = '{base}@200'", "--mesh", "data=1", "--workdir", ext]),
    }
    reports = {}
    for name, wd in (("base_128", base), ("extend_512", ext)):
        out = os.path.join(args.workdir, f"extrapolation_{name}.json")
        times[f"eval {name}"] = _run([py, "-m", "jaxpt.tools.evaluate", "extrapolation", "--workdir", wd,
                                      "--lengths", args.lengths, "--max-tokens", args.max_tokens, "--mesh", "data=1",
                                      "--output", out])
        with open(out) as f:
            reports[name] = json.load(f)
    print("\n== stages (run.json of the extension) ==")
    for s in _final(ext)["stages"]:
        print(f"  {s['name']:<12} steps {s['start_step']:>4} -> {s.get('end_step', s.get('target_steps'))}, "
              f"seq_len {s.get('seq_len')}, parent {s['parent']}")
    for name, wd in (("base_128", base), ("extend_512", ext)):
        f = _final(wd)["final"]
        print(f"  {name}: train loss (mean of last 20) {f['train_loss_mean_last20']:.4f}, held-out loss "
              f"{f['heldout_loss']:.4f} at its own length")
    print("\n== held-out loss by length (all positions / tail [L/2, L)) ==")
    lengths = sorted({int(L) for r in reports.values() for L in r["lengths"]})
    print(f"  {'checkpoint':<12}" + "".join(f"{L:>16}" for L in lengths) + "   effective")
    for name, r in reports.items():
        cells = "".join(f"{r['lengths'][str(L)]['loss']:>8.3f}/{r['lengths'][str(L)]['tail_loss']:<7.3f}"
                        if str(L) in r["lengths"] else f"{'':>16}" for L in lengths)
        print(f"  {name:<12}{cells}   {r['effective_extrapolation_length']} (tolerance {r['tolerance']:.0%}, "
              f"trained {r['trained_length']})")
        print(f"  {'':<12}plot: {r['plot']}")
    print("\n== wall time ==")
    for k, v in times.items():
        print(f"  {k}: {v:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
