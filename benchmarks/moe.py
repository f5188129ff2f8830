"""Mixture-of-experts figures: the planner's all-to-all estimate for Mixtral-8x7B on v5p-128 by expert-parallel
size, the all-to-alls in the compiled quickstart_moe step, and the summary of a quickstart_moe training run.

    python benchmarks/moe.py [--run WORKDIR]          # WORKDIR: a finished `jaxpt.train` run of quickstart_moe.gin

The training summary reads ``WORKDIR/metrics.jsonl``: loss at step 1 and its last value and ratio (the issue asks
for < 0.75 within 300 steps), the smallest expert share of any MoE layer after step 100 (asks >= 5%), by
layer, and how many logged steps after 100 have an expert under 5%, the mean dropped fraction and
load-balancing loss. Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(REPO))


def planner_table() -> None:
    from jaxpt import config as C
    from jaxpt.run.validate import validate
    from jaxpt.lab import plan
    from jaxpt.training import memory
    hw = plan.parse_hardware("v5p-128")
    print("Mixtral-8x7B on v5p-128 (64 chips), 2 x 8192 tokens per chip, capacity factor 1.25, full remat:")
    print(f"{'mesh':>18} {'GiB sent/chip/step':>19} {'a2a ms (lower bound)':>21} {'compute ms @40%':>16} "
          f"{'ratio':>6} {'planner GiB/chip':>17}")
    for mesh in ("expert=8,fsdp=-1", "expert=4,fsdp=-1", "expert=2,fsdp=-1"):
        cfg = C.parse([str(REPO / "configs/quickstart.gin"), str(REPO / "configs/models/mixtral_8x7b.gin"),
                       str(REPO / "configs/slices/v5p-128.gin")], [f"TrainConfig.mesh = '{mesh}'"])
        sizes = validate(cfg, hw.num_chips)
        a = plan.all_to_all_estimate(cfg, sizes, hw)
        mem = memory.estimate_memory(cfg, sizes, hw.accelerator.memory_bytes)
        print(f"{mesh:>18} {a['bytes_per_device'] / 2**30:>19.1f} {a['seconds'] * 1e3:>21.0f} "
              f"{a['compute_seconds'] * 1e3:>16.0f} {a['fraction_of_compute']:>6.1%} {mem.total / 2**30:>17.1f}")


def hlo_all_to_alls() -> None:
    from jaxpt.run import build as builder
    from jaxpt import config as C
    cfg = C.parse([str(REPO / "configs/quickstart_moe.gin")], ["ModelConfig.vocab_size = 512"])
    built = builder.build_for(cfg)
    text = built.lower_train_step().compile().as_text()
    n = len(re.findall(r"= \S+ all-to-all\(", text)) or text.count("all-to-all(")
    print(f"quickstart_moe train step on {cfg.mesh}: {n} all-to-all ops in the compiled HLO "
          f"({cfg.model.num_layers} MoE layers)")


def run_summary(workdir: str) -> None:
    from jaxpt.run import monitor
    recs = [r for r in monitor.read_metrics(workdir) if "loss" in r and "event" not in r]
    if not recs:
        print(f"{workdir}: no step records")
        return
    first, last = recs[0], recs[-1]
    share_keys = [k for k in first if k.startswith("moe/expert_share/")]
    late = [r for r in recs if r["step"] > 100]
    min_share = min((r[k], r["step"], k) for r in late for k in share_keys) if late else None
    drop = sum(r["moe/dropped_fraction"] for r in recs) / len(recs)
    print(f"{workdir}: steps 1..{last['step']}: loss {first['loss']:.4f} -> {last['loss']:.4f} "
          f"(ratio {last['loss'] / first['loss']:.3f}); first step under 0.75 x step 1: "
          f"{next((r['step'] for r in recs if r['loss'] < 0.75 * first['loss']), None)}")
    if min_share:
        print(f"  smallest expert share after step 100: {min_share[0]:.3f} at step {min_share[1]} ({min_share[2]})")
        layers = sorted({k.split("/")[2] for k in share_keys}, key=lambda n: int(n[len("layer"):]))
        per_layer = {n: min(r[k] for r in late for k in share_keys if k.split("/")[2] == n) for n in layers}
        print("  smallest share after step 100 by layer: "
              + ", ".join(f"{n} {v:.3f}" for n, v in per_layer.items()))
        under = [r["step"] for r in late if min(r[k] for k in share_keys) < 0.05]
        print(f"  logged steps after 100 with an expert under 5%: {len(under)} of {len(late)}"
              + (f" (first {under[0]})" if under else ""))
        first_under = next((r["step"] for r in recs if min(r[k] for k in share_keys) < 0.05), None)
        print(f"  first logged step with an expert under 5% (any step): {first_under}")
    print(f"  mean dropped fraction {drop:.3f}; load-balancing loss {first['moe/load_balance_loss']:.3f} -> "
          f"{last['moe/load_balance_loss']:.3f}; router z-loss {first['moe/router_z_loss']:.3f} -> "
          f"{last['moe/router_z_loss']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="workdir of a quickstart_moe training run")
    ap.add_argument("--skip-hlo", action="store_true", help="skip compiling the quickstart_moe step")
    args = ap.parse_args()
    planner_table()
    if not args.skip_hlo:
        hlo_all_to_alls()
    if args.run:
        run_summary(args.run)


if __name__ == "__main__":
    main()
