"""Hugging Face checkpoints in and out: ``python -m jaxpt.tools.convert hf-to-jaxpt | jaxpt-to-hf``.

    python -m jaxpt.tools.convert hf-to-jaxpt --model PATH --output DIR [--mesh fsdp=8] [--scan-layers]
        [--max-seq-len N]
    python -m jaxpt.tools.convert jaxpt-to-hf --workdir RUN [--step N] --output DIR

The families, the layout and what is refused: :mod:`jaxpt.hf`. Prints the folder written; exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxpt.checkpoint import CheckpointError
from jaxpt.hf.convert import hf_to_jaxpt, jaxpt_to_hf
from jaxpt.util import cli
from jaxpt.util.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.convert`` (subcommands ``hf-to-jaxpt``, ``jaxpt-to-hf``)."""
    parser = argparse.ArgumentParser(prog="python -m jaxpt.tools.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-jaxpt", help="an HF Llama/Mistral/Qwen2/Qwen3 folder -> a jaxpt checkpoint + model.gin")
    a.add_argument("--model", required=True, help="folder with config.json and *.safetensors (local or gs://)")
    a.add_argument("--output", required=True, help="jaxpt checkpoint folder to write (local or gs://)")
    a.add_argument("--mesh", default=None, help="e.g. fsdp=8 (default: fsdp over all devices)")
    cli.add_flag(a, "--max-seq-len", "--max_seq_len", type=int, default=0, help="default: max_position_embeddings")
    cli.add_flag(a, "--scan-layers", "--scan_layers", action="store_true",
                 help="stacked-layers layout (ModelConfig.scan_layers)")
    b = sub.add_parser("jaxpt-to-hf", help="a jaxpt run's checkpoint -> a transformers-loadable folder")
    b.add_argument("--workdir", required=True)
    b.add_argument("--step", type=int, default=None)
    b.add_argument("--output", required=True, help="local or gs:// (written locally, then uploaded)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status (2: bad input)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-jaxpt":
            out = hf_to_jaxpt(args.model, args.output, mesh=args.mesh, max_seq_len=args.max_seq_len,
                              scan_layers=args.scan_layers)
        else:
            out = jaxpt_to_hf(args.workdir, args.output, step=args.step)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
