"""``python -m jaxpt.evaluate``: evaluate a checkpoint.

    python -m jaxpt.evaluate --workdir DIR [--step N] --lengths 512,1024,2048,4096 [--tolerance 0.05]
        [--trained-length T] [--heldout SRC] [--max-tokens 16384] [--batch-size 1] [--mesh data=8] [--output FILE]

With ``--lengths``: the length-extrapolation report (:mod:`jaxpt.eval.extrapolation`): held-out loss by position
bucket at each length, and the effective extrapolation length (the longest length whose tail loss stays within
``--tolerance``, relative, of the trained length's). It prints a table, writes the JSON (default
``<workdir>/extrapolation/step_<N>.json``) and a PNG plot next to it (same name, ``.png``).

Without ``--lengths``: everything else is ``python -m jaxpt.tools.evaluate`` (eval cards, comparisons, ...), same
arguments.

Exit status: 0 ok; 2 bad input (no checkpoint, a held-out set shorter than the longest length, bad flags).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from jaxpt.util import progress as progress_lib
from jaxpt.util import fs


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: comma-separated integers, e.g. 512,1024") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: each length must be >= 2")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpt.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="run directory holding checkpoints/")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    p.add_argument("--lengths", type=_lengths, required=True, help="context lengths, e.g. 512,1024,2048 (this command; without --lengths, the arguments are "
                   "python -m jaxpt.tools.evaluate's)")
    p.add_argument("--trained-length", type=int, help="the reference length (default: the checkpoint's seq_len)")
    p.add_argument("--tolerance", type=float, default=None, help="relative tolerance of the effective length "
                   "(default 0.05)")
    p.add_argument("--heldout", help="held-out source (file or directory); default: the run's")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens scored per length (default 16384)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per device call (default 1)")
    p.add_argument("--mesh", help="mesh to restore onto, e.g. data=8 (default: the saved one)")
    p.add_argument("--output", help="report JSON (the plot goes next to it, .png)")
    return p


def format_report(report: dict) -> str:
    """A text table: one line per length (loss, tail loss, tokens, documents at least that long)."""
    lines = [f"step {report['checkpoint']['step']}, trained length {report['trained_length']}, "
             f"RoPE {report['rope']['rope_scaling']} theta {report['rope']['rope_theta']:g}",
             f"{'length':>8} {'loss':>8} {'tail':>8} {'tokens':>8} {'docs>=L':>8}"]
    for L, e in sorted(report["lengths"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{int(L):>8} {e['loss']:>8.4f} {e['tail_loss']:>8.4f} {e['tokens']:>8} "
                     f"{e['documents_at_least']:>8}")
    lines.append(f"effective extrapolation length: {report['effective_extrapolation_length']} "
                 f"(tolerance {report['tolerance']:.0%} on the tail loss)")
    return "\n".join(lines)


def run_extrapolation(args) -> int:
    """The ``--lengths`` command; returns the exit status."""
    import jaxpt
    from jaxpt.eval import extrapolation, heldout
    restored = jaxpt.restore(args.workdir, args.step, mesh=args.mesh)
    source = args.heldout or heldout.run_sources(restored.config.data)[0]
    texts = [d.text for d in heldout.load_documents(source)]
    tol = extrapolation.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    report = extrapolation.measure(restored, args.lengths, texts=texts, trained_length=args.trained_length,
                                   tolerance=tol, max_tokens=args.max_tokens, batch_size=args.batch_size)
    report["checkpoint"]["workdir"] = fs.absolute(args.workdir)
    report["heldout_source"] = source
    output = args.output or fs.join(args.workdir, "extrapolation", f"step_{restored.step}.json")
    fs.makedirs(fs.dirname(fs.absolute(output)))
    report["plot"] = os.path.splitext(output)[0] + ".png"
    label = fs.basename(fs.absolute(args.workdir))
    extrapolation.plot(report, report["plot"], label=label)  # local or gs:// (fs.write_figure)
    fs.write_text_atomic(output, json.dumps(report, indent=2))
    print(format_report(report))
    print(f"wrote {output} and {report['plot']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):  # both faces of the command, extrapolation first
        _parser().print_help()
        print("\nWithout --lengths, the arguments go to python -m jaxpt.tools.evaluate:\n")
        from jaxpt.tools import evaluate as tools_evaluate
        return tools_evaluate.main(argv)
    if not any(a == "--lengths" or a.startswith("--lengths=") for a in argv):
        from jaxpt.tools import evaluate as tools_evaluate
        return tools_evaluate.main(argv)
    args = _parser().parse_args(argv)
    progress_lib.quiet_startup()
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(message)s", force=True)
    from jaxpt.checkpoint import CheckpointError
    try:
        return run_extrapolation(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
