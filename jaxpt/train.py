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
from jaxpt.training.stability import DivergenceError
from jaxpt.util import cli, progress as progress_lib
from jaxpt.util.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jaxpt.train", description=__doc__.splitlines()[0])
    config_lib.add_arguments(parser)
    distributed.add_arguments(parser)
    cli.add_flag(parser, "--dry-run", "--dry_run", action="store_true", help="check config, mesh, paths, tokenizer "
                 "and the resume target, print the plan; compile and write nothing (jaxpt.run.resolve)")
    args = parser.parse_args(argv)
    progress_lib.quiet_startup()
    try:
        cfg = config_lib.from_args(args)  # parse first: a config error needs no cluster
        startup = distributed.initialize(args)
        logging.basicConfig(level=logging.WARNING, force=True,
                            format=f"[%(asctime)s p{jax.process_index()}] %(name)s: %(message)s")
        logging.getLogger("jaxpt").setLevel(logging.INFO)
        distributed.log_startup(startup)
        if args.dry_run:
            print(preflight.format_plan(preflight.plan(preflight.resolve(cfg))))
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
