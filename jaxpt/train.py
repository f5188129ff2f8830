"""``python -m jaxpt.train``: train a model from a gin config (:func:`jaxpt.run.session.run_training`).

Parses the flags into a :class:`jaxpt.config.TrainConfig`, joins the other processes of a multi-host run
(:mod:`jaxpt.run.distributed`), and either prints the plan (``--dry-run``, :mod:`jaxpt.run.resolve`) or trains; maps
each refusal to its exit status (2 config, 3 checkpoint, 4 divergence, 75 preempted).
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax

from jaxpt import config as config_lib
from jaxpt.checkpoint import CheckpointError
from jaxpt.run import distributed, resolve as preflight
from jaxpt.run.preemption import PREEMPTED_EXIT_CODE, Preempted
from jaxpt.run.session import Run, run_training, setup  # noqa: F401  the trainer's API, as scripts import it
from jaxpt.tools import compile as compile_lib
from jaxpt.training.stability import DivergenceError
from jaxpt.util import cli, progress as progress_lib
from jaxpt.util.errors import ConfigError


def dry_run(cfg, topology: str | None = None, num_slices: int = 1, notes=()) -> str:
    """The dry run's plan text (:func:`jaxpt.run.resolve.plan`): for this job's devices, or for a target slice
    (``topology``, :func:`jaxpt.tools.compile.make_target`: compile-only devices, the chip's HBM).

    Raises:
      ConfigError, CheckpointError: as :func:`jaxpt.run.resolve.resolve`; a topology this host cannot make.
    """
    if topology is None:
        return preflight.format_plan(preflight.plan(preflight.resolve(cfg), notes=notes))
    target = compile_lib.make_target(topology, num_slices)
    resolved = preflight.resolve(compile_lib.with_slices(cfg, target.num_slices), devices=target.devices)
    p = preflight.plan(resolved, devices=target.devices, device_bytes=target.hbm_bytes, notes=notes)
    p["target"] = {"topology": target.topology or target.name, "chips": target.chips, "num_slices": target.num_slices}
    return preflight.format_plan(p)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jaxpt.train", description=__doc__.splitlines()[0])
    config_lib.add_arguments(parser)
    distributed.add_arguments(parser)
    cli.add_flag(parser, "--dry-run", "--dry_run", action="store_true", help="check config, mesh, paths, tokenizer "
                 "and the resume target, print the plan; compile and write nothing (jaxpt.run.resolve)")
    parser.add_argument("--topology", help="with --dry-run: plan for this target slice instead of this host's devices "
                        "(as python -m jaxpt.tools.compile takes it: v5p-128, v5e-256, v6e-256, v5p:4x4x4, cpu:N; "
                        "TPU names need the tpu extra)")
    parser.add_argument("--num-slices", type=int, default=1, help="with --topology: slices over the data-center "
                        "network (default 1)")
    args = parser.parse_args(argv)
    if args.topology and not args.dry_run:
        parser.error("--topology plans a target slice: it goes with --dry-run (on the slice itself, run without it)")
    progress_lib.quiet_startup()
    try:
        cfg = config_lib.from_args(args)  # parse first: a config error needs no cluster
        startup = distributed.initialize(args)
        logging.basicConfig(level=logging.WARNING, force=True,
                            format=f"[%(asctime)s p{jax.process_index()}] %(name)s: %(message)s")
        logging.getLogger("jaxpt").setLevel(logging.INFO)
        distributed.log_startup(startup)
        notes = [] if config_lib.data_named() else [config_lib.DEFAULT_DATA_NOTE]
        for note in notes:
            logging.getLogger("jaxpt.train").warning("%s", note)
        if args.dry_run:
            print(dry_run(cfg, args.topology, args.num_slices, notes))
        else:
            run_training(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        if "devices are present" in str(e) and jax.default_backend() == "cpu":
            print("hint: on a CPU host, simulate devices with "
                  "XLA_FLAGS=--xla_force_host_platform_device_count=8 (the Makefile sets it)", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    except DivergenceError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 4
    except Preempted as e:
        print(f"preempted at step {e.args[0]}: checkpoint committed; rerun the same command to resume",
              file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
