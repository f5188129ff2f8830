"""Per-chip memory of the Llama-3-8B train step on a v5p-128 slice (64 chips, 2 x 8192 tokens per chip), compiled
ahead of time on this host: jaxpt beside MaxText.

jaxpt's figure comes from ``python -m jaxpt.tools.compile --json`` (needs the ``tpu`` extra). MaxText's comes from its
``train_compile`` run by ``MAXTEXT_PYTHON`` (an interpreter with MaxText installed, e.g. Python 3.12) when that
is set; otherwise the figure recorded on this host is printed as the anchor:

    MaxText 0.2.5 train_compile, llama3-8b, v5p-128, per_device_batch_size=2, max_target_length=8192,
    remat_policy=full, scan_layers, bf16 compute, fp32 weights, FSDP over 64 chips:
    arguments 1.51 GB, temp 14.14 GB, total 15.65 GB per chip; compiled in 4 min 52 s on 2 cores.

    python benchmarks/aot_memory.py [--gin 'ModelConfig.attention_impl = "splash"' ...] [--offload]

``--offload`` adds a row compiled with ``TrainConfig.offload_optimizer_state = True`` (the optimizer state in
pinned host memory), with its host bytes.

GB here is 1e9 bytes (MaxText's unit). Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
ANCHOR = {"arguments": 1.51e9, "temp": 14.14e9, "total": 15.65e9, "compile_seconds": 4 * 60 + 52}
MAXTEXT_ARGS = ["compile_topology=v5p-128", "compile_topology_num_slices=1", "model_name=llama3-8b",
                "per_device_batch_size=2", "max_target_length=8192", "remat_policy=full", "scan_layers=true",
                "dtype=bfloat16", "weight_dtype=float32", "ici_fsdp_parallelism=64"]


def jaxpt_figures(extra_gin: list[str]) -> dict:
    """Run ``python -m jaxpt.tools.compile --json`` for the 8B preset on v5p-128; returns its JSON object."""
    cmd = [sys.executable, "-m", "jaxpt.tools.compile", "--config", "configs/models/llama3_8b.gin",
           "--config", "configs/slices/v5p-128.gin", "--gin", "TrainConfig.seq_len = 8192",
           "--gin", "TrainConfig.global_batch_size = 128", "--topology", "v5p-128", "--json"]
    for g in extra_gin:
        cmd += ["--gin", g]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"jaxpt.tools.compile failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**r["bytes_per_chip"], "compile_seconds": r["compile_seconds"]}


def _row(name: str, f: dict) -> str:
    host = f"{f['host_total'] / 1e9:>10.2f}" if "host_total" in f else f"{'-':>10}"
    return (f"{name:<28}{f['arguments'] / 1e9:>10.2f}{f['temp'] / 1e9:>10.2f}{f['total'] / 1e9:>10.2f}{host}"
            f"{f['compile_seconds']:>11.0f}")


def maxtext_figures(python: str) -> dict:
    """Run MaxText's ``train_compile`` with :data:`MAXTEXT_ARGS` and parse its "... size: X GB" lines."""
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-m", "MaxText.train_compile", "MaxText/configs/base.yml", *MAXTEXT_ARGS],
                          capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    seconds = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    get = lambda name: re.search(rf"{name} size: ([\d.]+) ?GB", text, re.I)  # noqa: E731
    found = {k: get(n) for k, n in (("total", "Total memory"), ("arguments", "Argument"), ("temp", "Temp"))}
    if proc.returncode or not all(found.values()):
        raise SystemExit(f"MaxText train_compile failed or printed no memory figures:\n{text[-4000:]}")
    return {**{k: float(m.group(1)) * 1e9 for k, m in found.items()}, "compile_seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gin", action="append", default=[], help="extra binding for the jaxpt compile")
    p.add_argument("--offload", action="store_true", help="also compile with the optimizer state in host memory")
    args = p.parse_args()
    rows = [("jaxpt", jaxpt_figures(args.gin))]
    if args.offload:
        offload = [*args.gin, "TrainConfig.offload_optimizer_state = True"]
        rows.append(("jaxpt, opt state on host", jaxpt_figures(offload)))
    python = os.environ.get("MAXTEXT_PYTHON")
    rows.append(("MaxText (measured now)", maxtext_figures(python)) if python else ("MaxText (recorded)", ANCHOR))
    print(f"{'per chip, GB (device)':<28}{'arguments':>10}{'temp':>10}{'total':>10}{'host':>10}{'compile s':>11}")
    for name, f in rows:
        print(_row(name, f))


if __name__ == "__main__":
    main()
