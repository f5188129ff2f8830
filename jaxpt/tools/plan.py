"""``python -m jaxpt.tools.plan``: defend a model size, a token count and a layout with numbers before a run.

    python -m jaxpt.tools.plan --flops 5.76e23 --hardware v5p-256 --mfu 0.45
    python -m jaxpt.tools.plan --params 7e9 --json
    python -m jaxpt.tools.plan --config configs/quickstart.gin --mesh fsdp=-1 --hardware v5e-8
    python -m jaxpt.tools.plan --mtbf-hours 24 --save-seconds 30 --restart-seconds 300 --step-seconds 2
    python -m jaxpt.tools.plan --config configs/quickstart.gin --config configs/models/mixtral_8x7b.gin \
        --config configs/slices/v5p-128.gin --mesh expert=8,fsdp=-1 --hardware v5p-128

What each number is and where it comes from: :mod:`jaxpt.lab.plan`. Exit 2 on bad input (one line, or a JSON
object with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.config import ConfigError
from jaxpt.lab import rules as rules_lib
from jaxpt.lab.plan import (ACCELERATORS, Slice, add_hardware, checkpoint_plan, format_checkpoint_plan, format_plan,
                            parse_hardware, plan_config, plan_flops, plan_params, resolve_vocab)
from jaxpt.run.validate import validate
from jaxpt.util.errors import report_cli_error


def config_plan(args, hw: Slice | None) -> dict[str, Any]:
    cfg = resolve_vocab(config_lib.from_args(args))
    spec = mesh_lib.parse_mesh_spec(cfg.mesh)
    if hw is not None:
        n_dev = hw.num_chips
    elif args.devices:
        n_dev = args.devices
    elif -1 not in spec.values():
        n_dev = math.prod(spec.values())
    else:
        import jax
        n_dev = jax.device_count()
    sizes = validate(cfg, n_dev)
    return plan_config(cfg, sizes, hw, args.tokens, args.mfu)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.plan", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--flops", type=float, help="compute budget in FLOPs, e.g. 5.76e23")
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    config_lib.add_arguments(p)  # --config/--gin/--mesh/...
    p.add_argument("--tokens", type=float, help="with --config: tokens to plan for (default: 20 x params)")
    p.add_argument("--devices", type=int, help="with --config and no --hardware: device count for the mesh")
    p.add_argument("--hardware", help=f"slice, e.g. v5p-256, v5e-64, h100-8 (kinds: {', '.join(sorted(ACCELERATORS))})")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization for wall clock (default 0.4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rules", help="learning-rate/batch rules file (python -m jaxpt.tools.scaling rules): print the "
                                   "recommended peak learning rate and global batch for the planned compute")
    ck = p.add_argument_group("checkpoint interval (Young 1974 / Daly 2006)")
    ck.add_argument("--mtbf-hours", type=float, help="mean time between failures of the whole job, hours")
    ck.add_argument("--save-seconds", type=float, help="seconds one checkpoint save blocks training")
    ck.add_argument("--restart-seconds", type=float, default=0.0,
                    help="seconds from a failure to training again (restart, restore, compile)")
    ck.add_argument("--step-seconds", type=float,
                    help="seconds per step: gives the interval in steps and, with --config, compares it with "
                         "CheckpointConfig.save_every_steps")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen = [k for k in ("flops", "params", "config") if getattr(args, k)]
    for flag, v in (("--mtbf-hours", args.mtbf_hours), ("--save-seconds", args.save_seconds)):
        if v is not None and (v <= 0 if flag == "--mtbf-hours" else v < 0):
            return report_cli_error(f"{flag} {v}: must be {'positive' if flag == '--mtbf-hours' else '>= 0'}",
                                    args.json)
    if (args.mtbf_hours is None) != (args.save_seconds is None):
        return report_cli_error("--mtbf-hours and --save-seconds go together", args.json)
    if len(chosen) > 1 or (not chosen and args.mtbf_hours is None):
        return report_cli_error("give exactly one of --flops, --params, --config (or only "
                                "--mtbf-hours/--save-seconds)", args.json)
    try:
        ckpt = None
        if args.mtbf_hours is not None:
            every = None
            if args.config:
                every = config_lib.from_args(args).checkpoint.save_every_steps
            ckpt = checkpoint_plan(args.mtbf_hours, args.save_seconds, args.restart_seconds, args.step_seconds,
                                   every)
        if not chosen:
            print(json.dumps(ckpt, indent=1) if args.json else format_checkpoint_plan(ckpt))
            return 0
        hw = parse_hardware(args.hardware) if args.hardware else None
        if args.flops:
            plan = plan_flops(args.flops)
        elif args.params:
            plan = plan_params(args.params)
        else:
            plan = config_plan(args, hw)
        plan = add_hardware(plan, hw, args.mfu)
        if args.rules:
            plan["lr_batch_rules"] = rules_lib.recommend(rules_lib.load_rules(args.rules), plan["flops"],
                                                         plan.get("seq_len"), plan.get("flops_method"))
    except (ValueError, ConfigError, FileNotFoundError) as e:
        return report_cli_error(str(e), args.json)
    if ckpt is not None:
        plan["checkpoint_interval"] = ckpt
    text = format_plan(plan) + ("\n" + format_checkpoint_plan(ckpt) if ckpt is not None else "")
    print(json.dumps(plan, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
